"""Hugging Face checkpoints <-> podtrain: tensor names and layouts, safetensors I/O.

`from_hf` reads each device's slice of each tensor straight from the safetensors files into its
sharding, so a host never holds more than one parameter group; `to_hf` gathers one parameter at a
time (holding at most that and one output file's tensors) and writes shards that
`transformers.AutoModelForCausalLM.from_pretrained` loads. FP8 weights (`F8_E4M3` with block
scales `<name>_scale_inv`, as in the DeepSeek-V3 release) are dequantised on load.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import math
import os
import re
import shutil
import tempfile
from collections.abc import Mapping
from contextlib import ExitStack
from pathlib import Path
from typing import Any, NamedTuple

import jax
import ml_dtypes  # also registers bfloat16 with numpy, which safetensors' numpy reader needs
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from safetensors import safe_open
from safetensors.numpy import save_file

from podtrain.models.config import ModelConfig
from podtrain.models.deepseek import DeepseekV3
from podtrain.models.hf_config import config_from_hf, config_to_hf
from podtrain.models.llama import Llama
from podtrain.sharding.mesh import build_mesh
from podtrain.sharding.place import abstract_model
from podtrain.sharding.rules import Rules

INDEX_FILE = "model.safetensors.index.json"
FP8_SCALE_SUFFIX = "_scale_inv"
MODEL_CLASSES = {"llama": Llama, "qwen3": Llama, "deepseek_v3": DeepseekV3}

# Our parameter path -> (HF tensor name, axes). `axes` lists, per HF dimension, the axes of our
# (per-layer) array that it flattens: wq (embed, heads, head_dim) is q_proj (heads*head_dim, embed),
# i.e. ((1, 2), (0,)). Stacked parameters map to one HF tensor per layer, `model.layers.{i}.<name>`;
# expert parameters to one per layer and expert, `model.layers.{i}.mlp.experts.{e}.<name>`.
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
    # DeepSeek-V3: latent attention, router, shared experts
    "attn.wq_a": ("self_attn.q_a_proj.weight", ((1,), (0,))),
    "attn.wq_b": ("self_attn.q_b_proj.weight", ((1, 2), (0,))),
    "attn.wkv_a": ("self_attn.kv_a_proj_with_mqa.weight", ((1,), (0,))),
    "attn.kv_norm.scale": ("self_attn.kv_a_layernorm.weight", ((0,),)),
    "attn.wkv_b": ("self_attn.kv_b_proj.weight", ((1, 2), (0,))),
    "mlp.router": ("mlp.gate.weight", ((1,), (0,))),
    "mlp.router_bias": ("mlp.gate.e_score_correction_bias", ((0,),)),
    "mlp.shared.w_gate": ("mlp.shared_experts.gate_proj.weight", ((1,), (0,))),
    "mlp.shared.w_up": ("mlp.shared_experts.up_proj.weight", ((1,), (0,))),
    "mlp.shared.w_down": ("mlp.shared_experts.down_proj.weight", ((1,), (0,))),
}
# MLA's query-latent norm has the name of Qwen3's query norm in our tree.
MLA_Q_NORM = "self_attn.q_a_layernorm.weight"
EXPERT_TENSORS = {
    "mlp.w_gate": ("mlp.experts.{e}.gate_proj.weight", ((1,), (0,))),
    "mlp.w_up": ("mlp.experts.{e}.up_proj.weight", ((1,), (0,))),
    "mlp.w_down": ("mlp.experts.{e}.down_proj.weight", ((1,), (0,))),
}
# Our layer stacks: name -> first HF layer index, as a function of the config.
STACKS = {"layers": lambda c: 0, "dense_layers": lambda c: 0, "moe_layers": lambda c: c.num_dense_layers}
# Tensors transformers itself skips: old per-layer RoPE buffers.
IGNORED_TENSORS = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")
LAYER_INDEX = re.compile(r"model\.layers\.(\d+)\.")
def _layout(key: str, config: ModelConfig, shape) -> tuple[np.ndarray, tuple]:
    """The HF tensor names of our parameter `key` and its axes map.

    Names form an array over the stacked leading axes: () for a global tensor, (layers,) for a
    stacked one, (layers, experts) for expert weights.
    """
    stack, _, sub = key.partition(".")
    if stack not in STACKS:
        name, axes = GLOBAL_TENSORS[key]
        return np.array(name, dtype=object), axes
    first = STACKS[stack](config)
    layers = range(first, first + shape[0])
    if stack == "moe_layers" and sub in EXPERT_TENSORS:
        name, axes = EXPERT_TENSORS[sub]
        names = [[f"model.layers.{i}.{name.format(e=e)}" for e in range(shape[1])] for i in layers]
        return np.array(names, dtype=object), axes
    name, axes = LAYER_TENSORS[sub]
    if sub == "attn.q_norm.scale" and config.model_type == "deepseek_v3":
        name = MLA_Q_NORM
    return np.array([f"model.layers.{i}.{name}" for i in layers], dtype=object), axes


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


class _Stored(NamedTuple):
    """Where a tensor lies in a safetensors file: its shape, dtype and first data byte."""

    file: Path
    shape: tuple[int, ...]
    dtype: str
    offset: int


def _read_headers(directory: Path) -> dict[str, _Stored]:
    """Maps every tensor name in the checkpoint to where it is stored (headers only)."""
    index = directory / INDEX_FILE
    if index.exists():
        weight_map = read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index}: expected a 'weight_map' object of tensor name -> file, found "
                             f"{type(weight_map).__name__ if weight_map is not None else 'none'}")
        files = sorted({directory / f for f in weight_map.values()})
        absent = [str(f) for f in files if not f.exists()]
        if absent:
            raise ValueError(f"{index}: weight_map names files that do not exist: {absent}")
    else:
        files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{directory}: expected *.safetensors weights (or {INDEX_FILE}), found none")
    found = {}
    for file in files:
        header, size = _safetensors_header(file)
        for name, entry in header.items():
            if name != "__metadata__":
                found[name] = _Stored(file, tuple(entry["shape"]), entry["dtype"], 8 + size + entry["data_offsets"][0])
    return found


def read_json_object(file: Path) -> dict:
    """A JSON object file; ValueError naming the file when it is not one."""
    try:
        found = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{file}: not valid JSON ({e})") from None
    if not isinstance(found, dict):
        raise ValueError(f"{file}: expected a JSON object, found {type(found).__name__}")
    return found


def _safetensors_header(file: Path) -> tuple[dict, int]:
    """(JSON header, its length in bytes) of a safetensors file, checked against the file's size (a Git LFS pointer
    or a cut-off download is a ValueError naming the file, not a huge read)."""
    total = file.stat().st_size
    with open(file, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        raw = f.read(size) if 8 + size <= total else None
    try:
        if raw is None:
            raise ValueError(f"a header of {size} bytes in a file of {total}")
        header = json.loads(raw)
        ends = [entry["data_offsets"][1] for name, entry in header.items() if name != "__metadata__"]
        if 8 + size + max(ends, default=0) > total:
            raise ValueError(f"its tensors need {8 + size + max(ends)} bytes, the file has {total} "
                             "(a cut-off download?)")
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as e:  # JSONDecodeError is a ValueError
        pointer = " (a Git LFS pointer? run `git lfs pull`)" if total < 1024 else ""
        raise ValueError(f"{file}: not a safetensors file: {e}{pointer}") from None
    return header, size


class _Fp8Weights:
    """Dequantises `F8_E4M3` tensors with their `<name>_scale_inv` block scales to float32.

    Each scale multiplies one (block_rows x block_cols) block of the weight, as in the DeepSeek-V3
    release (`quantization_config.weight_block_size`). The safetensors readers cannot decode FP8,
    so the bytes are mapped straight from the file.
    """

    def __init__(self, found: dict, block: tuple[int, int]):
        self.found, self.block = found, block

    @functools.lru_cache(maxsize=4)  # noqa: B019  (one reader per load; a few tensors in flight)
    def __call__(self, name: str) -> np.ndarray:
        stored = self.found[name]
        shape = stored.shape
        raw = np.memmap(stored.file, dtype=ml_dtypes.float8_e4m3fn, mode="r", offset=stored.offset, shape=shape)
        with safe_open(self.found[name + FP8_SCALE_SUFFIX].file, framework="numpy") as f:
            scale = f.get_tensor(name + FP8_SCALE_SUFFIX).astype(np.float32)
        rows, cols = self.block
        full = np.repeat(np.repeat(scale, rows, axis=0), cols, axis=1)[: shape[0], : shape[1]]
        return raw.astype(np.float32) * full


def _fp8_block(hf_config: dict, source: str) -> tuple[int, int]:
    quant = hf_config.get("quantization_config") or {}
    block = quant.get("weight_block_size", [128, 128])
    if len(block) != 2 or min(block) <= 0:
        raise ValueError(f"{source}: quantization_config.weight_block_size: expected two positive sizes, found {block}")
    return int(block[0]), int(block[1])


def _fp8_scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """The `_scale_inv` shape of a 2-D FP8 weight: one scale per (possibly partial) block."""
    return tuple(math.ceil(n / b) for n, b in zip(shape, block, strict=True))


def _fp8_companions(found: dict) -> set[str]:
    """The `_scale_inv` tensors that belong to an FP8 weight (so they are not unexpected)."""
    return {
        name for name in found
        if name.endswith(FP8_SCALE_SUFFIX)
        and name.removesuffix(FP8_SCALE_SUFFIX) in found
        and found[name.removesuffix(FP8_SCALE_SUFFIX)].dtype == "F8_E4M3"
    }


def _fp8_problems(fp8: list[str], found: dict, block: tuple[int, int]) -> list[str]:
    """What stops the FP8 weights `fp8` from being dequantised: a missing or misshapen scale, a non-2-D weight."""
    problems = []
    for name in fp8:
        shape, scale = found[name].shape, name + FP8_SCALE_SUFFIX
        if len(shape) != 2:
            problems.append(f"{name}: an FP8 tensor must be a 2-D weight to have block scales, found shape {shape}")
        elif scale not in found:
            problems.append(f"{name}: an FP8 tensor without its {scale} block scales")
        elif found[scale].shape != _fp8_scale_shape(shape, block):
            problems.append(
                f"{scale} in {found[scale].file.name}: expected {_fp8_scale_shape(shape, block)} "
                f"({block[0]}x{block[1]} blocks of a {shape} weight), found {found[scale].shape}"
            )
    return problems


def _check_tensors(directory: Path, config: ModelConfig, expected: dict, found: dict, block: tuple[int, int]) -> None:
    missing = sorted(set(expected) - set(found))
    extra_layers = config.model_type == "deepseek_v3"  # multi-token-prediction layers after the last one

    def ignored(name):
        if IGNORED_TENSORS.fullmatch(name) or (config.tie_word_embeddings and name == "lm_head.weight"):
            return True
        layer = LAYER_INDEX.match(name)
        return extra_layers and layer is not None and int(layer.group(1)) >= config.num_layers

    unexpected = sorted(name for name in set(found) - set(expected) - _fp8_companions(found) if not ignored(name))
    wrong = [
        f"{name} in {found[name].file.name}: expected {expected[name]}, found {found[name].shape}"
        for name in sorted(set(expected) & set(found)) if found[name].shape != expected[name]
    ]
    fp8 = sorted(name for name in set(expected) & set(found) if found[name].dtype == "F8_E4M3")
    report = []
    if missing:
        report.append(f"missing tensors: {', '.join(missing)}")
    if unexpected:
        report.append(f"unexpected tensors: {', '.join(unexpected)}")
    if wrong:
        report.append("wrong shapes:\n    " + "\n    ".join(wrong))
    report += _fp8_problems(fp8, found, block)
    if report:
        raise ValueError(
            f"{directory}: the weights do not match config.json ({config.model_type}, {config.num_layers} layers, "
            f"tie_word_embeddings={config.tie_word_embeddings}); check that config.json belongs to these files:\n  "
            + "\n  ".join(report)
        )


def from_hf(path, *, mesh=None, dtype=None, rules: Rules | None = None,
            runtime: Mapping[str, Any] | None = None) -> tuple[ModelConfig, Llama]:
    """Loads a transformers Llama / Qwen3 / DeepSeek-V3 checkpoint, each tensor born in its sharding.

    FP8 weights (`F8_E4M3` plus `<name>_scale_inv` block scales) are dequantised to `dtype`.

    Args:
        path: a directory with config.json and `*.safetensors` (sharded ones need their index).
        mesh: the mesh to place the weights on; None places them on the first device.
        dtype: parameter dtype; defaults to the checkpoint's (float32 for an FP8 checkpoint
            without one).
        rules: logical-to-mesh rules; None uses the active table.
        runtime: model fields that change how the model runs, not its weights (`dtype` for the
            compute dtype, `remat`, `scan_layers`), over the ones config.json implies.

    Returns:
        (config, model).

    Raises:
        ValueError: naming the file and key for a missing config.json, an unsupported config, or
            weights that do not match it (every missing, unexpected and wrongly shaped tensor, and
            every FP8 weight without block scales of the right shape).
    """
    directory = Path(path)
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise ValueError(f"{config_file}: not found; expected a Hugging Face checkpoint directory with config.json")
    hf_config = read_json_object(config_file)
    config = dataclasses.replace(config_from_hf(hf_config, dtype=dtype, source=str(config_file)), **(runtime or {}))
    mesh = build_mesh({}, jax.devices()[:1]) if mesh is None else mesh
    model_class = MODEL_CLASSES[config.model_type]
    graphdef, abstract = abstract_model(lambda: model_class(config, rngs=nnx.Rngs(0)), mesh, rules)
    params = []
    for path_keys, var in nnx.to_flat_state(abstract):
        names, axes = _layout(".".join(map(str, path_keys)), config, var.shape)
        params.append((path_keys, var, names, axes))
    expected = {
        name: _hf_shape(var.shape[names.ndim:], axes) for _, var, names, axes in params for name in names.flat
    }
    found = _read_headers(directory)
    block = _fp8_block(hf_config, str(config_file))
    _check_tensors(directory, config, expected, found, block)
    fp8 = _Fp8Weights(found, block)

    loaded = []
    with ExitStack() as stack:
        files = {stored.file for stored in found.values()}
        handles = {file: stack.enter_context(safe_open(file, framework="numpy")) for file in files}

        def read(name, shape, axes, index):
            file, _, hf_dtype, _ = found[name]
            tensor = fp8(name) if hf_dtype == "F8_E4M3" else handles[file].get_slice(name)
            return _read_block(tensor, shape, axes, index)

        for path_keys, var, names, axes in params:
            spec = var.get_value()

            def load(index, names=names, axes=axes, spec=spec):
                stacked = names.ndim
                ranges = [range(n)[i] for n, i in zip(names.shape, index[:stacked], strict=True)]
                blocks = [read(names[at], spec.shape[stacked:], axes, index[stacked:])
                          for at in itertools.product(*ranges)]
                block = np.stack(blocks).reshape(*map(len, ranges), *blocks[0].shape)
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


def _umask() -> int:
    """The process's umask (reading it means setting it; it is put back at once)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def to_hf(model: Llama, config: ModelConfig, path, *, max_shard_bytes: int = 2**30,
          config_extra: Mapping[str, Any] | None = None, files: Mapping[str, bytes] | None = None) -> None:
    """Writes `model` as a transformers checkpoint: safetensors shards, their index and config.json.

    Every process must call this (the gathers are collective); process 0 writes. The files go to a
    temporary sibling directory renamed to `path` at the end, so a failed export leaves no
    directory that looks complete. `config_extra` adds keys to config.json (e.g. the tokenizer's
    `bos_token_id` / `eos_token_id`); `files` are written beside the weights (e.g. tokenizer.json).

    Raises:
        ValueError: when `path` exists and is not empty, or transformers cannot represent `config`.
    """
    directory = Path(path)
    if directory.exists() and any(directory.iterdir()):
        raise ValueError(f"{directory}: export directory exists and is not empty; choose a new path or remove it")
    hf_config = config_to_hf(config) | dict(config_extra or {})
    values = {".".join(map(str, k)): var.get_value() for k, var in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    tensors = []  # parameter-major, so that each parameter is gathered once
    for key, value in values.items():
        names, axes = _layout(key, config, value.shape)
        nbytes = value.nbytes // names.size
        tensors += [(names[at], nbytes, key, at, axes) for at in np.ndindex(names.shape)]
    shards = _plan_shards(tensors, max_shard_bytes)
    writer = jax.process_index() == 0
    if writer:
        directory.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
        umask = _umask()  # mkdtemp and safetensors create owner-only entries; give them the usual modes
        staging.chmod(0o777 & ~umask)
    try:
        weight_map, host_key, host = {}, None, None
        for number, shard in enumerate(shards, start=1):
            file = "model.safetensors" if len(shards) == 1 else f"model-{number:05d}-of-{len(shards):05d}.safetensors"
            out = {}
            for name, _, key, at, axes in shard:
                if key != host_key:
                    host_key, host = key, _to_host(values[key])
                out[name] = _to_hf_layout(host[at], axes)
                weight_map[name] = file
            if writer:
                save_file(out, staging / file, metadata={"format": "pt"})
                (staging / file).chmod(0o666 & ~umask)
        if writer:
            if len(shards) > 1:
                total = sum(entry[1] for entry in tensors)
                index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
                (staging / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
            (staging / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
            for name, data in (files or {}).items():
                (staging / name).write_bytes(data)
            for written in staging.iterdir():
                written.chmod(0o666 & ~umask)
            os.replace(staging, directory)
    except BaseException:
        if writer:
            shutil.rmtree(staging, ignore_errors=True)
        raise
