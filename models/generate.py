"""Generation: prefill the prompts into a stacked KV cache, then decode under one `lax.while_loop`.

Prompts are right-padded into one (batch, prompt_len) array with their true lengths beside it:
padding slots hold position -1 in the cache, so no token attends to them, and each sequence
continues from its own length. The whole prefill + decode loop is one jitted program.

On CPU the decode steps read each layer's weights from per-layer copies made once per call
(`layer_weights`; see `models.runner.run_layers`), not from slices of the stacked arrays, attend
to the cache in a C++ kernel (`cache_reads`) and multiply by the weights in another
(`decode_matmuls`; both in `models.kernels`). On GPU a decode step reads
a small cache whole in one pass (see `models.layers.cached_attention`) rather than looping over
its filled blocks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import warnings
from collections.abc import Sequence
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from podtrain.models import kernels
from podtrain.models.kv_cache import CACHE_READS
from podtrain.models.layers import dense
from podtrain.models.runner import split_stack


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How the next token is chosen from the logits.

    Attributes:
        temperature: 0 picks the most likely token (greedy); otherwise logits are divided by it.
        top_k: keep only the k most likely tokens (0: all).
        top_p: keep the smallest set of most likely tokens whose probability reaches p (1: all).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def validate(self, prefix: str = "sampling") -> None:
        if self.temperature < 0:
            raise ValueError(f"{prefix}.temperature: expected >= 0 (0 = greedy), found {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"{prefix}.top_k: expected >= 0 (0 = all tokens), found {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"{prefix}.top_p: expected a number in (0, 1], found {self.top_p}")


def greedy(logits_BV: jax.Array) -> jax.Array:
    """`argmax` per row as int32: the first index of the row's maximum (of its first NaN, if any).

    Written as a max and a min over the matching indices: XLA:CPU runs `jnp.argmax`'s paired
    (value, index) reduction about 3x slower than these plain reductions (43-45 against 15-16 us
    for (4, 4096) logits), one to two percent of a small model's decode step.
    """
    nan = jnp.isnan(logits_BV)
    top = jnp.max(logits_BV, axis=-1, keepdims=True)
    hits = jnp.where(jnp.any(nan, axis=-1, keepdims=True), nan, logits_BV == top)
    index = jnp.arange(logits_BV.shape[-1], dtype=jnp.int32)
    return jnp.min(jnp.where(hits, index, logits_BV.shape[-1] - 1), axis=-1)


def sample(logits_BV: jax.Array, key: jax.Array, sampling: Sampling) -> jax.Array:
    """One token id per row of `logits_BV` (float32) as `sampling` says."""
    if sampling.temperature == 0:
        return greedy(logits_BV)
    logits = logits_BV.astype(jnp.float32) / sampling.temperature
    if sampling.top_k and sampling.top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, sampling.top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if sampling.top_p < 1.0:
        order = jnp.argsort(-logits, axis=-1, stable=True)  # most likely first; ties by token id
        probs = jax.nn.softmax(jnp.take_along_axis(logits, order, axis=-1), axis=-1)
        # Keep a token while the mass before it is below p: the most likely one is always kept. The
        # set is chosen by rank, not by value, so tokens tied with the last one kept stay out.
        keep_ranked = (jnp.cumsum(probs, axis=-1) - probs) < sampling.top_p
        keep = jnp.take_along_axis(keep_ranked, jnp.argsort(order, axis=-1), axis=-1)
        logits = jnp.where(keep, logits, -jnp.inf)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def pad_prompts(prompts: Sequence[Sequence[int]], pad_id: int, multiple: int = 8) -> tuple[np.ndarray, np.ndarray]:
    """(ids (B, P) right-padded with `pad_id`, lengths (B,)), P rounded up to `multiple` so that
    prompts of similar lengths share one compiled program."""
    if len(prompts) == 0 or any(len(p) == 0 for p in prompts):
        raise ValueError("prompts: expected at least one prompt, each of at least one token")
    lengths = np.array([len(p) for p in prompts], np.int32)
    width = -(-int(lengths.max()) // multiple) * multiple
    ids = np.full((len(prompts), width), pad_id, np.int32)
    for row, prompt in enumerate(prompts):
        ids[row, : len(prompt)] = prompt
    return ids, lengths


LAYER_WEIGHTS = ("auto", "split", "stacked")
CACHE_READS_CHOICES = ("auto", *CACHE_READS)
DECODE_MATMULS = ("auto", "xla", "kernel")
# On an H200 (f32, the benchmark's model) one pass over every slot beat the filled-block loop up to
# 64 MiB of slots per layer (1.04 against 1.26 ms per decode step) and lost at 128 MiB (1.51 against
# 1.28): bench/RESULTS.md.
ONE_PASS_MAX_LAYER_BYTES = 64 * 2**20


@partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "max_len", "sampling", "pad_id", "split_layers",
                                   "cache_reads", "decode_matmuls"))
def _generate(graphdef, state, prompt_ids, lengths, stop, key, *, max_new_tokens, max_len, sampling, pad_id,
              split_layers, cache_reads, decode_matmuls):
    model = nnx.merge(graphdef, state)
    # Made here, before the loop: one copy of the layer weights per call, read by every decode step.
    layer_states = [split_stack(stack) for stack in model.stacks()] if split_layers else None
    batch, prompt_len = prompt_ids.shape
    head = model.head()

    def next_token(hidden_BD, key, done):
        logits = dense(hidden_BD, head).astype(jnp.float32)
        token = sample(logits, key, sampling)
        token = jnp.where(done, pad_id, token)
        return token, done | jnp.isin(token, stop)

    cache = model.init_cache(batch, max_len, reads=cache_reads)
    real = jnp.arange(prompt_len)[None] < lengths[:, None]
    # Always the scanned runner: unrolled layers would each hand the cache to their own block loop,
    # and XLA copies it for every one of them.
    hidden, cache = model(prompt_ids, attention_mask=real, kv_cache=cache, return_hidden=True, scan=True)
    key, first_key = jax.random.split(key)
    token, done = next_token(hidden[jnp.arange(batch), lengths - 1], first_key, jnp.zeros((batch,), bool))
    tokens = jnp.full((batch, max_new_tokens), pad_id, jnp.int32).at[:, 0].set(token)

    def cond(carry):
        step, _, _, _, done, _ = carry
        return (step < max_new_tokens) & ~jnp.all(done)

    def body(carry):
        step, cache, token, tokens, done, key = carry
        positions = (lengths + step - 1)[:, None]
        matmuls = kernels.small_matmuls() if decode_matmuls == "kernel" else contextlib.nullcontext()
        with matmuls:
            hidden, cache = model(token[:, None], positions=positions, kv_cache=cache, return_hidden=True,
                                  scan=True, layer_states=layer_states)
            key, step_key = jax.random.split(key)
            token, done = next_token(hidden[:, 0], step_key, done)
        tokens = jax.lax.dynamic_update_slice_in_dim(tokens, token[:, None], step, axis=1)
        return step + 1, cache, token, tokens, done, key

    carry = (jnp.ones((), jnp.int32), cache, token, tokens, done, key)
    step, _, _, tokens, _, _ = jax.lax.while_loop(cond, body, carry)
    return tokens, step


def _platform(state: nnx.State) -> str:
    """The platform ("cpu", "gpu", "tpu") of the devices the params live on (numpy leaves go to the
    default backend's)."""
    for leaf in jax.tree.leaves(state):
        if isinstance(leaf, jax.Array):
            return next(iter(leaf.devices())).platform
    return jax.default_backend()


def _available_host_bytes() -> int | None:
    """The host's available memory (`MemAvailable` in /proc/meminfo), None where it cannot be read."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def auto_layer_weights(model: nnx.Module) -> str:
    """What `layer_weights="auto"` picks: "split" when the params are on CPU devices and a second
    copy of the layer weights fits in half of the host's available memory, else "stacked"."""
    if _platform(nnx.state(model)) != "cpu":
        return "stacked"
    layer_bytes = sum(leaf.nbytes for stack in model.stacks() for leaf in jax.tree.leaves(nnx.state(stack)))
    available = _available_host_bytes()
    return "stacked" if available is not None and layer_bytes > available // 2 else "split"


def auto_cache_reads(model: nnx.Module, batch: int, max_len: int) -> str:
    """What `cache_reads="auto"` picks: on one CPU device with a float32 cache "kernel" (when the
    kernel builds on this machine; else "filled", with a warning saying why); on GPU "all" while
    one layer's slots (keys and values of the whole batch) take at most `ONE_PASS_MAX_LAYER_BYTES`;
    otherwise "filled" (TPU, several devices, big caches on GPU, other dtypes)."""
    platform = _platform(nnx.state(model))
    cache = jax.eval_shape(lambda: model.init_cache(batch, max_len))
    if platform == "cpu":
        if _devices(nnx.state(model)) > 1 or any(k.dtype != jnp.float32 for k in (*cache.k, *cache.v)):
            return "filled"
        return "filled" if _kernel_missing() else "kernel"
    if platform == "gpu":
        return "all" if cache.layer_bytes() <= ONE_PASS_MAX_LAYER_BYTES else "filled"
    return "filled"


@functools.cache
def _kernel_missing() -> bool:
    """True (with one warning per process) when the CPU decode kernels cannot be built."""
    error = kernels.kernel_error()
    if error is not None:
        warnings.warn(f"decoding on CPU without the C++ decode-attention kernel ({error}) and matmul kernel: "
                      "cache_reads=auto and decode_matmuls=auto fall back to XLA (filled, xla), slower", stacklevel=3)
    return error is not None


def auto_decode_matmuls(model: nnx.Module) -> str:
    """What `decode_matmuls="auto"` picks: "kernel" on one CPU device with float32 params and
    compute (when the kernels build here; else a warning and "xla"), else "xla"."""
    state = nnx.state(model)
    if _platform(state) != "cpu" or _devices(state) > 1 or not _float32(model):
        return "xla"
    return "xla" if _kernel_missing() else "kernel"


def _float32(model: nnx.Module) -> bool:
    """Whether the model computes in float32 with float32 params."""
    config = model.config
    return config.dtype == "float32" and config.param_dtype == "float32"


def _devices(state: nnx.State) -> int:
    """How many devices the params span (the largest set any one param is on)."""
    return max((len(leaf.devices()) for leaf in jax.tree.leaves(state) if isinstance(leaf, jax.Array)), default=1)


def check_kernel_reads(model: nnx.Module) -> None:
    """Raises ValueError saying why when `cache_reads="kernel"` cannot run this model here."""
    _check_kernel(model, "cache_reads", "decode-attention")
    dtypes = sorted({str(a.dtype) for a in jax.tree.leaves(jax.eval_shape(lambda: model.init_cache(1, 1)))
                     if a.dtype != jnp.int32})
    if dtypes != ["float32"]:
        raise ValueError(f"cache_reads=kernel: the kernel reads a float32 cache; this model's cache is {dtypes} "
                         "(model.dtype); use cache_reads=filled")


def check_kernel_matmuls(model: nnx.Module) -> None:
    """Raises ValueError saying why when `decode_matmuls="kernel"` cannot run this model here."""
    _check_kernel(model, "decode_matmuls", "matmul")
    if not _float32(model):
        raise ValueError(f"decode_matmuls=kernel: the kernel multiplies float32; this model has dtype "
                         f"{model.config.dtype} and param_dtype {model.config.param_dtype}; use decode_matmuls=xla")


def _check_kernel(model: nnx.Module, key: str, kernel: str) -> None:
    """What both kernels need: params on CPU and the kernels built (raises ValueError naming `key`)."""
    platform = _platform(nnx.state(model))
    if platform != "cpu":
        raise ValueError(f"{key}=kernel: the {kernel} kernel runs on CPU; the params are on {platform}")
    error = kernels.kernel_error()
    if error is not None:
        raise ValueError(f"{key}=kernel: the CPU {kernel} kernel is not available: {error}")


def generate(
    model: nnx.Module,
    prompts: Sequence[Sequence[int]] | np.ndarray,
    *,
    max_new_tokens: int,
    lengths: Sequence[int] | np.ndarray | None = None,
    sampling: Sampling = Sampling(),
    stop_tokens: Sequence[int] = (),
    pad_id: int = 0,
    seed: int = 0,
    max_len: int | None = None,
    layer_weights: str = "auto",
    cache_reads: str = "auto",
    decode_matmuls: str = "auto",
) -> list[list[int]]:
    """Generates up to `max_new_tokens` tokens after each prompt; returns each sequence's new tokens.

    Args:
        model: a `Llama` / `DeepseekV3` (params may be sharded over a mesh; run it inside that mesh).
        prompts: token-id lists, or a right-padded (B, P) array with `lengths`.
        sampling: greedy by default; temperature, top-k and top-p otherwise.
        stop_tokens: a sequence ends after emitting one of these (it is included in its output).
        pad_id: fills the padding of prompts (never attended to) and of finished sequences.
        seed: the sampling seed: the same seed, prompts and model give the same tokens.
        max_len: cache slots per sequence (default: padded prompt length + max_new_tokens).
        layer_weights: where decode steps read each layer's weights: "split" from per-layer copies
            made once per call (faster on CPU, where XLA copies a stacked weight's slice before
            every matmul; holds a second copy of the layer weights while generating), "stacked"
            from the stacked arrays, "auto" (default) "split" when the params are on CPU devices
            and the copy fits in half of the host's available memory (`auto_layer_weights`).
        cache_reads: how a decode step reads a layer's cache slots: "filled" loops over the filled
            blocks only (the cost follows the tokens so far, not `max_len`; the loop's trip count
            depends on the data, which costs a device-to-host read per layer and token on GPU),
            "all" reads every slot in one pass, "kernel" reads the filled slots in one call of a
            C++ kernel (CPU, float32 cache; `models.kernels`), "auto" (default) "kernel" on one CPU
            device, "all" on GPU for a cache of at most 64 MiB per layer, else "filled"
            (`auto_cache_reads`).
        decode_matmuls: how a decode step multiplies its few rows by each weight: "xla" (XLA's
            dot, one core on CPU), "kernel" (a C++ kernel sharing the columns out over the CPU's
            cores; float32 only; `models.kernels.matmul`), "auto" (default) "kernel" on one CPU
            device with a float32 model, else "xla" (`auto_decode_matmuls`).
    """
    sampling.validate()
    if layer_weights not in LAYER_WEIGHTS:
        raise ValueError(f"layer_weights: expected one of {', '.join(LAYER_WEIGHTS)}, found {layer_weights!r}")
    if cache_reads not in CACHE_READS_CHOICES:
        raise ValueError(f"cache_reads: expected one of {', '.join(CACHE_READS_CHOICES)}, found {cache_reads!r}")
    if decode_matmuls not in DECODE_MATMULS:
        raise ValueError(f"decode_matmuls: expected one of {', '.join(DECODE_MATMULS)}, found {decode_matmuls!r}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: expected >= 1, found {max_new_tokens}")
    if lengths is None:
        ids, lengths = pad_prompts(prompts, pad_id)
    else:
        ids, lengths = np.asarray(prompts, np.int32), np.asarray(lengths, np.int32)
        if ids.ndim != 2 or lengths.shape != ids.shape[:1] or lengths.min() < 1 or lengths.max() > ids.shape[1]:
            raise ValueError(f"prompts/lengths: expected a (B, P) array and B lengths in [1, P], found shapes "
                             f"{ids.shape} and {lengths.shape} (lengths {lengths.tolist()})")
    needed = ids.shape[1] + max_new_tokens - 1
    limit = model.config.max_position_embeddings
    if int(lengths.max()) + max_new_tokens - 1 > limit:
        warnings.warn(f"generation reaches position {int(lengths.max()) + max_new_tokens - 2}, past the "
                      f"{limit} positions the model is made for (model.max_position_embeddings): expect worse "
                      "tokens there", stacklevel=2)
    max_len = needed if max_len is None else max_len
    if max_len < needed:
        raise ValueError(f"max_len: {max_len} cache slots cannot hold a {ids.shape[1]}-token padded prompt and "
                         f"{max_new_tokens} new tokens (need {needed})")
    # Stop ids are data, padded with -1 (never a token) to a multiple of 8: changing them does not recompile.
    stop = np.full(-(-max(len(stop_tokens), 1) // 8) * 8, -1, np.int32)
    stop[: len(stop_tokens)] = stop_tokens
    graphdef, state = nnx.split(model)
    if layer_weights == "auto":
        layer_weights = auto_layer_weights(model)
    if cache_reads == "auto":
        cache_reads = auto_cache_reads(model, ids.shape[0], max_len)
    elif cache_reads == "kernel":
        check_kernel_reads(model)
    if decode_matmuls == "auto":
        decode_matmuls = auto_decode_matmuls(model)
    elif decode_matmuls == "kernel":
        check_kernel_matmuls(model)
    tokens, steps = _generate(
        graphdef, state, jnp.asarray(ids), jnp.asarray(lengths), jnp.asarray(stop), jax.random.key(seed),
        max_new_tokens=max_new_tokens, max_len=max_len, sampling=sampling, pad_id=int(pad_id),
        split_layers=layer_weights == "split", cache_reads=cache_reads, decode_matmuls=decode_matmuls,
    )
    tokens = np.asarray(tokens)[:, : int(steps)]
    stops = set(int(t) for t in stop_tokens)
    out = []
    for row in tokens.tolist():
        end = next((i + 1 for i, t in enumerate(row) if t in stops), len(row))
        out.append(row[:end])
    return out
