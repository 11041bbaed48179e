"""Hugging Face checkpoints <-> podtrain: config.json, tensor names and layouts, safetensors I/O.

`from_hf` reads each device's slice of each tensor straight from the safetensors files into its
sharding, so a host never holds more than one parameter group; `to_hf` gathers one parameter at a
time (holding at most that and one output file's tensors) and writes shards that
`transformers.AutoModelForCausalLM.from_pretrained` loads.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import tempfile
from contextlib import ExitStack
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy, which safetensors' numpy reader needs)
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from safetensors import safe_open
from safetensors.numpy import save_file

from models.config import DTYPES, ROPE_TYPES, ModelConfig, RopeConfig
from models.llama import Llama
from sharding.mesh import build_mesh
from sharding.place import abstract_model
from sharding.rules import Rules

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}
INDEX_FILE = "model.safetensors.index.json"
LAYER_PREFIX = "layers."

# Our parameter path -> (HF tensor name, axes). `axes` lists, per HF dimension, the axes of our
# (per-layer) array that it flattens: wq (embed, heads, head_dim) is q_proj (heads*head_dim, embed),
# i.e. ((1, 2), (0,)). Stacked parameters map to one HF tensor per layer, `model.layers.{i}.<name>`.
GLOBAL_TENSORS = {
    "embed": ("model.embed_tokens.weight", ((0,), (1,))),
    "final_norm.scale": ("model.norm.weight", ((0,),)),
    "lm_head": ("lm_head.weight", ((1,), (0,))),
}
LAYER_TENSORS = {
    "input_norm.scale": ("input_layernorm.weight", ((0,),)),
    "post_attn_norm.scale": ("post_attention_layernorm.weight", ((0,),)),
    "attn.wq": ("self_attn.q_proj.weight", ((1, 2), (0,))),
    "attn.wk": ("self_attn.k_proj.weight", ((1, 2), (0,))),
    "attn.wv": ("self_attn.v_proj.weight", ((1, 2), (0,))),
    "attn.wo": ("self_attn.o_proj.weight", ((2,), (0, 1))),
    "attn.bq": ("self_attn.q_proj.bias", ((0, 1),)),
    "attn.bk": ("self_attn.k_proj.bias", ((0, 1),)),
    "attn.bv": ("self_attn.v_proj.bias", ((0, 1),)),
    "attn.bo": ("self_attn.o_proj.bias", ((0,),)),
    "attn.q_norm.scale": ("self_attn.q_norm.weight", ((0,),)),
    "attn.k_norm.scale": ("self_attn.k_norm.weight", ((0,),)),
    "mlp.w_gate": ("mlp.gate_proj.weight", ((1,), (0,))),
    "mlp.w_up": ("mlp.up_proj.weight", ((1,), (0,))),
    "mlp.w_down": ("mlp.down_proj.weight", ((1,), (0,))),
    "mlp.b_gate": ("mlp.gate_proj.bias", ((0,),)),
    "mlp.b_up": ("mlp.up_proj.bias", ((0,),)),
    "mlp.b_down": ("mlp.down_proj.bias", ((0,),)),
}
# Tensors transformers itself skips: old per-layer RoPE buffers.
IGNORED_TENSORS = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")
# ModelConfig field -> config.json key, for the fields that carry over unchanged.
HF_KEYS = {
    "vocab_size": "vocab_size", "hidden_size": "hidden_size", "intermediate_size": "intermediate_size",
    "num_layers": "num_hidden_layers", "num_heads": "num_attention_heads", "num_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim", "rms_norm_eps": "rms_norm_eps", "max_position_embeddings": "max_position_embeddings",
    "tie_word_embeddings": "tie_word_embeddings", "attention_bias": "attention_bias", "mlp_bias": "mlp_bias",
    "initializer_range": "initializer_range",
}
LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _dtype_name(dtype, what: str) -> str:
    try:
        name = jnp.dtype(dtype).name
    except TypeError:
        name = str(dtype)
    if name not in DTYPES:
        raise ValueError(f"{what}: expected one of {list(DTYPES)}, found {name!r}")
    return name


def _rope_from_hf(hf: dict, source: str) -> RopeConfig:
    if hf.get("rope_parameters") is not None:
        key, params = "rope_parameters", dict(hf["rope_parameters"])
    else:
        key, params = "rope_scaling", dict(hf.get("rope_scaling") or {})
        params.setdefault("rope_theta", hf.get("rope_theta", RopeConfig.theta))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"{source}: {key}.rope_type: expected one of {list(ROPE_TYPES)}, found {rope_type!r}")
    extra = {}
    if rope_type == "llama3":
        missing = [k for k in LLAMA3_ROPE_KEYS if k not in params]
        if missing:
            raise ValueError(f"{source}: {key}: rope_type 'llama3' needs {list(LLAMA3_ROPE_KEYS)}, missing {missing}")
        extra = {k: params[k] for k in LLAMA3_ROPE_KEYS}
    return RopeConfig(rope_type=rope_type, theta=float(params["rope_theta"]), **extra)


def config_from_hf(hf_config: dict, *, dtype=None, source: str = "config.json") -> ModelConfig:
    """Maps a transformers `config.json` (Llama or Qwen3) onto a `ModelConfig`.

    Args:
        hf_config: the parsed config.json.
        dtype: parameter dtype; defaults to the file's `dtype` (or `torch_dtype`), else float32.
        source: how error messages name the file.

    Raises:
        ValueError: naming the key, what was expected and what was found, for a missing key, an
            unsupported model_type, rope type or activation, or sliding-window attention.
    """
    hf = hf_config
    model_type = hf.get("model_type")
    if model_type not in ARCHITECTURES:
        raise ValueError(f"{source}: model_type: expected one of {list(ARCHITECTURES)}, found {model_type!r}")
    missing = [HF_KEYS[f] for f in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads")
               if HF_KEYS[f] not in hf]
    if missing:
        raise ValueError(f"{source}: missing keys {missing} that a {model_type} config needs")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{source}: hidden_act: expected 'silu', found {hf['hidden_act']!r}")
    if hf.get("use_sliding_window"):
        raise ValueError(f"{source}: use_sliding_window: expected false (sliding-window attention is not supported)")
    other_layers = sorted(set(hf.get("layer_types") or ()) - {"full_attention"})
    if other_layers:
        raise ValueError(f"{source}: layer_types: expected only 'full_attention', found {other_layers}")
    if dtype is None:
        dtype, what = hf.get("dtype") or hf.get("torch_dtype") or "float32", f"{source}: dtype"
    else:
        what = "dtype argument"
    fields = {field: hf[key] for field, key in HF_KEYS.items() if hf.get(key) is not None}
    fields.setdefault("num_kv_heads", fields["num_heads"])
    fields.setdefault("head_dim", fields["hidden_size"] // fields["num_heads"])
    fields.setdefault("rms_norm_eps", 1e-6)  # transformers' default for both families
    config = ModelConfig(
        model_type=model_type, rope=_rope_from_hf(hf, source), qk_norm=model_type == "qwen3",
        param_dtype=_dtype_name(dtype, what), **fields,
    )
    config.validate()
    return config


def config_to_hf(config: ModelConfig) -> dict:
    """The transformers-5 `config.json` for `config` (LlamaForCausalLM or Qwen3ForCausalLM).

    Raises:
        ValueError: when transformers has no architecture for the combination (Llama with qk_norm,
            Qwen3 without qk_norm or with mlp_bias).
    """
    c = config
    if c.qk_norm != (c.model_type == "qwen3") or (c.model_type == "qwen3" and c.mlp_bias):
        raise ValueError(
            f"model: transformers' {ARCHITECTURES[c.model_type]} has qk_norm={c.model_type == 'qwen3'} and no "
            f"mlp_bias for qwen3; found qk_norm={c.qk_norm}, mlp_bias={c.mlp_bias}"
        )
    rope = {"rope_type": c.rope.rope_type, "rope_theta": c.rope.theta}
    if c.rope.rope_type == "llama3":
        rope |= {k: getattr(c.rope, k) for k in LLAMA3_ROPE_KEYS}
    return {
        "architectures": [ARCHITECTURES[c.model_type]], "model_type": c.model_type, "hidden_act": "silu",
        "rope_parameters": rope, "dtype": c.param_dtype, **{key: getattr(c, field) for field, key in HF_KEYS.items()},
    }


def _layout(key: str, num_layers: int) -> tuple[list[str], tuple]:
    """The HF tensor names (one per layer when stacked) and the axes map of our parameter `key`."""
    if key.startswith(LAYER_PREFIX):
        name, axes = LAYER_TENSORS[key.removeprefix(LAYER_PREFIX)]
        return [f"model.layers.{i}.{name}" for i in range(num_layers)], axes
    name, axes = GLOBAL_TENSORS[key]
    return [name], axes


def _hf_shape(shape, axes) -> tuple[int, ...]:
    return tuple(math.prod(shape[a] for a in group) for group in axes)


def _to_hf_layout(x: np.ndarray, axes) -> np.ndarray:
    order = [a for group in axes for a in group]
    return np.ascontiguousarray(x.transpose(order).reshape(_hf_shape(x.shape, axes)))


def _read_block(tensor, shape, axes, index) -> np.ndarray:
    """Our-layout block `index` of an HF tensor, reading only the rows of each HF dimension it needs.

    Each HF dimension is read over the range its outermost axis needs (a contiguous run); the inner
    axes it flattens are sliced after the reshape.
    """
    hf_index, block_shape = [], []
    for group in axes:
        rows = range(shape[group[0]])[index[group[0]]]
        inner = [shape[a] for a in group[1:]]
        hf_index.append(slice(rows.start * math.prod(inner), rows.stop * math.prod(inner)))
        block_shape += [len(rows), *inner]
    order = [a for group in axes for a in group]
    block = tensor[tuple(hf_index)].reshape(block_shape).transpose(np.argsort(order))
    outer = {group[0] for group in axes}
    return block[tuple(slice(None) if a in outer else index[a] for a in range(len(shape)))]


def _read_headers(directory: Path) -> dict[str, tuple[Path, tuple[int, ...]]]:
    """Maps every tensor name in the checkpoint to its file and shape (headers only)."""
    index = directory / INDEX_FILE
    if index.exists():
        files = sorted({directory / f for f in json.loads(index.read_text())["weight_map"].values()})
        absent = [str(f) for f in files if not f.exists()]
        if absent:
            raise ValueError(f"{index}: weight_map names files that do not exist: {absent}")
    else:
        files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{directory}: expected *.safetensors weights (or {INDEX_FILE}), found none")
    found = {}
    for file in files:
        with safe_open(file, framework="numpy") as f:
            for name in f.keys():  # noqa: SIM118  (safe_open is not iterable)
                found[name] = (file, tuple(f.get_slice(name).get_shape()))
    return found


def _check_tensors(directory: Path, config: ModelConfig, expected: dict, found: dict) -> None:
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(
        name for name in set(found) - set(expected)
        if not IGNORED_TENSORS.fullmatch(name) and not (config.tie_word_embeddings and name == "lm_head.weight")
    )
    wrong = [
        f"{name} in {found[name][0].name}: expected {expected[name]}, found {found[name][1]}"
        for name in sorted(set(expected) & set(found)) if found[name][1] != expected[name]
    ]
    report = []
    if missing:
        report.append(f"missing tensors: {', '.join(missing)}")
    if unexpected:
        report.append(f"unexpected tensors: {', '.join(unexpected)}")
    if wrong:
        report.append("wrong shapes:\n    " + "\n    ".join(wrong))
    if report:
        raise ValueError(
            f"{directory}: the weights do not match config.json ({config.model_type}, {config.num_layers} layers, "
            f"tie_word_embeddings={config.tie_word_embeddings}); check that config.json belongs to these files:\n  "
            + "\n  ".join(report)
        )


def from_hf(path, *, mesh=None, dtype=None, rules: Rules | None = None) -> tuple[ModelConfig, Llama]:
    """Loads a transformers Llama / Qwen3 checkpoint directory, each tensor born in its sharding.

    Args:
        path: a directory with config.json and `*.safetensors` (sharded ones need their index).
        mesh: the mesh to place the weights on; None places them on the first device.
        dtype: parameter dtype; defaults to the checkpoint's.
        rules: logical-to-mesh rules; None uses the active table.

    Returns:
        (config, model).

    Raises:
        ValueError: naming the file and key for a missing config.json, an unsupported config, or
            weights that do not match it (every missing, unexpected and wrongly shaped tensor).
    """
    directory = Path(path)
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise ValueError(f"{config_file}: not found; expected a Hugging Face checkpoint directory with config.json")
    config = config_from_hf(json.loads(config_file.read_text()), dtype=dtype, source=str(config_file))
    mesh = build_mesh({}, jax.devices()[:1]) if mesh is None else mesh
    graphdef, abstract = abstract_model(lambda: Llama(config, rngs=nnx.Rngs(0)), mesh, rules)
    params = []
    for path_keys, var in nnx.to_flat_state(abstract):
        key = ".".join(map(str, path_keys))
        names, axes = _layout(key, config.num_layers)
        params.append((path_keys, var, names, axes, key.startswith(LAYER_PREFIX)))
    expected = {
        name: _hf_shape(var.shape[1:] if stacked else var.shape, axes)
        for _, var, names, axes, stacked in params for name in names
    }
    found = _read_headers(directory)
    _check_tensors(directory, config, expected, found)

    loaded = []
    with ExitStack() as stack:
        files = {file for file, _ in found.values()}
        handles = {file: stack.enter_context(safe_open(file, framework="numpy")) for file in files}

        def read(name, shape, axes, index):
            return _read_block(handles[found[name][0]].get_slice(name), shape, axes, index)

        for path_keys, var, names, axes, stacked in params:
            spec = var.get_value()

            def load(index, names=names, axes=axes, stacked=stacked, spec=spec):
                if stacked:
                    layers = range(spec.shape[0])[index[0]]
                    block = np.stack([read(names[i], spec.shape[1:], axes, index[1:]) for i in layers])
                else:
                    block = read(names[0], spec.shape, axes, index)
                return block.astype(spec.dtype, copy=False)

            array = jax.make_array_from_callback(spec.shape, spec.sharding, load, dtype=spec.dtype)
            loaded.append((path_keys, var.replace(array)))
    return config, nnx.merge(graphdef, nnx.from_flat_state(loaded))


def _to_host(x: jax.Array) -> np.ndarray:
    if jax.process_count() > 1:
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def _plan_shards(tensors: list[tuple], max_shard_bytes: int) -> list[list[tuple]]:
    """Splits (name, nbytes, ...) entries, in order, into files of at most `max_shard_bytes` each.

    A tensor larger than `max_shard_bytes` gets a file of its own.
    """
    shards, size = [[]], 0
    for entry in tensors:
        if shards[-1] and size + entry[1] > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += entry[1]
    return shards


def to_hf(model: Llama, config: ModelConfig, path, *, max_shard_bytes: int = 2**30) -> None:
    """Writes `model` as a transformers checkpoint: safetensors shards, their index and config.json.

    Every process must call this (the gathers are collective); process 0 writes. The files go to a
    temporary sibling directory renamed to `path` at the end, so a failed export leaves no
    directory that looks complete.

    Raises:
        ValueError: when `path` exists and is not empty, or transformers cannot represent `config`.
    """
    directory = Path(path)
    if directory.exists() and any(directory.iterdir()):
        raise ValueError(f"{directory}: export directory exists and is not empty; choose a new path or remove it")
    hf_config = config_to_hf(config)
    values = {".".join(map(str, k)): var.get_value() for k, var in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    tensors = []  # parameter-major, so that each parameter is gathered once
    for key, value in values.items():
        names, axes = _layout(key, config.num_layers)
        stacked = key.startswith(LAYER_PREFIX)
        nbytes = value.nbytes // len(names)
        tensors += [(name, nbytes, key, i if stacked else None, axes) for i, name in enumerate(names)]
    shards = _plan_shards(tensors, max_shard_bytes)
    writer = jax.process_index() == 0
    if writer:
        directory.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
        staging.chmod(0o755)
    try:
        weight_map, host_key, host = {}, None, None
        for number, shard in enumerate(shards, start=1):
            file = "model.safetensors" if len(shards) == 1 else f"model-{number:05d}-of-{len(shards):05d}.safetensors"
            out = {}
            for name, _, key, layer, axes in shard:
                if key != host_key:
                    host_key, host = key, _to_host(values[key])
                out[name] = _to_hf_layout(host if layer is None else host[layer], axes)
                weight_map[name] = file
            if writer:
                save_file(out, staging / file, metadata={"format": "pt"})
        if writer:
            if len(shards) > 1:
                total = sum(entry[1] for entry in tensors)
                index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
                (staging / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
            (staging / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
            os.replace(staging, directory)
    except BaseException:
        if writer:
            shutil.rmtree(staging, ignore_errors=True)
        raise
