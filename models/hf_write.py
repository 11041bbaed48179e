"""Writing Hugging Face checkpoints: sharded safetensors, their index and config.json.

`to_hf` gathers one HF tensor at a time from every process and writes it in its place in its
file (each process writing its share of the files), shards that
`transformers.AutoModelForCausalLM.from_pretrained` loads.
"""

from __future__ import annotations

import functools
import json
import math
import os
import shutil
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

from podtrain.models.architectures import ARCHITECTURES
from podtrain.models.config import ModelConfig
from podtrain.models.hf_config import config_to_hf
from podtrain.models.hf_mapping import hf_shape, to_hf_layout
from podtrain.models.hf_read import DTYPES, INDEX_FILE
from podtrain.models.llama import Llama
from podtrain.sharding.rules import axes_of

# safetensors orders a file's tensors by dtype, in the reverse of this order, then by name.
_DTYPE_ORDER = ("BOOL", "F4", "F6_E2M3", "F6_E3M2", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0", "I16", "U16", "F16",
                "BF16", "I32", "U32", "F32", "C64", "F64", "I64", "U64")
_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def safetensors_header(tensors: list[tuple[str, np.dtype, tuple[int, ...]]], metadata: Mapping[str, str]):
    """The bytes a safetensors file starts with, for `tensors` (name, dtype, shape), and each
    tensor's offset from the end of them: what `safetensors.numpy.save_file` writes, so that a
    file can be written one tensor at a time."""
    header, offsets, end = {"__metadata__": dict(metadata)}, {}, 0
    for name, dtype, shape in sorted(tensors, key=lambda t: (-_DTYPE_ORDER.index(_DTYPE_NAMES[np.dtype(t[1])]), t[0])):
        size = math.prod(shape) * np.dtype(dtype).itemsize
        header[name] = {"dtype": _DTYPE_NAMES[np.dtype(dtype)], "shape": list(shape), "data_offsets": [end, end + size]}
        offsets[name], end = end, end + size
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, offsets


@functools.partial(jax.jit, static_argnums=(2, 3, 4))
def _take(x: jax.Array, at: jax.Array, stacked: int, spec: tuple, mesh) -> jax.Array:
    """`x[at]` for an index `at` into the `stacked` leading axes of `x`, sharded as `x`'s other
    axes are. Each device indexes its own block: where a stacked axis is sharded, the device
    holding the index contributes the slice and the others zeros, summed as integers (exact,
    signed zeros and NaNs kept), so no device ever gathers the whole of `x`."""
    over = tuple(a for entry in spec[:stacked] for a in axes_of(entry))

    def local(block, at):
        index, mine = [], True
        for axis in range(stacked):
            axes, size = axes_of(spec[axis]), block.shape[axis]
            index.append(at[axis] % size if axes else at[axis])
            if axes:
                mine &= jax.lax.axis_index(axes) == at[axis] // size
        piece = block[tuple(index)]
        if not over:
            return piece
        bits = jnp.dtype(f"uint{8 * piece.dtype.itemsize}")
        wide = bits if piece.dtype.itemsize >= 4 else jnp.uint32  # sums of 8- and 16-bit integers as 32-bit
        summed = jax.lax.psum(jnp.where(mine, jax.lax.bitcast_convert_type(piece, bits), 0).astype(wide), over)
        return jax.lax.bitcast_convert_type(summed.astype(bits), piece.dtype)

    return jax.shard_map(local, mesh=mesh, in_specs=(PartitionSpec(*spec), PartitionSpec()),
                         out_specs=PartitionSpec(*spec[stacked:]), check_vma=False)(x, at)


def _host_slice(x: jax.Array, at: tuple[int, ...]) -> np.ndarray:
    """`x[at]` (one HF tensor of a stacked parameter) whole on this host, and nothing more of `x`
    (a collective gather of just that slice when there are several processes)."""
    if at and not isinstance(x.sharding, NamedSharding):  # not on a mesh: one device holds all of x
        x = x[at]
    elif at:
        spec = tuple(x.sharding.spec) + (None,) * (x.ndim - len(x.sharding.spec))
        x = _take(x, np.asarray(at, np.int32), len(at), spec, x.sharding.mesh)
    if jax.process_count() > 1:
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def _broadcast_token() -> str:
    """A random name part that every process agrees on."""
    token = np.frombuffer(os.urandom(8), np.uint32)
    if jax.process_count() > 1:
        token = np.asarray(multihost_utils.broadcast_one_to_all(token))
    return "".join(f"{int(t):08x}" for t in token)


def _sync(name: str) -> None:
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


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


def to_hf(model: Llama, config: ModelConfig, path, *, max_shard_bytes: int = 2**30,
          config_extra: Mapping[str, Any] | None = None, files: Mapping[str, bytes] | None = None) -> None:
    """Writes `model` as a transformers checkpoint: safetensors shards, their index and config.json.

    Every process must call this (the gathers are collective). It streams: one HF tensor (a
    layer's, or one expert's, slice of a stacked parameter) at a time is gathered to the hosts
    and written at its place in its file, so a host holds a few HF tensors, never a whole
    parameter or file. Process `p` writes files `p, p + P, ...` of the `P` processes; process 0
    the index, config.json and `files` once all are written. The files go to a temporary sibling
    directory renamed to `path` at the end, so a failed export leaves no directory that looks
    complete. `config_extra` adds keys to config.json (e.g. the tokenizer's `bos_token_id` /
    `eos_token_id`); `files` are written beside the weights (e.g. tokenizer.json).

    Raises:
        ValueError: when `path` exists and is not empty, or transformers cannot represent `config`.
    """
    directory = Path(path)
    if directory.exists() and any(directory.iterdir()):
        raise ValueError(f"{directory}: export directory exists and is not empty; choose a new path or remove it")
    hf_config = config_to_hf(config) | dict(config_extra or {})
    mapping = ARCHITECTURES[config.model_type].hf_mapping
    values = {".".join(map(str, k)): var.get_value() for k, var in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    tensors = []  # parameter-major: (name, bytes, parameter, index in its stack, axes, HF shape, dtype)
    for key, value in values.items():
        names, axes = mapping.names(key, config, value.shape)
        shape = hf_shape(value.shape[names.ndim:], axes)
        tensors += [(names[at], value.nbytes // names.size, key, at, axes, shape, value.dtype)
                    for at in np.ndindex(names.shape)]
    shards = _plan_shards(tensors, max_shard_bytes)
    files_of = ["model.safetensors"] if len(shards) == 1 else [
        f"model-{n:05d}-of-{len(shards):05d}.safetensors" for n in range(1, len(shards) + 1)]
    me, count = jax.process_index(), jax.process_count()
    staging = directory.parent / f".{directory.name}.{_broadcast_token()}.tmp"
    if me == 0:  # the directory and files get the usual modes (0777 / 0666 less the umask)
        directory.parent.mkdir(parents=True, exist_ok=True)
        staging.mkdir()
    _sync("podtrain_export_staging")
    try:
        for number, (shard, file) in enumerate(zip(shards, files_of, strict=True)):
            mine = number % count == me
            if mine:
                start, offsets = safetensors_header([(t[0], t[6], t[5]) for t in shard], {"format": "pt"})
                out = open(staging / file, "wb")  # noqa: SIM115 (closed below, also on errors)
                out.write(start)
            try:
                for name, _, key, at, axes, _, _ in shard:
                    host = _host_slice(values[key], at)  # collective: every process takes part
                    if mine:
                        out.seek(len(start) + offsets[name])
                        to_hf_layout(host, axes).tofile(out)
            finally:
                if mine:
                    out.close()
        _sync("podtrain_export_files")
        if me == 0:
            if len(shards) > 1:
                total = sum(entry[1] for entry in tensors)
                weight_map = {t[0]: file for shard, file in zip(shards, files_of, strict=True) for t in shard}
                index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
                (staging / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
            (staging / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
            for name, data in (files or {}).items():
                (staging / name).write_bytes(data)
            os.replace(staging, directory)
        _sync("podtrain_export_done")
    except BaseException:
        if me == 0:
            shutil.rmtree(staging, ignore_errors=True)
        raise
