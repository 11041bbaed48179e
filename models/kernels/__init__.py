"""Native CPU kernels for decoding, compiled from their C++ source on first use and called
through XLA's FFI.

- `decode_attention` (`decode_attention.cc`): a decode step's attention to one layer of a stacked
  KV cache. XLA:CPU runs that attention as a dozen small library calls and loops per layer,
  copying each block of slots out of the stacked cache first; the kernel reads the slots in
  place, once, in one call.
- `matmul` (`decode_matmul.cc`): a few rows times a weight matrix, the columns shared out over
  the CPU's cores (XLA:CPU runs such a product on one core). `dense` in `models.layers` routes a
  decode step's projections here inside `small_matmuls()`.

bench/RESULTS.md has the numbers. The shared library is built with the host's C++ compiler
(`$CXX`, else `c++`) against the FFI headers shipped with jaxlib, for this machine's CPU
(`-march=native`), into `$PODTRAIN_KERNEL_CACHE` (default `~/.cache/podtrain/kernels`) under a
name hashing everything that goes into it (sources, flags, compiler, jaxlib, CPU flags); later
processes load it from there. Where it cannot be built, `kernel_error()` says why and the
kernels raise.
"""

from __future__ import annotations

import contextlib
import contextvars
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

SOURCES = (Path(__file__).with_name("decode_attention.cc"), Path(__file__).with_name("decode_matmul.cc"))
# FFI target name -> the handler's symbol in the library.
TARGETS = {"podtrain_decode_attention": "PodtrainDecodeAttention", "podtrain_decode_matmul": "PodtrainDecodeMatmul"}
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

    digest = hashlib.sha256(b"\0".join([
        *(path.read_bytes() for path in SOURCES), " ".join(FLAGS).encode(), compiler_id.encode(),
        jaxlib.__version__.encode(), platform.machine().encode(), _cpu_flags().encode(),
    ])).hexdigest()[:16]
    target = cache_dir() / f"podtrain_kernels-{digest}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Built under a temporary name and renamed: concurrent processes never load a half-written file.
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        partial = Path(tmp) / target.name
        command = [compiler, *FLAGS, f"-I{jax.ffi.include_dir()}", *map(str, SOURCES), "-o", str(partial)]
        result = subprocess.run(command, capture_output=True, text=True, timeout=600)
        if result.returncode != 0:
            names = ", ".join(path.name for path in SOURCES)
            raise RuntimeError(f"building {names} failed ({' '.join(command)}):\n{result.stderr.strip()}")
        os.replace(partial, target)
    return target


@functools.cache
def _registered() -> str | None:
    """Builds, loads and registers the kernels once per process; returns why it could not, or None."""
    try:
        library = ctypes.cdll.LoadLibrary(str(_build()))
        for target, symbol in TARGETS.items():
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, symbol)), platform="cpu")
    except (RuntimeError, OSError, AttributeError) as error:
        return str(error)
    return None


def kernel_error() -> str | None:
    """None when the kernels are built and registered (building them if needed), else why not."""
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
        raise RuntimeError(f"the CPU decode kernels are not available: {error}")
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
    call = jax.ffi.ffi_call("podtrain_decode_attention", out)
    return call(value_cache, new_values, jnp.asarray(layer, jnp.int32), jnp.asarray(cache_used, jnp.int32),
                cache_positions_BS.astype(jnp.int32), positions_B.astype(jnp.int32), attended_B.astype(jnp.int32),
                *parts, threads=int(threads or _cpu_count()))


# Matmuls of at most this many rows (the batch of a decode step) go to `matmul` inside
# `small_matmuls()`: measured at 4 (bench/RESULTS.md); more rows read the weight once per 4.
SMALL_MATMUL_ROWS = 8
# Columns per task shared out between threads (a multiple of the kernel's 64-column tile).
MATMUL_BLOCK = 128
_SMALL_MATMULS: contextvars.ContextVar[bool] = contextvars.ContextVar("podtrain_small_matmuls", default=False)


@contextlib.contextmanager
def small_matmuls():
    """Inside the block (while tracing), `models.layers.dense` sends float32 products of at most
    `SMALL_MATMUL_ROWS` rows to `matmul`: what `generate` does for decode steps on CPU."""
    token = _SMALL_MATMULS.set(True)
    try:
        yield
    finally:
        _SMALL_MATMULS.reset(token)


def use_matmul(x: jax.Array, w: jax.Array) -> bool:
    """Whether `x (M, K) @ w (K, N)` goes to `matmul` here: inside `small_matmuls()`, float32, M <=
    `SMALL_MATMUL_ROWS`."""
    return (_SMALL_MATMULS.get() and x.shape[0] <= SMALL_MATMUL_ROWS and x.dtype == jnp.float32
            and w.dtype == jnp.float32)


def matmul(x: jax.Array, w: jax.Array, threads: int | None = None) -> jax.Array:
    """`x (M, K) @ w (K, N)` in float32 on CPU, the columns shared between `threads` threads (this
    one and XLA's intra-op pool; default: the CPUs this process may run on)."""
    error = kernel_error()
    if error is not None:
        raise RuntimeError(f"the CPU decode kernels are not available: {error}")
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0] or x.dtype != jnp.float32 or w.dtype != jnp.float32:
        raise ValueError(f"matmul: expected float32 x (M, K) and w (K, N), found {x.dtype}{list(x.shape)} and "
                         f"{w.dtype}{list(w.shape)}")
    out = jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), jnp.float32)
    return jax.ffi.ffi_call("podtrain_decode_matmul", out)(x, w, threads=int(threads or _cpu_count()),
                                                             block=MATMUL_BLOCK)


def _cpu_count() -> int:
    """The CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
