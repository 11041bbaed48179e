"""Writing Hugging Face checkpoints: sharded safetensors, their index and config.json.

`to_hf` gathers one parameter at a time from every process (holding at most that and one output
file's tensors) and writes shards that `transformers.AutoModelForCausalLM.from_pretrained` loads.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from safetensors.numpy import save_file

from podtrain.models.architectures import ARCHITECTURES
from podtrain.models.config import ModelConfig
from podtrain.models.hf_config import config_to_hf
from podtrain.models.hf_mapping import to_hf_layout
from podtrain.models.hf_read import INDEX_FILE
from podtrain.models.llama import Llama


def _to_host(x: jax.Array) -> np.ndarray:
    """The whole of `x` on this host (a collective gather when there are several processes)."""
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
    mapping = ARCHITECTURES[config.model_type].hf_mapping
    values = {".".join(map(str, k)): var.get_value() for k, var in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    tensors = []  # parameter-major, so that each parameter is gathered once
    for key, value in values.items():
        names, axes = mapping.names(key, config, value.shape)
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
                out[name] = to_hf_layout(host[at], axes)
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
