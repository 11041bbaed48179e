"""Whether a checkpoint step restored is the one that was saved, decided by every process together.

A damaged file does not always fail to read: garbled bytes inside a compressed chunk can decode to
wrong values without any error. So every save also records a fingerprint of each array (two
wrapping 32-bit sums of its bits, one of them weighted by position), and a restore recomputes them.
The sums are exact integer arithmetic over the global array, so they do not depend on the mesh the
state is saved or restored on.

With several processes, each reads only its own shards, so a damaged file may fail on some of them
and not on others. Each process reports its outcome (`verdict`), the reports are gathered, and
`raise_if_failed` raises the same way on every process: the processes fall back to the same step.
`drop_abandoned_reads` keeps the reads a failed restore leaves in flight from filling the log.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import hashlib
import json
import os
import sys
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

# What a damaged step raises: tensorstore reports DATA_LOSS, OUT_OF_RANGE and NOT_FOUND as
# ValueError, a broken JSON file is a ValueError, a missing file an OSError, a missing item a KeyError.
# Orbax wraps a failed array read in a bare Exception whose cause is one of these.
DAMAGE_ERRORS = (ValueError, OSError, KeyError)


class DamagedStepError(RuntimeError):
    """A committed step cannot be restored: its files are damaged (on this process or another one),
    its arrays differ from the ones saved, or it does not match the state it is restored into.

    Attributes:
        step: the step.
        reason: what failed, e.g. "process 1: ValueError: OUT_OF_RANGE: Error reading ...".
    """

    def __init__(self, step: int, directory: str, reason: str):
        self.step, self.reason = step, reason
        super().__init__(f"checkpoint step {step} in {directory} cannot be restored ({reason})")


def describe(error: BaseException, max_chars: int = 300) -> str:
    """The error's type and first line, cut short (tensorstore appends its whole spec as JSON); for an
    error that wraps a damaged file's (Orbax's bare Exception), that cause's."""
    error = damage_in(error) or error
    text = (str(error).splitlines() or [""])[0]
    if len(text) > max_chars:
        text = text[:max_chars] + "..."
    return f"{type(error).__name__}: {text}"


def damage_in(error: BaseException | None) -> BaseException | None:
    """The error in `error`'s chain (itself, then its causes) that says a step's files are damaged."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, DAMAGE_ERRORS):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def verdict(error: Exception | None) -> dict | None:
    """What one process tells the others about its read of a step: None when it succeeded."""
    if error is None:
        return None
    return {"damaged": damage_in(error) is not None, "error": describe(error)}


def raise_if_failed(step: int, directory: str, error: Exception | None, verdicts: list) -> None:
    """Raises the same way on every process when any process's read of `step` failed.

    Args:
        step, directory: the step read, for the message.
        error: this process's own error, or None.
        verdicts: every process's `verdict`, in process order (`gather_json`).

    Raises:
        DamagedStepError: every failure is damage.
        Exception: this process's own error when it is not damage, or a RuntimeError naming the
            process whose error is not.
    """
    failed = [(i, v) for i, v in enumerate(verdicts) if v is not None]
    if not failed:
        return
    other = [(i, v) for i, v in failed if not v["damaged"]]
    if other:
        if error is not None and damage_in(error) is None:
            raise error
        i, v = other[0]
        raise RuntimeError(f"restoring checkpoint step {step} from {directory} failed on process {i} ({v['error']})")
    i, v = failed[0]
    where = f"process {i}: " if len(verdicts) > 1 else ""
    raise DamagedStepError(step, directory, where + v["error"]) from error


class _DropAbandonedReads:
    """A `sys.unraisablehook` that drops what abandoned Orbax reads report and passes on the rest."""

    def __init__(self, previous):
        self.previous = previous

    def __call__(self, unraisable) -> None:
        code = getattr(unraisable.object, "cr_code", None)
        orbax_read = code is not None and f"{os.sep}orbax{os.sep}" in code.co_filename
        closed_loop = unraisable.exc_type is RuntimeError and str(unraisable.exc_value) == "Event loop is closed"
        if not (orbax_read or closed_loop):
            self.previous(unraisable)


def _drop_installed() -> bool:
    return isinstance(sys.unraisablehook, _DropAbandonedReads)


@contextlib.contextmanager
def abandoned_reads_dropped():
    """Drops abandoned reads' reports while a restore runs (see `drop_abandoned_reads`).

    Orbax raises at the first read that fails, and the other reads may complete and report before
    that error reaches the caller, so the hook is in place from the start of the read. It is taken
    down afterwards unless the read met a damaged step."""
    installed = None
    if not _drop_installed():
        installed = sys.unraisablehook = _DropAbandonedReads(sys.unraisablehook)
    try:
        yield
    finally:
        if installed is not None and not _keep_dropping and sys.unraisablehook is installed:
            sys.unraisablehook = installed.previous


def drop_abandoned_reads(error: BaseException) -> None:
    """Frees the reads a failed restore left behind, and keeps their noise out of the log.

    Orbax gathers a step's array reads and raises at the first that fails, closing its event loop
    with the others in flight. Each of them later reports its own failure with the whole
    TensorStore spec: as an "Exception ignored" traceback when its coroutine is collected, or as
    "Event loop is closed" when its read completes: dozens of tracebacks after one damaged step,
    already reported in one line. From the first damaged step on, this process drops those two
    kinds of unraisable errors (nothing else). The tracebacks of `error`'s chain hold the
    coroutines, so they are cleared and the coroutines collected now."""
    global _keep_dropping
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        error.__traceback__ = None
        error = error.__cause__ or error.__context__
    _keep_dropping = True
    if not _drop_installed():
        sys.unraisablehook = _DropAbandonedReads(sys.unraisablehook)
    gc.collect()


_keep_dropping = False


def gather_json(value: Any) -> list:
    """`value` (JSON-able) of every process, in process order, through two allgathers of bytes."""
    if jax.process_count() == 1:
        return [value]
    data = np.frombuffer(json.dumps(value).encode(), np.uint8)
    sizes = multihost_utils.process_allgather(np.int32(data.size)).tolist()
    padded = np.zeros(max(sizes), np.uint8)
    padded[: data.size] = data
    rows = multihost_utils.process_allgather(padded)
    return [json.loads(bytes(row[:size])) for row, size in zip(rows, sizes, strict=True)]


def _as_uint32(x: jax.Array) -> jax.Array:
    """The bits of `x` as uint32 (narrower types widened; 64-bit ones gain a trailing axis of 2)."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[x.dtype.itemsize]
    return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)


def _fingerprint(x: jax.Array) -> jax.Array:
    """Two wrapping uint32 sums of `x`'s bits: plain, and weighted by an odd hash of each element's
    position (so that moved values count too). Elementwise with x's own sharding, then a reduction:
    no array is ever gathered."""
    bits = _as_uint32(x)
    position = jnp.zeros(bits.shape, jnp.uint32)
    stride = 1
    for axis in reversed(range(bits.ndim)):
        position = position + jax.lax.broadcasted_iota(jnp.uint32, bits.shape, axis) * jnp.uint32(stride % 2**32)
        stride *= bits.shape[axis]
    weight = position * jnp.uint32(0x9E3779B1) + jnp.uint32(1)
    return jnp.stack([jnp.sum(bits, dtype=jnp.uint32), jnp.sum(bits * weight, dtype=jnp.uint32)])


@functools.cache
def _fingerprints(mesh: Mesh | None):
    """The jitted fingerprints of a list of arrays on `mesh`, replicated so every process can read them."""
    replicated = None if mesh is None else NamedSharding(mesh, PartitionSpec())
    return jax.jit(lambda leaves: [_fingerprint(x) for x in leaves], out_shardings=replicated)


def fingerprints(tree: Any) -> dict[str, list[int]]:
    """Each array leaf's fingerprint, keyed by its path in `tree` (other leaves, such as Orbax's
    placeholders for items not read, are skipped). Every process must call it: a collective."""
    paths, leaves = [], []
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if isinstance(leaf, jax.Array):
            paths.append(jax.tree_util.keystr(path))
            leaves.append(leaf)
    if not leaves:
        return {}
    mesh = leaves[0].sharding.mesh if isinstance(leaves[0].sharding, NamedSharding) else None
    values = jax.device_get(_fingerprints(mesh)(leaves))
    return {path: [int(v) for v in value] for path, value in zip(paths, values, strict=True)}


def changed_leaves(saved: Mapping[str, list[int]], tree: Any, shown: int = 3) -> str:
    """The leaves of `tree` whose fingerprint differs from the one `saved` recorded, as text (the
    first `shown`, then how many more); "" when all that were saved match."""
    now = fingerprints(tree)
    changed = [path for path, value in now.items() if path in saved and list(saved[path]) != value]
    more = f" and {len(changed) - shown} more" if len(changed) > shown else ""
    return ", ".join(changed[:shown]) + more


def content_hash(tree: Any) -> str:
    """A SHA-256 of every array leaf's fingerprint with its path: the same for the same values
    whatever the mesh (a collective, like `fingerprints`)."""
    return hashlib.sha256(json.dumps(fingerprints(tree), sort_keys=True).encode()).hexdigest()
