"""Native CPU kernels, compiled from their C++ source on first use and called through XLA's FFI.

One kernel so far, `decode_attention`: a decode step's attention to one layer of a stacked KV
cache on CPU (`decode_attention.cc`). XLA:CPU runs that attention as a dozen small library calls
and loops per layer, copying each block of slots out of the stacked cache first; the kernel reads
the slots in place, once, in one call (bench/RESULTS.md has the numbers).

The shared library is built with the host's C++ compiler (`$CXX`, else `c++`) against the FFI
headers shipped with jaxlib, for this machine's CPU (`-march=native`), into
`$PODTRAIN_KERNEL_CACHE` (default `~/.cache/podtrain/kernels`) under a name hashing everything
that goes into it (source, flags, compiler, jaxlib, CPU flags); later processes load it from
there. Where it cannot be built, `kernel_error()` says why and `decode_attention` raises.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp

SOURCE = Path(__file__).with_name("decode_attention.cc")
TARGET = "podtrain_decode_attention"
SYMBOL = "PodtrainDecodeAttention"
FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-std=c++17", "-shared", "-fPIC")
# Parts of the score (q . k summed over parts) the kernel takes: GQA has one, MLA two.
MAX_PARTS = 4


def cache_dir() -> Path:
    """Where built kernels are kept: `$PODTRAIN_KERNEL_CACHE`, else `~/.cache/podtrain/kernels`."""
    explicit = os.environ.get("PODTRAIN_KERNEL_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "podtrain" / "kernels"


def _cpu_flags() -> str:
    """The CPU's feature flags (what `-march=native` builds for), "" where /proc/cpuinfo is missing."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next((line for line in cpuinfo if line.startswith("flags")), "")
    except OSError:
        return ""


def _compiler_id(compiler: str) -> str:
    result = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60, check=True)
    return result.stdout.splitlines()[0] if result.stdout else compiler


def _build() -> Path:
    """The built library's path (built now if no up-to-date build is cached). Raises RuntimeError
    naming the compiler and its output when the build fails."""
    compiler = os.environ.get("CXX", "c++")
    try:
        compiler_id = _compiler_id(compiler)
    except (OSError, subprocess.SubprocessError) as error:
        raise RuntimeError(f"no working C++ compiler ({compiler!r}, set $CXX to choose one): {error}") from error
    import jaxlib

    source = SOURCE.read_bytes()
    digest = hashlib.sha256(b"\0".join([
        source, " ".join(FLAGS).encode(), compiler_id.encode(), jaxlib.__version__.encode(),
        platform.machine().encode(), _cpu_flags().encode(),
    ])).hexdigest()[:16]
    target = cache_dir() / f"decode_attention-{digest}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Built under a temporary name and renamed: concurrent processes never load a half-written file.
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        partial = Path(tmp) / target.name
        command = [compiler, *FLAGS, f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", str(partial)]
        result = subprocess.run(command, capture_output=True, text=True, timeout=600)
        if result.returncode != 0:
            raise RuntimeError(f"building {SOURCE.name} failed ({' '.join(command)}):\n{result.stderr.strip()}")
        os.replace(partial, target)
    return target


@functools.cache
def _registered() -> str | None:
    """Builds, loads and registers the kernel once per process; returns why it could not, or None."""
    try:
        library = ctypes.cdll.LoadLibrary(str(_build()))
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(getattr(library, SYMBOL)), platform="cpu")
    except (RuntimeError, OSError, AttributeError) as error:
        return str(error)
    return None


def kernel_error() -> str | None:
    """None when the decode-attention kernel is built and registered (building it if needed), else why not."""
    return _registered()


def decode_attention(queries, new_keys, new_values, key_caches, value_cache, *, layer, positions_B, attended_B,
                     cache_positions_BS, cache_used, threads: int | None = None):
    """One new token per sequence attending to itself and to the filled slots of layer `layer` of a
    stacked cache, on CPU: the softmax over both, applied to the values.

    Args:
        queries: per key part, (B, K, G, Dp) float32 queries (scaled), G queries per kv head.
        new_keys: per part, the new token's (B, K, Dp) keys; `new_values` its (B, K, E) values.
        key_caches: per part, the stacked (L, B, S, K, Dp) float32 cache.
        value_cache: the stacked (L, B, S, K, E) float32 cache.
        layer: the layer whose slots are read (int32 scalar, traced or not).
        positions_B: each sequence's new token's position; a slot is attended to when its position
            (`cache_positions_BS`, -1 for empty or padding) is in [0, that position] and it lies
            below `cache_used`.
        attended_B: whether each new token attends to itself (False for a padding token).
        threads: threads sharing the (batch, kv head) rows: this one and up to `threads - 1` of
            XLA's intra-op pool (default: the CPUs this process may run on).

    Returns:
        (B, K, G, E) float32; zeros for a row with nothing to attend to.
    """
    error = kernel_error()
    if error is not None:
        raise RuntimeError(f"the CPU decode-attention kernel is not available: {error}")
    if not 1 <= len(queries) == len(new_keys) == len(key_caches) <= MAX_PARTS:
        raise ValueError(f"decode_attention: expected 1 to {MAX_PARTS} (query, new key, key cache) parts, found "
                         f"{len(queries)} queries, {len(new_keys)} new keys and {len(key_caches)} key caches")
    arrays = [*queries, *new_keys, *key_caches, new_values, value_cache]
    if any(a.dtype != jnp.float32 for a in arrays):
        raise ValueError(f"decode_attention: expected float32 queries, keys, values and caches, found "
                         f"{sorted({str(a.dtype) for a in arrays})}")
    b, k, g = queries[0].shape[:3]
    out = jax.ShapeDtypeStruct((b, k, g, value_cache.shape[-1]), jnp.float32)
    parts = [a for part in zip(queries, new_keys, key_caches, strict=True) for a in part]
    call = jax.ffi.ffi_call(TARGET, out)
    return call(value_cache, new_values, jnp.asarray(layer, jnp.int32), jnp.asarray(cache_used, jnp.int32),
                cache_positions_BS.astype(jnp.int32), positions_B.astype(jnp.int32), attended_B.astype(jnp.int32),
                *parts, threads=int(threads or _cpu_count()))


def _cpu_count() -> int:
    """The CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
