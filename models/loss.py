"""Causal language-model loss."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from podtrain.models.kernels.attention import NEG_INF
from podtrain.models.linear import dense, gather_specs
from podtrain.sharding.rules import constrain

_HEAD_NAMES = ("embed", "vocab")


def causal_lm_loss(logits_BTV: jax.Array, targets_BT: jax.Array, weights_BT: jax.Array | None = None):
    """Mean next-token cross-entropy in float32 over the positions whose weight is non-zero.

    Args:
        logits_BTV: logits at each position (any float dtype; upcast to float32).
        targets_BT: the token each position should predict (already shifted by the caller); an
            ignored position may hold anything, e.g. transformers' -100.
        weights_BT: 1 where a position counts, 0 where it is ignored (padding, prompt, ...).

    Returns:
        (loss, num_tokens): the weighted mean loss and the number of counted positions.
    """
    logits = logits_BTV.astype(jnp.float32)
    log_z = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.take_along_axis(logits, targets_BT[..., None], axis=-1)[..., 0]
    nll = log_z - target_logit
    weights = jnp.ones_like(nll) if weights_BT is None else weights_BT.astype(jnp.float32)
    num_tokens = jnp.sum(weights)
    return _weighted_sum(nll, weights) / jnp.maximum(num_tokens, 1.0), num_tokens


def vocab_slices(tokens: int, loss_chunk: int) -> int:
    """How many vocabulary slices the head is applied in for `tokens` positions per row, each
    slice's logits as large as those of `loss_chunk` positions (0: one slice, the whole logits)."""
    return max(1, -(-tokens // loss_chunk)) if loss_chunk else 1


def chunked_causal_lm_loss(
    h_BTD: jax.Array, head_DV: jax.Array, targets_BT: jax.Array, weights_BT: jax.Array | None = None, *,
    chunk: int,
):
    """`causal_lm_loss(h @ head, ...)` without materialising the (B, T, vocab) logits: the weighted
    mean of `sliced_target_logprobs` with T / `chunk` vocabulary slices, so each slice's logits are
    as large as those of `chunk` positions over the whole vocabulary.

    `head_DV` is the head in its own sharding and dtype, logical axes ("embed", "vocab").

    Returns:
        (loss, num_tokens), as `causal_lm_loss`.
    """
    b, t, d = h_BTD.shape
    if t % chunk:
        raise ValueError(f"train.loss_chunk={chunk} must divide the sequence length {t}")
    weights_BT = jnp.ones((b, t), jnp.float32) if weights_BT is None else weights_BT.astype(jnp.float32)
    total = _weighted_sum(-sliced_target_logprobs(h_BTD, head_DV, targets_BT, slices=t // chunk), weights_BT)
    num_tokens = jnp.sum(weights_BT)
    return total / jnp.maximum(num_tokens, 1.0), num_tokens


def sliced_target_logprobs(h_BTD: jax.Array, head_DV: jax.Array, targets_BT: jax.Array, *, slices: int,
                           low_BTR: jax.Array | None = None, b_BRV: jax.Array | None = None) -> jax.Array:
    """log p(target) (B, T) in float32 of the logits `h @ head` (plus each row's low-rank term
    `low[b] @ B[b]`, an adapter on the head that each batch row picks), without materialising the
    (B, T, vocab) logits.

    The vocabulary is cut into n = `slices` slices (slice j: columns j, j + n, j + 2n, ...). A
    first pass over the slices keeps each token's running log-partition and its target logit; the
    backward pass recomputes one slice's logits at a time. A slice's gradient is complete after that
    one pass over all tokens, so with the head sharded over the batch axes (FSDP) each slice is
    gathered and its gradient reduce-scattered once, and nothing of the head's size is ever held
    whole. (Chunking the sequence instead sums the head's gradient over the chunks: reduced in every
    chunk, or a whole unreduced copy per device.) The head's gradient is computed only when the
    head is differentiated: a frozen head costs no backward matmul.

    Each slice of `head_DV` (and of `B`) is cast to the dtype of `h_BTD` for its matmuls.
    """
    extra = None if low_BTR is None else (low_BTR, b_BRV)
    return _sliced_logprobs(h_BTD, head_DV, targets_BT, extra, slices)


def _weighted_sum(nll, weights):
    """sum(nll * weights), where an ignored position adds 0 even if its nll is NaN (an out-of-range
    target, which `take_along_axis` reads as NaN)."""
    return jnp.sum(jnp.where(weights != 0, nll * weights, 0.0))


def _slices(head_DV, n):
    """(D, V/n, n) view of the head (zero columns appended up to a multiple of n): [..., j] is slice j."""
    d, v = head_DV.shape
    pad = -v % n
    if pad:
        head_DV = jnp.pad(head_DV, ((0, 0), (0, pad)))
    return head_DV.reshape(d, (v + pad) // n, n)


def _slice_logits(h_BTD, head_DSN, j, vocab):
    """Float32 logits (B, T, V/n) of slice j, the appended columns at -inf, and the slice's weight
    as its matmuls read it (compute dtype, gathered over the batch axes)."""
    n = head_DSN.shape[-1]
    w = jax.lax.dynamic_index_in_dim(head_DSN, j, axis=2, keepdims=False).astype(h_BTD.dtype)
    specs = gather_specs(_HEAD_NAMES, 2)
    if specs is not None:
        w = jax.lax.with_sharding_constraint(w, specs[0])
    logits = dense(h_BTD, w).astype(jnp.float32)
    if vocab % n:
        column = jnp.arange(head_DSN.shape[1]) * n + j
        logits = jnp.where(column < vocab, logits, NEG_INF)
    return logits, w


def _target_hits(targets_BT, j, n, width):
    """(B, T, V/n) one-hot of each token's target within slice j (all false when it is elsewhere)."""
    return (targets_BT % n == j)[..., None] & (jnp.arange(width) == (targets_BT // n)[..., None])


def _row_slice(b_BRV, n, j):
    """Slice j of each row's head update `B` (B, r, V/n), zero columns appended up to a multiple of n."""
    pad = -b_BRV.shape[-1] % n
    if pad:
        b_BRV = jnp.pad(b_BRV, ((0, 0), (0, 0), (0, pad)))
    rows, rank, v = b_BRV.shape
    return jax.lax.dynamic_index_in_dim(b_BRV.reshape(rows, rank, v // n, n), j, axis=3, keepdims=False)


def _logits_with_rows(h_BTD, head_DSN, extra, j, vocab):
    logits, w = _slice_logits(h_BTD, head_DSN, j, vocab)
    if extra is None:
        return logits, w, None
    low, b = extra
    b_j = _row_slice(b, head_DSN.shape[-1], j).astype(h_BTD.dtype)
    return logits + jnp.einsum("btr,brv->btv", low.astype(h_BTD.dtype), b_j).astype(jnp.float32), w, b_j


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _sliced_logprobs(h_BTD, head_DV, targets_BT, extra, n):
    """log p(target) of h @ head (+ the rows' low-rank terms `extra`), a vocabulary slice at a time."""
    return _sliced_forward(h_BTD, head_DV, targets_BT, extra, n)[0]


def _sliced_forward(h_BTD, head_DV, targets_BT, extra, n):
    """(log p(target), log-partition): one pass over the slices with a running max and sum."""
    head = _slices(head_DV, n)
    b, t, _ = h_BTD.shape

    def one_slice(carry, j):
        row_max, row_sum, target_logit = carry
        logits, _, _ = _logits_with_rows(h_BTD, head, extra, j, head_DV.shape[1])
        new_max = jnp.maximum(row_max, jnp.max(logits, axis=-1))
        row_sum = row_sum * jnp.exp(row_max - new_max) + jnp.sum(jnp.exp(logits - new_max[..., None]), axis=-1)
        hits = _target_hits(targets_BT, j, n, logits.shape[-1])
        return (new_max, row_sum, target_logit + jnp.sum(jnp.where(hits, logits, 0.0), axis=-1)), None

    init = (jnp.full((b, t), NEG_INF, jnp.float32), jnp.zeros((b, t), jnp.float32), jnp.zeros((b, t), jnp.float32))
    (row_max, row_sum, target_logit), _ = jax.lax.scan(one_slice, init, jnp.arange(n))
    log_z = row_max + jnp.log(row_sum)
    return target_logit - log_z, log_z


def _sliced_fwd(h_BTD, head_DV, targets_BT, extra, n):
    # `symbolic_zeros`: each differentiable argument comes as a CustomVJPPrimal that says whether it
    # is differentiated. Whether the head is rides in the residuals' structure (() or None), which
    # the backward pass reads while tracing.
    h, head, targets = h_BTD.value, head_DV.value, targets_BT.value
    extra_values = None if extra is None else tuple(x.value for x in extra)
    lp, log_z = _sliced_forward(h, head, targets, extra_values, n)
    return lp, (h, head, targets, extra_values, log_z, () if head_DV.perturbed else None)


def _sliced_bwd(n, residuals, d_lp):
    h_BTD, head_DV, targets_BT, extra, log_z, head_grad = residuals
    if isinstance(d_lp, SymbolicZero):  # the log-probabilities were not used
        d_lp = jnp.zeros(log_z.shape, jnp.float32)
    head = _slices(head_DV, n)
    coef = d_lp.astype(jnp.float32)[..., None]
    h_2d = h_BTD.reshape(-1, h_BTD.shape[-1])

    def one_slice(carry, j):
        d_h, d_low = carry
        logits, w, b_j = _logits_with_rows(h_BTD, head, extra, j, head_DV.shape[1])
        hits = _target_hits(targets_BT, j, n, logits.shape[-1])
        d_logits = ((hits - jnp.exp(logits - log_z[..., None])) * coef).astype(h_BTD.dtype)
        d_h = d_h + jnp.einsum("btv,dv->btd", d_logits, w, preferred_element_type=jnp.float32)
        per_slice = {}
        if head_grad is not None:
            per_slice["head"] = constrain(h_2d.T @ d_logits.reshape(-1, d_logits.shape[-1]), _HEAD_NAMES)
        if extra is not None:
            d_low = d_low + jnp.einsum("btv,brv->btr", d_logits, b_j, preferred_element_type=jnp.float32)
            per_slice["b"] = jnp.einsum("btr,btv->brv", extra[0].astype(h_BTD.dtype), d_logits,
                                        preferred_element_type=jnp.float32)
        return (d_h, d_low), per_slice

    d_low0 = None if extra is None else jnp.zeros(extra[0].shape, jnp.float32)
    (d_h, d_low), per_slice = jax.lax.scan(one_slice, (jnp.zeros(h_BTD.shape, jnp.float32), d_low0), jnp.arange(n))
    d_head = None
    if head_grad is not None:
        d, v = head_DV.shape
        d_head = per_slice["head"].transpose(1, 2, 0).reshape(d, -1)[:, :v].astype(head_DV.dtype)
    d_extra = None
    if extra is not None:
        low, b = extra
        rows, rank, v = b.shape
        d_b = per_slice["b"].transpose(1, 2, 3, 0).reshape(rows, rank, -1)[..., :v]
        d_extra = (d_low.astype(low.dtype), d_b.astype(b.dtype))
    return d_h.astype(h_BTD.dtype), d_head, None, d_extra


_sliced_logprobs.defvjp(_sliced_fwd, _sliced_bwd, symbolic_zeros=True)
