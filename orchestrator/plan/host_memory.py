"""Each host's RAM at its peak, against the host's RAM: what a checkpoint save and restore stage
(Orbax), an HF import and export, and the data pipeline hold beside the step.

From the state's shardings on the target's devices, per host (the host with the most):
- a save stages in host memory what this host writes: each array's shards it is the writer of
  (Orbax's replica-parallel saving splits a replicated shard among its replicas on TPUs; on GPUs
  and CPUs its first replica writes it), at most `checkpoint.host_gb` at once when set, but
  never less than the largest array;
- a restore reads every shard of its devices into host buffers, at most `checkpoint.host_gb`
  (else Orbax's default bound) at once, but never less than the largest array;
- an HF import holds one parameter's (one layer's) shards of its devices, read and converted;
- an HF export holds one whole HF tensor, gathered and laid out as HF stores it;
- the data pipeline holds `data.prefetch` batches ahead, the one being made and the one in use.
On CPU devices the device memory is the host's: the state, the step's buffers and the programs
around a save (the state's fingerprints) count too.
"""

from __future__ import annotations

import functools
import math
from collections import Counter, defaultdict

import jax
import numpy as np
from flax import nnx

from podtrain.orchestrator.checkpoint.checkpointer import ORBAX_RESTORE_GB

BATCH_BYTES_PER_TOKEN = 5 * 4  # inputs, targets, positions, segment ids (int32) and loss weights (float32)


def machine_ram_bytes() -> int:
    """This machine's RAM (MemTotal)."""
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))


def _itemsize(leaf) -> int:
    dtype = leaf.dtype
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return 8  # a threefry key's two uint32 words
    return np.dtype(dtype).itemsize


@functools.cache
def _layout(shape: tuple[int, ...], itemsize: int, sharding) -> tuple[dict, dict, dict, int]:
    """Per process, the bytes of an array of this layout that a restore reads (every shard of its
    devices), that a save writes with Orbax's replica-parallel split and without it (a shard's
    first replica writes it); and the most bytes the array has on one process. Arrays of one
    layout (a parameter and its moments) share the answer: one pass over a pod's devices."""
    size = math.prod(sharding.shard_shape(shape)) * itemsize
    order = list(getattr(sharding, "_device_assignment", None) or sharding.device_set)
    indices = sharding.devices_indices_map(shape)
    replicas: dict[tuple, list] = defaultdict(list)
    for device in order:
        replicas[tuple((s.start, s.stop) for s in indices[device])].append(device)
    read, parallel, first = defaultdict(float), defaultdict(float), defaultdict(float)
    for holders in replicas.values():
        first[holders[0].process_index] += size
        for device in holders:
            read[device.process_index] += size
            parallel[device.process_index] += size / len(holders)
    return dict(read), dict(parallel), dict(first), int(max(read.values()))


def _layout_of(leaf) -> tuple[dict, dict, dict, int]:
    return _layout(tuple(leaf.shape), _itemsize(leaf), leaf.sharding)


def state_bytes_per_host(leaves, *, written: bool, replica_parallel: bool) -> dict[int, int]:
    """Bytes per process of `leaves`' shards on its devices (`written=False`: what a restore reads),
    or of the shards it writes in a save."""
    per_host: dict[int, float] = defaultdict(float)
    for leaf in leaves:
        read, parallel, first, _ = _layout_of(leaf)
        for host, size in (parallel if replica_parallel else first).items() if written else read.items():
            per_host[host] += size
    return {host: int(b) for host, b in per_host.items()}


@functools.cache
def _distinct(shape: tuple[int, ...], itemsize: int, sharding) -> dict[int, int]:
    size = math.prod(sharding.shard_shape(shape)) * itemsize
    held: dict[int, set] = defaultdict(set)
    for device, index in sharding.devices_indices_map(shape).items():
        held[device.process_index].add(tuple((s.start, s.stop) for s in index))
    return {host: size * len(shards) for host, shards in held.items()}


def distinct_bytes_per_host(leaves) -> dict[int, int]:
    """Bytes per process of the distinct shards of `leaves` its devices hold (a shard two of its
    devices hold counted once): what it keeps when it copies them to host memory once."""
    per_host: dict[int, int] = defaultdict(int)
    for leaf in leaves:
        for host, size in _distinct(tuple(leaf.shape), _itemsize(leaf), leaf.sharding).items():
            per_host[host] += size
    return dict(per_host)


def largest_leaf_per_host(leaves) -> int:
    """The most bytes one array has on one process's devices."""
    return max((_layout_of(leaf)[3] for leaf in leaves), default=0)


def _stacked(var) -> int:
    """How many HF tensors one stacked parameter holds (its leading `layers` and `experts` axes)."""
    names = list(var.get_metadata().get("out_sharding") or [])
    shape = var.get_value().shape
    count = 1
    for name, size in zip(names, shape, strict=False):
        if name not in ("layers", "experts"):
            break
        count *= size
    return count


def hf_bytes(abstract_params) -> tuple[int, int]:
    """(an HF import's host peak per process, an HF export's): one parameter's (one layer's) shards
    of a process's devices read in the file's dtype and converted (at most twice its bytes); one
    whole HF tensor gathered and laid out (twice its bytes)."""
    imported = exported = 0
    for _, var in nnx.to_flat_state(abstract_params):
        leaf = var.get_value()
        stacked = _stacked(var)
        local = max(state_bytes_per_host([leaf], written=False, replica_parallel=False).values())
        imported = max(imported, 2 * local // stacked)
        exported = max(exported, 2 * math.prod(leaf.shape) * _itemsize(leaf) // stacked)
    return imported, exported


def fingerprint_bytes(leaves) -> int:
    """The compiled fingerprint program's temporaries and outputs per device (`checkpoint.integrity`),
    run before a save and after a restore: host memory when the devices are the CPU."""
    from jax.sharding import NamedSharding

    from podtrain.orchestrator.checkpoint.integrity import _fingerprints

    mesh = leaves[0].sharding.mesh if isinstance(leaves[0].sharding, NamedSharding) else None
    mem = _fingerprints(mesh).lower(list(leaves)).compile().memory_analysis()
    return int(mem.temp_size_in_bytes + mem.output_size_in_bytes)


def host_memory(training, *, ram_bytes: int, platform: str, step_bytes: int | None = None) -> dict:
    """Each phase's host peak (the most of any process), the peak and whether it fits `ram_bytes`.

    `platform` is the devices' ("tpu", "cuda", "cpu"): on "cpu" the devices' memory is the
    host's. `step_bytes`: the compiled step's peak per process (counted on "cpu" only).
    """
    config = training.config
    leaves = [x for x in jax.tree.leaves(training.abstract_state()) if hasattr(x, "sharding")]
    written = max(state_bytes_per_host(leaves, written=True, replica_parallel=platform == "tpu").values())
    read = max(state_bytes_per_host(leaves, written=False, replica_parallel=False).values())
    largest = largest_leaf_per_host(leaves)  # an array moves whole: no bound holds less
    bound = config.checkpoint.host_gb * 10**9
    save = min(written, max(bound, largest)) if bound else written
    restore = min(read, max(bound or ORBAX_RESTORE_GB * 10**9, largest))
    imported, exported = hf_bytes(training.abstract_params)
    processes = max(d.process_index for d in training.mesh.devices.flat) + 1
    data = ((config.data.prefetch + 2) * math.ceil(config.train.batch_size / processes)
            * config.train.seq_len * BATCH_BYTES_PER_TOKEN)
    phases = {"checkpoint save": save, "checkpoint restore": restore, "HF import": imported, "HF export": exported}
    if platform == "cpu":  # the state is host memory: it stays while a save stages, a restore makes it
        resident = read + max(state_bytes_per_host([x for x in jax.tree.leaves(training.abstract_frozen())
                                                    if hasattr(x, "sharding")], written=False,
                                                   replica_parallel=False).values(), default=0)
        devices = max(Counter(d.process_index for d in training.mesh.devices.flat).values())
        fingerprints = fingerprint_bytes(leaves) * devices
        phases = {"checkpoint save": resident + max(save, fingerprints),
                  "checkpoint restore": resident + fingerprints,  # Orbax's read buffers become the arrays
                  "HF import": resident + imported, "HF export": resident + exported}
        if step_bytes is not None:
            phases["train step"] = step_bytes
    peak_of = max(phases, key=phases.get)
    peak = phases[peak_of] + data
    host = {"ram_bytes": ram_bytes, "phases": phases, "data_bytes": data, "peak_bytes": peak, "peak_of": peak_of,
            "fits": peak <= ram_bytes, "headroom_bytes": ram_bytes - peak,
            "orbax": {"save_staging_bytes": save, "restore_read_bytes": restore}}
    checkpoint = ("checkpoint save", "checkpoint restore")
    if not host["fits"] and peak_of in checkpoint and platform != "cpu":
        # The bound on a save's and a restore's host memory under which the peak fits, if any.
        others = max([v for k, v in phases.items() if k not in checkpoint], default=0)
        gb = (ram_bytes - data) // 10**9
        if others + data <= ram_bytes and gb >= 1 and gb * 10**9 >= largest:
            host["host_gb"] = int(gb)
    return host
