"""Reading Hugging Face checkpoints: safetensors headers, each device's slice, FP8 dequantisation.

`from_hf` reads each device's slice of each tensor straight from the safetensors files into its
sharding, so a host never holds more than one parameter group. FP8 weights (`F8_E4M3` with block
scales `<name>_scale_inv`, as in the DeepSeek-V3 release) are dequantised on load.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import math
import os
from collections.abc import Mapping
from contextlib import ExitStack
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from podtrain.models.architectures import ARCHITECTURES
from podtrain.models.config import ModelConfig
from podtrain.models.hf_config import config_from_hf
from podtrain.models.hf_mapping import HFMapping, from_hf_block, hf_shape
from podtrain.models.llama import Llama
from podtrain.sharding.mesh import build_mesh
from podtrain.sharding.place import abstract_model
from podtrain.sharding.rules import Rules

INDEX_FILE = "model.safetensors.index.json"
FP8_SCALE_SUFFIX = "_scale_inv"


def is_hf_directory(path: str | os.PathLike) -> bool:
    """Whether `path` is a Hugging Face model directory (it holds config.json)."""
    return (Path(path).expanduser() / "config.json").is_file()


def read_json_object(file: Path) -> dict:
    """A JSON object file; ValueError naming the file when it is not one."""
    try:
        found = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{file}: not valid JSON ({e})") from None
    if not isinstance(found, dict):
        raise ValueError(f"{file}: expected a JSON object, found {type(found).__name__}")
    return found


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


# safetensors dtype names -> numpy dtypes (the ones numpy and ml_dtypes have).
DTYPES = {name: np.dtype(t) for name, t in (
    ("BOOL", np.bool_), ("U8", np.uint8), ("I8", np.int8), ("F8_E5M2", ml_dtypes.float8_e5m2),
    ("F8_E4M3", ml_dtypes.float8_e4m3fn), ("I16", np.int16), ("U16", np.uint16), ("F16", np.float16),
    ("BF16", ml_dtypes.bfloat16), ("I32", np.int32), ("U32", np.uint32), ("F32", np.float32), ("F64", np.float64),
    ("I64", np.int64), ("U64", np.uint64))}


def _ranges(shape: tuple[int, ...], index, file: Path) -> list[range]:
    """The contiguous range of each dimension that numpy index `index` selects (ValueError else)."""
    index = index if isinstance(index, tuple) else (index,)
    index += (slice(None),) * (len(shape) - len(index))
    ranges = [range(n)[i] for n, i in zip(shape, index, strict=True)]
    if any(r.step != 1 for r in ranges):
        raise ValueError(f"{file}: tensors are read in contiguous slices, found {index}")
    return ranges


class _FileTensor:
    """A stored tensor that numpy-slices: `tensor[i, j]` (contiguous ranges) reads only the bytes
    of the rows it needs with `os.pread`, so nothing of the file stays mapped or cached by this
    process (a memory map's touched pages would count as the process's resident memory)."""

    def __init__(self, stored: _Stored, files: dict):
        self.stored, self.files = stored, files  # files: path -> an open file, for its descriptor
        self.shape, self.dtype = stored.shape, DTYPES[stored.dtype]

    def __getitem__(self, index) -> np.ndarray:
        ranges = _ranges(self.shape, index, self.stored.file)
        if not self.shape:
            return self._read(0, 1).reshape(())
        row = math.prod(self.shape[1:])
        rows = self._read(ranges[0].start * row, len(ranges[0]) * row).reshape(len(ranges[0]), *self.shape[1:])
        return rows[(slice(None), *(slice(r.start, r.stop) for r in ranges[1:]))]

    def _read(self, first: int, count: int) -> np.ndarray:
        out = np.empty(count, self.dtype)
        view, done = memoryview(out.view(np.uint8)), 0
        fd = self.files[self.stored.file].fileno()
        while done < out.nbytes:
            n = os.preadv(fd, [view[done:]], self.stored.offset + first * self.dtype.itemsize + done)
            if n <= 0:
                raise ValueError(f"{self.stored.file}: ends inside tensor data (a cut-off file?)")
            done += n
        return out


class _Fp8Weights:
    """`F8_E4M3` tensors with their `<name>_scale_inv` block scales, dequantised to float32 a slice
    at a time.

    Each scale multiplies one (block_rows x block_cols) block of the weight, as in the DeepSeek-V3
    release (`quantization_config.weight_block_size`).
    """

    def __init__(self, found: dict, block: tuple[int, int], files: dict):
        self.found, self.block, self.files = found, block, files  # files: the open files

    def __call__(self, name: str) -> _Fp8Tensor:
        scale = _FileTensor(self.found[name + FP8_SCALE_SUFFIX], self.files)
        return _Fp8Tensor(_FileTensor(self.found[name], self.files), scale, self.block)


class _Fp8Tensor:
    """One FP8 weight that numpy-slices: `tensor[rows, cols]` reads only those bytes and the scales
    of the blocks they touch, and returns their float32 values (the same products as dequantising
    the whole tensor and slicing it)."""

    def __init__(self, raw: _FileTensor, scale: _FileTensor, block: tuple[int, int]):
        self.raw, self.scale, self.block = raw, scale, block
        self.shape = raw.shape

    def __getitem__(self, index) -> np.ndarray:
        ranges = _ranges(self.shape, index, self.raw.stored.file)
        raw = self.raw[ranges[0].start:ranges[0].stop, ranges[1].start:ranges[1].stop]
        blocks = [slice(r.start // b, -(-r.stop // b)) for r, b in zip(ranges, self.block, strict=True)]
        scale = self.scale[blocks[0], blocks[1]].astype(np.float32)
        for axis, (r, b) in enumerate(zip(ranges, self.block, strict=True)):
            first = r.start - (r.start // b) * b  # where the slice starts in its first block
            scale = np.repeat(scale, b, axis=axis)[(slice(None),) * axis + (slice(first, first + len(r)),)]
        return raw.astype(np.float32) * scale


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


def _check_tensors(directory: Path, config: ModelConfig, mapping: HFMapping, expected: dict, found: dict,
                   block: tuple[int, int]) -> None:
    """One ValueError listing every missing, unexpected and misshapen tensor and every unusable FP8 weight."""
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(name for name in set(found) - set(expected) - _fp8_companions(found)
                        if not mapping.skips(name, config))
    wrong = [
        f"{name} in {found[name].file.name}: expected {expected[name]}, found {found[name].shape}"
        for name in sorted(set(expected) & set(found)) if found[name].shape != expected[name]
    ]
    fp8 = sorted(name for name in set(expected) & set(found) if found[name].dtype == "F8_E4M3")
    unreadable = [f"{name} in {found[name].file.name}: {found[name].dtype}"
                  for name in sorted(set(expected) & set(found)) if found[name].dtype not in DTYPES]
    report = []
    if unreadable:
        report.append(f"dtypes this reader does not know (expected one of {', '.join(DTYPES)}): "
                      + ", ".join(unreadable))
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


@functools.partial(jax.jit, donate_argnums=0)
def _put_layer(stack: jax.Array, layer: jax.Array, i: jax.Array) -> jax.Array:
    return jax.lax.dynamic_update_index_in_dim(stack, layer, i, 0)


def _assemble(spec: jax.ShapeDtypeStruct, load, *, stacked: bool) -> jax.Array:
    """The array `spec` describes, each device's block from `load(index)`. A stacked parameter whose
    layer axis is not sharded is filled one layer at a time (its buffer updated in place), so the
    host holds one layer's blocks at a time, not every block of the whole stack."""
    sharding = spec.sharding
    if not stacked or not isinstance(sharding, NamedSharding) or (sharding.spec and sharding.spec[0] is not None):
        return jax.make_array_from_callback(spec.shape, sharding, load, dtype=spec.dtype)
    layer_sharding = NamedSharding(sharding.mesh, PartitionSpec(*sharding.spec[1:]))
    stack = jax.jit(functools.partial(jnp.zeros, spec.shape, spec.dtype), out_shardings=sharding)()
    for i in range(spec.shape[0]):
        layer = jax.make_array_from_callback(spec.shape[1:], layer_sharding,
                                             lambda index, i=i: load((slice(i, i + 1), *index))[0], dtype=spec.dtype)
        stack = _put_layer(stack, layer, np.int32(i))
        del layer  # before the next layer's blocks are read
    return stack


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
            compute dtype, `remat`, `scan_layers`, the kernels: `attention`, `interpret_kernels`,
            `moe.grouped_matmul`, `moe.exchange`), over the ones config.json implies.

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
    config = config_from_hf(hf_config, dtype=dtype, source=str(config_file))
    runtime = dict(runtime or {})
    moe = {key.removeprefix("moe."): runtime.pop(key) for key in list(runtime) if key.startswith("moe.")}
    config = dataclasses.replace(config, moe=dataclasses.replace(config.moe, **moe), **runtime)
    mesh = build_mesh({}, jax.devices()[:1]) if mesh is None else mesh
    architecture = ARCHITECTURES[config.model_type]
    graphdef, abstract = abstract_model(lambda: architecture.model_class(config, rngs=nnx.Rngs(0)), mesh, rules)
    params = []
    for path_keys, var in nnx.to_flat_state(abstract):
        names, axes = architecture.hf_mapping.names(".".join(map(str, path_keys)), config, var.shape)
        params.append((path_keys, var, names, axes))
    expected = {
        name: hf_shape(var.shape[names.ndim:], axes) for _, var, names, axes in params for name in names.flat
    }
    found = _read_headers(directory)
    block = _fp8_block(hf_config, str(config_file))
    _check_tensors(directory, config, architecture.hf_mapping, expected, found, block)

    loaded = []
    with ExitStack() as stack:
        files = {file: stack.enter_context(open(file, "rb")) for file in {stored.file for stored in found.values()}}
        fp8 = _Fp8Weights(found, block, files)

        def read(name, shape, axes, index):
            tensor = fp8(name) if found[name].dtype == "F8_E4M3" else _FileTensor(found[name], files)
            return from_hf_block(tensor, shape, axes, index)

        for path_keys, var, names, axes in params:
            spec = var.get_value()

            def load(index, names=names, axes=axes, spec=spec):
                stacked = names.ndim
                ranges = [range(n)[i] for n, i in zip(names.shape, index[:stacked], strict=True)]
                blocks = [read(names[at], spec.shape[stacked:], axes, index[stacked:])
                          for at in itertools.product(*ranges)]
                block = np.stack(blocks).reshape(*map(len, ranges), *blocks[0].shape)
                return block.astype(spec.dtype, copy=False)

            loaded.append((path_keys, var.replace(_assemble(spec, load, stacked=names.ndim > 0))))
    return config, nnx.merge(graphdef, nnx.from_flat_state(loaded))
