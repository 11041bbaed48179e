"""Generation: the one sampler and the one decode loop (prefill into a stacked KV cache, then decode
under one `lax.while_loop`), and `generate`, the host's way in.

Prompts are right-padded into one (batch, prompt_len) array with their true lengths beside it:
padding entries hold position -1 in the cache, so no token attends to them, and each sequence
continues from its own length. The prefill and the decode loop run the model's own forward (the
layer runner training uses), reading the cache's filled entries only. Every row has its own
sampling (temperature, top-k, top-p, random key), stop sequences and token budget, so one program
serves rows of many requests (`podtrain serve` runs it in its sampling program, each row on its
own adapter).
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

from podtrain.models.loss import vocab_slices


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

    @property
    def filtered(self) -> bool:
        """Whether top-k or top-p leave tokens out."""
        return self.top_k > 0 or self.top_p < 1.0


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RowSampling:
    """How each of B rows picks its tokens: `temperature` (B,) (0: greedy), `top_k` (B,) int32
    (0: all), `top_p` (B,) and `key` (B,), each row's random key (folded with the step number)."""

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    key: jax.Array

    @classmethod
    def of(cls, sampling: Sampling, keys: jax.Array) -> RowSampling:
        """`sampling` for every row, each with its key of `keys` (B,)."""
        b = keys.shape[0]
        return cls(jnp.full((b,), sampling.temperature, jnp.float32), jnp.full((b,), sampling.top_k, jnp.int32),
                   jnp.full((b,), sampling.top_p, jnp.float32), keys)


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


def pick_tokens(logits_BV: jax.Array, keys: jax.Array, sampling: RowSampling, *, filtered: bool):
    """(token, its logprob) per row: greedy where the temperature is 0; else drawn with the row's
    key from the logits divided by the temperature, restricted (`filtered`, static) to the row's
    top-k and then top-p tokens. Top-k and top-p choose by rank (ties by token id, as transformers
    does), so top-k keeps exactly k tokens and the most likely one is always kept. The logprob is
    under the distribution the token was drawn from."""
    logits = logits_BV.astype(jnp.float32)
    hot = sampling.temperature > 0
    scaled = logits / jnp.where(hot, sampling.temperature, 1.0)[:, None]
    if filtered:
        vocab = logits.shape[-1]
        order = jnp.argsort(-scaled, axis=-1, stable=True)  # most likely first; ties by token id
        ranked = jnp.take_along_axis(scaled, order, axis=-1)
        in_k = jnp.arange(vocab)[None] < jnp.where(sampling.top_k > 0, sampling.top_k, vocab)[:, None]
        probs = jax.nn.softmax(jnp.where(in_k, ranked, -jnp.inf), axis=-1)
        # Keep a token while the mass before it is below p.
        keep_ranked = in_k & ((jnp.cumsum(probs, axis=-1) - probs) < sampling.top_p[:, None])
        keep = jnp.take_along_axis(keep_ranked, jnp.argsort(order, axis=-1), axis=-1)
        scaled = jnp.where(keep, scaled, -jnp.inf)
    best = greedy(logits)

    def draw():
        drawn = jax.vmap(lambda key, row: jax.random.categorical(key, row))(keys, scaled).astype(jnp.int32)
        return jnp.where(hot, drawn, best)

    token = jax.lax.cond(jnp.any(hot), draw, lambda: best)  # an all-greedy batch draws nothing
    logprobs = jax.nn.log_softmax(jnp.where(hot[:, None], scaled, logits), axis=-1)
    return token, jnp.take_along_axis(logprobs, token[:, None], axis=-1)[:, 0]


def ends_with_stop(tokens_BN: jax.Array, step, stop_BSL: jax.Array) -> jax.Array:
    """(B,) whether each row's tokens through `step` end with one of its stop sequences (`stop_BSL`:
    S sequences per row, each right-aligned in L with -1 before it; a stop token is a sequence of
    one; all -1: none)."""
    length = stop_BSL.shape[-1]
    at = step - (length - 1) + jnp.arange(length)
    window = jnp.where(at >= 0, jnp.take(tokens_BN, jnp.maximum(at, 0), axis=1), -2)  # -2: before the first
    matched = jnp.all((stop_BSL == -1) | (stop_BSL == window[:, None, :]), axis=-1)
    return jnp.any(matched & jnp.any(stop_BSL >= 0, axis=-1), axis=-1)


def decode(model: nnx.Module, prompt_BP: jax.Array, length_B: jax.Array, sampling: RowSampling,
           stop_BSL: jax.Array, max_tokens_B: jax.Array, *, new_tokens: int, filtered: bool,
           max_len: int | None = None, pad_id: int = 0, prompt_logprobs: bool = False, loss_chunk: int = 0):
    """Prefill the prompts, then decode up to `new_tokens` tokens per row (traced; the caller jits).

    Each row's tokens end at one of its stop sequences (included) or after `max_tokens_B[b]`
    tokens; the rest of its row is `pad_id` with logprob 0, and the loop ends when every row has
    ended. `max_len` is the cache's entries per row (default: prompt length + `new_tokens`).

    Returns:
        (tokens (B, new_tokens) int32, their logprobs (B, new_tokens) float32, steps made, prompt
        logprobs (B, P) float32 with NaN first, or None without `prompt_logprobs`; these apply
        the head a vocabulary slice at a time, as the loss does with `loss_chunk`).
    """
    # Always the scanned runner: unrolled layers would each hand the cache to their own block loop,
    # and XLA copies it for every one of them.
    model.config = dataclasses.replace(model.config, scan_layers=True)
    rows, prompt_len = prompt_BP.shape

    def choose(hidden_BD, step, done, tokens, logprobs):
        """The next token of every row written at `step`; rows that end with it are done."""
        keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(sampling.key, step)
        token, logprob = pick_tokens(model.logits(hidden_BD), keys, sampling, filtered=filtered)
        token, logprob = jnp.where(done, pad_id, token), jnp.where(done, 0.0, logprob)
        tokens = jax.lax.dynamic_update_slice_in_dim(tokens, token[:, None], step, axis=1)
        logprobs = jax.lax.dynamic_update_slice_in_dim(logprobs, logprob[:, None], step, axis=1)
        stopped = ends_with_stop(tokens, step, stop_BSL) | (step + 1 >= max_tokens_B)
        return token, tokens, logprobs, done | stopped

    cache = model.init_cache(rows, prompt_len + new_tokens if max_len is None else max_len)
    real = jnp.arange(prompt_len)[None] < length_B[:, None]
    hidden, cache, _ = model.hidden_states(prompt_BP, cache=cache, attention_mask=real)
    prompt_lp = None
    if prompt_logprobs:
        lp = model.target_logprobs(hidden[:, :-1], prompt_BP[:, 1:], slices=vocab_slices(prompt_len - 1, loss_chunk))
        prompt_lp = jnp.concatenate([jnp.full((rows, 1), jnp.nan), lp], axis=1)
    token, tokens, logprobs, done = choose(hidden[jnp.arange(rows), length_B - 1], 0, jnp.zeros((rows,), bool),
                                           jnp.full((rows, new_tokens), pad_id, jnp.int32),
                                           jnp.zeros((rows, new_tokens), jnp.float32))

    def cond(carry):
        step, _, _, _, _, done = carry
        return (step < new_tokens) & ~jnp.all(done)

    def body(carry):
        step, cache, token, tokens, logprobs, done = carry
        positions = (length_B + step - 1)[:, None]
        hidden, cache, _ = model.hidden_states(token[:, None], positions=positions, cache=cache)
        token, tokens, logprobs, done = choose(hidden[:, 0], step, done, tokens, logprobs)
        return step + 1, cache, token, tokens, logprobs, done

    carry = (jnp.ones((), jnp.int32), cache, token, tokens, logprobs, done)
    steps, _, _, tokens, logprobs, _ = jax.lax.while_loop(cond, body, carry)
    return tokens, logprobs, steps, prompt_lp


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


@partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "max_len", "filtered", "pad_id"))
def _generate(graphdef, state, prompt_ids, lengths, sampling, stop, *, max_new_tokens, max_len, filtered, pad_id):
    """`decode` of the model `(graphdef, state)`, every row with the same budget, as one program."""
    budget = jnp.full(lengths.shape, max_new_tokens, jnp.int32)
    tokens, _, steps, _ = decode(nnx.merge(graphdef, state), prompt_ids, lengths, sampling, stop, budget,
                                 new_tokens=max_new_tokens, filtered=filtered, max_len=max_len, pad_id=pad_id)
    return tokens, steps


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
        seed: the sampling seed: the same seed, prompts and model give the same tokens (row b
            draws with the seed's key folded with b).
        max_len: cache entries per sequence (default: padded prompt length + max_new_tokens - 1).
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
        raise ValueError(f"max_len: {max_len} cache entries cannot hold a {ids.shape[1]}-token padded prompt and "
                         f"{max_new_tokens} new tokens (need {needed})")
    # Stop ids are data, sequences of one padded with -1 (never a token) to a multiple of 8:
    # changing them does not recompile.
    stop = np.full((len(ids), -(-max(len(stop_tokens), 1) // 8) * 8, 1), -1, np.int32)
    stop[:, : len(stop_tokens), 0] = stop_tokens
    keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(jax.random.key(seed), jnp.arange(len(ids)))
    graphdef, state = nnx.split(model)
    tokens, steps = _generate(
        graphdef, state, jnp.asarray(ids), jnp.asarray(lengths), RowSampling.of(sampling, keys), jnp.asarray(stop),
        max_new_tokens=max_new_tokens, max_len=max_len, filtered=sampling.filtered, pad_id=int(pad_id),
    )
    tokens = np.asarray(tokens)[:, : int(steps)]
    stops = set(int(t) for t in stop_tokens)
    out = []
    for row in tokens.tolist():
        end = next((i + 1 for i, t in enumerate(row) if t in stops), len(row))
        out.append(row[:end])
    return out
