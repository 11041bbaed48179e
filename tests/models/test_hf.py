"""HF checkpoints: logits parity with transformers, exact HF -> podtrain -> HF round trips, clear errors."""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import stat

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from flax import nnx
from hf_fixtures import KINDS, hf_logits, make_hf_model, save_hf_model
from safetensors.numpy import load_file, save_file
from safetensors.torch import load_file as load_torch_file
from safetensors.torch import save_file as save_torch_file
from transformers import AutoModelForCausalLM

import podtrain.models.architectures
import podtrain.models.hf_write
from podtrain.models import config_from_hf, config_to_hf, from_hf, to_hf
from podtrain.models.deepseek import DeepseekV3
from podtrain.models.hf_mapping import from_hf_block, hf_shape, to_hf_layout
from podtrain.models.hf_read import INDEX_FILE
from podtrain.sharding.mesh import build_mesh
from podtrain.sharding.rules import DEFAULT_RULES, use_rules

KIND_NAMES = list(KINDS)
MESH_SIZES = dict(dp=1, fsdp=2, tp=2, ep=2)
# Rows 0 and 3 are unpadded, rows 1 and 2 right-padded; batch 4 divides the mesh's batch axes (dp * fsdp * ep).
LENGTHS = (12, 9, 5, 12)
# Shards more axes than the defaults, including head_dim, which q_proj's rows flatten inside heads.
SHARD_EVERYTHING = {**DEFAULT_RULES, "head_dim": "ep", "norm": "fsdp", "vocab": ["tp", "ep"]}


def _mesh():
    """The (fsdp, tp, ep) mesh over the 8 devices tests/conftest.py gives every test."""
    return build_mesh(MESH_SIZES, jax.devices()[:8])


def _batch(vocab_size: int):
    rng = np.random.default_rng(0)
    input_ids = rng.integers(0, vocab_size, size=(len(LENGTHS), max(LENGTHS)), dtype=np.int64)
    attention_mask = (np.arange(max(LENGTHS))[None, :] < np.array(LENGTHS)[:, None]).astype(np.int64)
    return input_ids, attention_mask


# One jitted forward for the whole file: models of the same config and placement share its compilation.
_forward = jax.jit(lambda m, ids, mask: m(ids, attention_mask=mask)[0])


def _our_logits(model, input_ids, attention_mask, mesh):
    ids, mask = np.asarray(input_ids, np.int32), np.asarray(attention_mask, np.int32)
    if mesh is None:
        return np.asarray(_forward(model, ids, mask))
    with jax.set_mesh(mesh), use_rules(DEFAULT_RULES):
        return np.asarray(_forward(model, ids, mask))


def _tensors(directory) -> dict[str, np.ndarray]:
    out = {}
    for file in sorted(directory.glob("*.safetensors")):
        out |= load_file(file)
    return out


def _rewrite_weights(directory, change) -> None:
    """Applies `change(tensors)` to the single-file checkpoint in `directory`."""
    file = directory / "model.safetensors"
    tensors = load_file(file)
    change(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


# The second DeepSeek kind differs from the first in maths a single device checks (no query
# compression, rope layout, routing options), not in how it is sharded; it stays off the mesh.
PLACEMENTS = [(kind, "one_device") for kind in KIND_NAMES] + [
    (kind, "mesh_fsdp2_tp2_ep2") for kind in KIND_NAMES if kind != "deepseek_v3_plain"
]


@pytest.mark.parametrize(("kind", "placement"), PLACEMENTS)
def test_from_hf_logits_match_transformers(kind, placement, tmp_path):
    mesh = _mesh() if placement != "one_device" else None
    # The mesh case also reads a checkpoint split over several files with an index.
    hf_model = save_hf_model(kind, tmp_path, max_shard_size=None if mesh is None else "40KB")
    assert (tmp_path / INDEX_FILE).exists() == (mesh is not None)
    config, model = from_hf(tmp_path, mesh=mesh)
    input_ids, attention_mask = _batch(config.vocab_size)
    real = attention_mask.astype(bool)
    ours = _our_logits(model, input_ids, attention_mask, mesh)[real]
    np.testing.assert_allclose(ours, hf_logits(hf_model, input_ids, attention_mask)[real], rtol=0, atol=1e-4)


@pytest.mark.parametrize("kind", KIND_NAMES)
def test_from_hf_reads_each_shard_into_place(kind, tmp_path):
    mesh = _mesh()
    save_hf_model(kind, tmp_path, max_shard_size="40KB")
    _, reference = from_hf(tmp_path)
    _, model = from_hf(tmp_path, mesh=mesh, rules=SHARD_EVERYTHING)
    if isinstance(model, DeepseekV3):  # (layers, experts, moe_intermediate, embed), from per-expert tensors
        weight, spec = model.moe_layers.mlp.w_down[...], (None, "ep", "tp", "fsdp")
    else:
        weight, spec = model.layers.attn.wq[...], (None, "fsdp", "tp", "ep")
    assert tuple(weight.sharding.spec) == spec
    assert weight.addressable_shards[0].data.size == weight.size // 8
    expected = dict(nnx.to_flat_state(nnx.state(reference)))
    for path, var in nnx.to_flat_state(nnx.state(model)):
        assert var.get_value().sharding.mesh == mesh, path
        np.testing.assert_array_equal(np.asarray(var.get_value()), np.asarray(expected[path].get_value()), err_msg=path)


@pytest.mark.parametrize("kind", KIND_NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_hf_podtrain_hf_round_trip_is_byte_identical(kind, dtype, tmp_path):
    mesh = _mesh()
    source, exported = tmp_path / "source", tmp_path / "exported"
    save_hf_model(kind, source, dtype=dtype, max_shard_size="40KB")
    config, model = from_hf(source, mesh=mesh)
    assert config.param_dtype == str(dtype).removeprefix("torch.")
    to_hf(model, config, exported, max_shard_bytes=30_000)

    files = sorted(p.name for p in exported.glob("*.safetensors"))
    assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    index = json.loads((exported / INDEX_FILE).read_text())
    assert set(index["weight_map"].values()) == set(files)
    before, after = _tensors(source), _tensors(exported)
    assert sorted(after) == sorted(before) == sorted(index["weight_map"])
    for name, tensor in before.items():
        assert after[name].dtype == tensor.dtype and after[name].shape == tensor.shape, name
        assert after[name].tobytes() == tensor.tobytes(), name


def test_to_hf_writes_a_model_made_without_a_mesh(tmp_path):
    """A model built on one device (no mesh: its params are not NamedSharding-placed) exports too."""
    save_hf_model("llama", tmp_path / "source")
    config, model = from_hf(tmp_path / "source")
    plain = type(model)(config, rngs=nnx.Rngs(3))
    to_hf(plain, config, tmp_path / "plain")
    _, back = from_hf(tmp_path / "plain")
    for (path, want), (_, got) in zip(nnx.to_flat_state(nnx.state(plain, nnx.Param)),
                                      nnx.to_flat_state(nnx.state(back, nnx.Param)), strict=True):
        np.testing.assert_array_equal(np.asarray(got.get_value()), np.asarray(want.get_value()), err_msg=str(path))


@pytest.mark.parametrize("kind", KIND_NAMES)
def test_to_hf_export_loads_in_transformers(kind, tmp_path):
    source, exported = tmp_path / "source", tmp_path / "exported"
    hf_model = save_hf_model(kind, source)
    config, model = from_hf(source)
    to_hf(model, config, exported)

    assert sorted(p.name for p in exported.iterdir()) == ["config.json", "model.safetensors"]
    reloaded = AutoModelForCausalLM.from_pretrained(exported, attn_implementation="eager").eval()
    assert type(reloaded) is type(hf_model)
    input_ids, attention_mask = _batch(config.vocab_size)
    np.testing.assert_array_equal(
        hf_logits(reloaded, input_ids, attention_mask), hf_logits(hf_model, input_ids, attention_mask)
    )


@pytest.mark.parametrize("axes", [((1, 2), (0,)), ((2,), (0, 1)), ((0, 1),)], ids=["heads_in", "heads_out", "heads"])
def test_each_block_read_from_the_hf_layout_is_that_block_of_the_array(axes):
    shape = (4, 6, 8)[: sum(map(len, axes))]
    x = np.arange(math.prod(shape), dtype=np.float32).reshape(shape)
    hf = to_hf_layout(x, axes)
    assert hf.shape == hf_shape(shape, axes)
    for index in itertools.product(*[(slice(0, n), slice(n // 2, n), slice(1, n // 2)) for n in shape]):
        np.testing.assert_array_equal(from_hf_block(hf, shape, axes, index), x[index], err_msg=str(index))


@pytest.mark.parametrize("kind", KIND_NAMES)
def test_config_round_trips_through_hf(kind, tmp_path):
    save_hf_model(kind, tmp_path)
    config = config_from_hf(json.loads((tmp_path / "config.json").read_text()))
    assert config_from_hf(config_to_hf(config)) == config
    assert config.qk_norm == (kind == "qwen3")


def test_config_from_hf_reads_old_rope_keys_and_defaults():
    new = config_to_hf(config_from_hf(make_hf_model("llama").config.to_dict()))
    old = {k: v for k, v in new.items() if k not in ("rope_parameters", "head_dim", "dtype")}
    rope = dict(new["rope_parameters"])
    old |= {"rope_theta": rope.pop("rope_theta"), "rope_scaling": rope, "torch_dtype": "bfloat16"}
    config = config_from_hf(old)
    assert config.rope == config_from_hf(new).rope
    assert config.rope.rope_type == "llama3" and config.rope.factor == 8.0
    assert config.head_dim == new["hidden_size"] // new["num_attention_heads"]
    assert config.param_dtype == "bfloat16"
    assert config_from_hf(old, dtype="float32").param_dtype == "float32"
    # rope_parameters without rope_theta, which stands at the top level (transformers reads it there).
    split = {**new, "rope_parameters": {k: v for k, v in new["rope_parameters"].items() if k != "rope_theta"},
             "rope_theta": new["rope_parameters"]["rope_theta"]}
    assert config_from_hf(split).rope == config_from_hf(new).rope


def test_deepseek_keys_missing_from_config_json_take_transformers_defaults():
    from transformers import DeepseekV3Config

    from podtrain.models.deepseek import DEEPSEEK_KEYS

    minimal = {"model_type": "deepseek_v3", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96,
               "num_hidden_layers": 4, "num_attention_heads": 4, "max_position_embeddings": 128}
    ours, theirs = config_from_hf(minimal), DeepseekV3Config(**minimal)
    for key, (section, field) in DEEPSEEK_KEYS.items():
        want = getattr(theirs, key)
        assert getattr(getattr(ours, section), field) == (want or 0 if key == "q_lora_rank" else want), key
    assert config_from_hf({**minimal, "q_lora_rank": None}).mla.q_lora_rank == 0  # null: no query compression


def test_from_hf_dtype_argument_casts_params(tmp_path):
    save_hf_model("qwen3", tmp_path)
    _, reference = from_hf(tmp_path)
    config, model = from_hf(tmp_path, dtype="bfloat16")
    assert config.param_dtype == "bfloat16"
    scale = model.layers.attn.q_norm.scale[...]
    assert scale.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(scale), np.asarray(reference.layers.attn.q_norm.scale[...], jnp.bfloat16))


@pytest.mark.parametrize(
    ("kind", "changes", "message"),
    [
        ("llama", {"model_type": "mistral"},
         r"model_type: expected one of \['llama', 'qwen3', 'deepseek_v3'\], found 'mistral'"),
        ("qwen3", {"use_sliding_window": True}, "use_sliding_window: expected false"),
        ("llama", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}},
         r"rope_parameters: rope_type 'yarn' needs factor and original_max_position_embeddings, missing "
         r"\['original_max_position_embeddings'\]"),
        ("llama", {"rope_parameters": None, "rope_scaling": {"type": "dynamic", "factor": 2.0}},
         r"rope_scaling\.rope_type: .* found 'dynamic'"),
        ("llama", {"hidden_act": "gelu"}, "hidden_act: expected 'silu', found 'gelu'"),
        ("llama", {"dtype": "float64"}, r"dtype: expected one of .* found 'float64'"),
        ("deepseek_v3", {"scoring_func": "softmax"}, "scoring_func: expected 'sigmoid', found 'softmax'"),
        ("deepseek_v3", {"topk_method": "greedy"}, "topk_method: expected 'noaux_tc', found 'greedy'"),
    ],
)
def test_from_hf_rejects_unsupported_config(kind, changes, message, tmp_path):
    save_hf_model(kind, tmp_path)
    config_file = tmp_path / "config.json"
    config_file.write_text(json.dumps(json.loads(config_file.read_text()) | changes))
    with pytest.raises(ValueError, match=message) as error:
        from_hf(tmp_path)
    assert str(config_file) in str(error.value)


def test_from_hf_without_config_names_the_file(tmp_path):
    with pytest.raises(ValueError, match=r"config\.json: not found") as error:
        from_hf(tmp_path)
    assert str(tmp_path / "config.json") in str(error.value)


LFS_POINTER = "version https://git-lfs.github.com/spec/v1\noid sha256:0123abcd\nsize 1000000\n"


def _lfs_pointer(path):
    (path / "model.safetensors").write_text(LFS_POINTER)


def _cut_off(path):
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])


def _index_without_weight_map(path):
    (path / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": 1}}))


def _config_not_json(path):
    text = (path / "config.json").read_text()
    (path / "config.json").write_text(text[: len(text) // 2])


@pytest.mark.parametrize("damage, file, message", [
    (_lfs_pointer, "model.safetensors", r"not a safetensors file: a header of \d+ bytes in a file of 76 "
                                        r"\(a Git LFS pointer\? run `git lfs pull`\)"),
    (_cut_off, "model.safetensors", r"not a safetensors file: its tensors need \d+ bytes, the file has \d+ "
                                    r"\(a cut-off download\?\)"),
    (_index_without_weight_map, INDEX_FILE, "expected a 'weight_map' object of tensor name -> file, found none"),
    (_config_not_json, "config.json", r"not valid JSON \(Unterminated string|not valid JSON \(Expecting"),
])
def test_from_hf_damaged_files_are_one_error_naming_the_file(damage, file, message, tmp_path):
    save_hf_model("llama", tmp_path)
    damage(tmp_path)
    with pytest.raises(ValueError, match=message) as error:
        from_hf(tmp_path)
    assert str(error.value).startswith(f"{tmp_path / file}: "), error.value


def test_from_hf_lists_every_tensor_problem_in_one_error(tmp_path):
    save_hf_model("llama", tmp_path)

    def damage(tensors):
        del tensors["model.norm.weight"], tensors["model.layers.1.mlp.up_proj.weight"]
        tensors["model.layers.0.self_attn.extra.weight"] = np.zeros(3, np.float32)
        # Only DeepSeek-V3 checkpoints may have layers after the last (multi-token prediction).
        tensors["model.layers.2.input_layernorm.weight"] = np.ones(64, np.float32)
        tensors["lm_head.bias"] = np.zeros(3, np.float32)
        tensors["model.layers.1.self_attn.q_proj.weight"] = np.zeros((64, 64), np.float32)

    _rewrite_weights(tmp_path, damage)
    with pytest.raises(ValueError) as error:
        from_hf(tmp_path)
    message = str(error.value)
    assert str(tmp_path) in message
    assert "missing tensors: model.layers.1.mlp.up_proj.weight, model.norm.weight" in message
    assert ("unexpected tensors: lm_head.bias, model.layers.0.self_attn.extra.weight, "
            "model.layers.2.input_layernorm.weight") in message
    assert "model.layers.1.self_attn.q_proj.weight in model.safetensors: expected (128, 64), found (64, 64)" in message


def test_from_hf_skips_tensors_transformers_skips(tmp_path):
    save_hf_model("llama_tied_bias", tmp_path)

    def add_ignored(tensors):
        tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(8, np.float32)
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]

    _rewrite_weights(tmp_path, add_ignored)
    config, _ = from_hf(tmp_path)
    assert config.tie_word_embeddings


# The Linear weights the DeepSeek-V3 release stores as FP8 (attention, dense MLP, shared and routed
# experts); embeddings, norms, lm_head, the router and its correction bias stay float32.
FP8_WEIGHTS = re.compile(
    r"model\.layers\.\d+\.(self_attn|mlp|mlp\.shared_experts|mlp\.experts\.\d+)\.\w+_proj(_with_mqa)?\.weight"
)
FP8_BLOCK = 16  # several blocks per weight in the tiny model, and partial ones (q_a_proj is 24 x 64)
FP8_MAX = 448.0  # the largest float8_e4m3fn


def _expand_blocks(scale_inv: torch.Tensor, shape, block: int) -> torch.Tensor:
    return scale_inv.repeat_interleave(block, 0).repeat_interleave(block, 1)[: shape[0], : shape[1]]


def _quantise_fp8(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, float32 scale_inv per block), with scale_inv = max|block| / 448."""
    rows, cols = w.shape
    padded = torch.nn.functional.pad(w, (0, -cols % block, 0, -rows % block))
    blocks = padded.reshape(math.ceil(rows / block), block, math.ceil(cols / block), block)
    scale_inv = blocks.abs().amax(dim=(1, 3)) / FP8_MAX
    return (w / _expand_blocks(scale_inv, w.shape, block)).to(torch.float8_e4m3fn), scale_inv


def _save_fp8_release(directory, reference_directory) -> dict[str, tuple[int, int]]:
    """The tiny deepseek_v3 model laid out like the DeepSeek-V3 release in `directory`, and the same
    weights dequantised (fp8 * scale_inv, in float32) as a plain checkpoint in `reference_directory`.

    As in the release: FP8_WEIGHTS are float8_e4m3fn with float32 `<name>_scale_inv` block scales,
    config.json's quantization_config names the block size, and a multi-token-prediction layer
    (FP8 too) follows the last layer. Returns the FP8 weights' shapes.
    """
    hf_model = save_hf_model("deepseek_v3", reference_directory)
    tensors = load_torch_file(reference_directory / "model.safetensors")
    hidden, num_layers = hf_model.config.hidden_size, hf_model.config.num_hidden_layers
    last, mtp = f"model.layers.{num_layers - 1}.", f"model.layers.{num_layers}."
    extra = {mtp + name.removeprefix(last): t.clone() for name, t in tensors.items() if name.startswith(last)}
    extra |= {mtp + name: torch.randn(shape) for name, shape in [
        ("embed_tokens.weight", tensors["model.embed_tokens.weight"].shape), ("enorm.weight", (hidden,)),
        ("hnorm.weight", (hidden,)), ("eh_proj.weight", (hidden, 2 * hidden)),
        ("shared_head.norm.weight", (hidden,)), ("shared_head.head.weight", tensors["lm_head.weight"].shape),
    ]}
    release, dequantised, shapes = {}, {}, {}
    for name, w in {**tensors, **extra}.items():
        if FP8_WEIGHTS.fullmatch(name):
            release[name], release[name + "_scale_inv"] = _quantise_fp8(w, FP8_BLOCK)
            w = release[name].float() * _expand_blocks(release[name + "_scale_inv"], w.shape, FP8_BLOCK)
            shapes[name] = tuple(w.shape)
        else:
            release[name] = w
        if name in tensors:
            dequantised[name] = w
    directory.mkdir()
    save_torch_file(release, directory / "model.safetensors", metadata={"format": "pt"})
    save_torch_file(dequantised, reference_directory / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((reference_directory / "config.json").read_text())
    config |= {"num_nextn_predict_layers": 1, "quantization_config": {
        "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [FP8_BLOCK] * 2,
    }}
    (directory / "config.json").write_text(json.dumps(config))
    return shapes


def test_from_hf_dequantises_the_fp8_release_layout(tmp_path):
    mesh = _mesh()
    source, reference_dir = tmp_path / "fp8", tmp_path / "dequantised"
    shapes = _save_fp8_release(source, reference_dir)
    assert any(n % FP8_BLOCK for shape in shapes.values() for n in shape)
    assert {name.split(".")[3] for name in shapes} == {"self_attn", "mlp"}
    assert any(".experts." in name for name in shapes) and any(".shared_experts." in name for name in shapes)

    _, reference = from_hf(reference_dir)
    config, model = from_hf(source)
    _, sharded = from_hf(source, mesh=mesh)
    # Exact: both sides multiply the FP8 value (exact in float32) by its float32 scale, one
    # correctly rounded float32 product; the multi-token-prediction layer is left out.
    expected = dict(nnx.to_flat_state(nnx.state(reference)))
    for loaded in (model, sharded):
        for path, var in nnx.to_flat_state(nnx.state(loaded)):
            np.testing.assert_array_equal(
                np.asarray(var.get_value()), np.asarray(expected[path].get_value()), err_msg=str(path)
            )
    hf_model = AutoModelForCausalLM.from_pretrained(reference_dir, attn_implementation="eager").eval()
    input_ids, attention_mask = _batch(config.vocab_size)
    real = attention_mask.astype(bool)
    ours = _our_logits(model, input_ids, attention_mask, None)[real]
    np.testing.assert_allclose(ours, hf_logits(hf_model, input_ids, attention_mask)[real], rtol=0, atol=1e-4)


def test_from_hf_names_fp8_weights_without_their_block_scales(tmp_path):
    _save_fp8_release(tmp_path / "fp8", tmp_path / "dequantised")
    file = tmp_path / "fp8" / "model.safetensors"
    tensors = load_torch_file(file)
    del tensors["model.layers.1.mlp.experts.3.up_proj.weight_scale_inv"]
    tensors["model.layers.0.self_attn.q_a_proj.weight_scale_inv"] = torch.ones(1, 4)
    save_torch_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(ValueError) as error:
        from_hf(tmp_path / "fp8")
    message = str(error.value)
    assert str(tmp_path / "fp8") in message
    assert ("model.layers.1.mlp.experts.3.up_proj.weight: an FP8 tensor without its "
            "model.layers.1.mlp.experts.3.up_proj.weight_scale_inv block scales") in message
    assert ("model.layers.0.self_attn.q_a_proj.weight_scale_inv in model.safetensors: expected (2, 4) "
            "(16x16 blocks of a (24, 64) weight), found (1, 4)") in message


def test_to_hf_refuses_a_non_empty_directory(tmp_path):
    save_hf_model("llama", tmp_path / "source")
    config, model = from_hf(tmp_path / "source")
    with pytest.raises(ValueError, match="exists and is not empty") as error:
        to_hf(model, config, tmp_path / "source")
    assert str(tmp_path / "source") in str(error.value)


def test_to_hf_files_get_the_usual_permissions(tmp_path):
    """0666 (0777 for the directory) minus the umask, as other files get; not safetensors' 0600."""
    save_hf_model("llama", tmp_path / "source")
    config, model = from_hf(tmp_path / "source")
    umask = os.umask(0o027)
    try:
        to_hf(model, config, tmp_path / "exported", max_shard_bytes=30_000)
    finally:
        os.umask(umask)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "exported").iterdir()}
    assert len(modes) > 3 and set(modes.values()) == {0o640}, modes
    assert stat.S_IMODE((tmp_path / "exported").stat().st_mode) == 0o750


def test_to_hf_failure_leaves_no_directory(tmp_path, monkeypatch):
    save_hf_model("llama", tmp_path / "source")
    config, model = from_hf(tmp_path / "source")
    gathered, gather = [], podtrain.models.hf_write._host_slice

    def fail_in_the_second_file(x, at):
        if len(gathered) == 8:
            raise OSError("disk full")
        gathered.append(at)
        return gather(x, at)

    monkeypatch.setattr(podtrain.models.hf_write, "_host_slice", fail_in_the_second_file)
    with pytest.raises(OSError, match="disk full"):
        to_hf(model, config, tmp_path / "exported", max_shard_bytes=30_000)
    assert gathered
    assert sorted(p.name for p in tmp_path.iterdir()) == ["source"]


def test_the_streamed_safetensors_header_is_the_one_safetensors_writes(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {name: rng.normal(size=shape).astype(dtype) for name, shape, dtype in (
        ("b.weight", (3, 5), ml_dtypes.bfloat16), ("a.weight", (2,), np.float32), ("c", (4, 4), np.float32),
        ("a.bias", (7,), ml_dtypes.bfloat16), ("h", (3, 2), np.float16), ("z8", (3,), ml_dtypes.float8_e4m3fn),
        ("d", (2, 2), np.float64), ("ids", (5,), np.int32), ("scalar", (), np.float32))}
    save_file(tensors, tmp_path / "x.safetensors", metadata={"format": "pt"})
    start, offsets = podtrain.models.hf_write.safetensors_header(
        [(name, t.dtype, t.shape) for name, t in tensors.items()], {"format": "pt"})
    written = (tmp_path / "x.safetensors").read_bytes()
    assert written[: len(start)] == start
    for name, t in tensors.items():
        assert written[len(start) + offsets[name]:][: t.nbytes] == t.tobytes(), name


@pytest.mark.parametrize("kind", KIND_NAMES)
def test_the_streamed_export_is_byte_identical_to_the_whole_tensor_export(kind, tmp_path):
    """Against the export as it was: each parameter gathered whole, each file's tensors written at
    once by safetensors (on an fsdp x tp x ep mesh, several files)."""
    save_hf_model(kind, tmp_path / "source", max_shard_size="40KB")
    config, model = from_hf(tmp_path / "source", mesh=_mesh())
    to_hf(model, config, tmp_path / "exported", max_shard_bytes=30_000)
    index = json.loads((tmp_path / "exported" / INDEX_FILE).read_text())
    mapping = podtrain.models.architectures.ARCHITECTURES[config.model_type].hf_mapping
    expected = {}
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        whole = np.asarray(var.get_value())
        names, axes = mapping.names(".".join(map(str, path)), config, whole.shape)
        expected |= {names[at]: to_hf_layout(whole[at], axes) for at in np.ndindex(names.shape)}
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2
    for file in files:
        save_file({n: expected[n] for n, f in index["weight_map"].items() if f == file}, tmp_path / "whole",
                  metadata={"format": "pt"})
        assert (tmp_path / "exported" / file).read_bytes() == (tmp_path / "whole").read_bytes(), file
