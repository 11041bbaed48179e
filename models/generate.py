"""Generation: prefill the prompts into a stacked KV cache, then decode under one `lax.while_loop`.

Prompts are right-padded into one (batch, prompt_len) array with their true lengths beside it:
padding slots hold position -1 in the cache, so no token attends to them, and each sequence
continues from its own length. The whole prefill + decode loop is one jitted program, and every
step runs the model's own forward (the layer runner training uses), reading the cache's filled
slots only.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from podtrain.models.linear import dense


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
        """Raises ValueError naming `<prefix>.<field>` when a field is out of range."""
        if not self.temperature >= 0:
            raise ValueError(f"{prefix}.temperature: expects a number >= 0 (0 = greedy), found {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"{prefix}.top_k: expects an integer >= 0 (0 = all tokens), found {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"{prefix}.top_p: expects a number in (0, 1], found {self.top_p}")


def greedy(logits_BV: jax.Array) -> jax.Array:
    """`argmax` per row as int32: the first index of the row's maximum (of its first NaN, if any).

    Written as a max and a min over the matching indices: two plain reductions, which XLA:CPU runs
    faster than `jnp.argmax`'s paired (value, index) reduction.
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


@partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "max_len", "sampling", "pad_id"))
def _generate(graphdef, state, prompt_ids, lengths, stop, key, *, max_new_tokens, max_len, sampling, pad_id):
    """The prefill, then decode steps until `max_new_tokens` or every row stopped, as one program.

    Returns (tokens (B, max_new_tokens) padded with `pad_id`, the number of steps made)."""
    model = nnx.merge(graphdef, state)
    # Always the scanned runner: unrolled layers would each hand the cache to their own block loop,
    # and XLA copies it for every one of them.
    model.config = dataclasses.replace(model.config, scan_layers=True)
    batch, prompt_len = prompt_ids.shape
    head = model.head()

    def next_token(hidden_BD, key, done):
        logits = dense(hidden_BD, head).astype(jnp.float32)
        token = sample(logits, key, sampling)
        token = jnp.where(done, pad_id, token)
        return token, done | jnp.isin(token, stop)

    cache = model.init_cache(batch, max_len)
    real = jnp.arange(prompt_len)[None] < lengths[:, None]
    hidden, cache, _ = model.hidden_states(prompt_ids, cache=cache, attention_mask=real)
    key, first_key = jax.random.split(key)
    token, done = next_token(hidden[jnp.arange(batch), lengths - 1], first_key, jnp.zeros((batch,), bool))
    tokens = jnp.full((batch, max_new_tokens), pad_id, jnp.int32).at[:, 0].set(token)

    def cond(carry):
        step, _, _, _, done, _ = carry
        return (step < max_new_tokens) & ~jnp.all(done)

    def body(carry):
        step, cache, token, tokens, done, key = carry
        positions = (lengths + step - 1)[:, None]
        hidden, cache, _ = model.hidden_states(token[:, None], positions=positions, cache=cache)
        key, step_key = jax.random.split(key)
        token, done = next_token(hidden[:, 0], step_key, done)
        tokens = jax.lax.dynamic_update_slice_in_dim(tokens, token[:, None], step, axis=1)
        return step + 1, cache, token, tokens, done, key

    carry = (jnp.ones((), jnp.int32), cache, token, tokens, done, key)
    step, _, _, tokens, _, _ = jax.lax.while_loop(cond, body, carry)
    return tokens, step


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
    """
    sampling.validate()
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
    tokens, steps = _generate(
        graphdef, state, jnp.asarray(ids), jnp.asarray(lengths), jnp.asarray(stop), jax.random.key(seed),
        max_new_tokens=max_new_tokens, max_len=max_len, sampling=sampling, pad_id=int(pad_id),
    )
    tokens = np.asarray(tokens)[:, : int(steps)]
    stops = set(int(t) for t in stop_tokens)
    out = []
    for row in tokens.tolist():
        end = next((i + 1 for i, t in enumerate(row) if t in stops), len(row))
        out.append(row[:end])
    return out
