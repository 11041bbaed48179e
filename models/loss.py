"""Causal language-model loss."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


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


def _weighted_sum(nll, weights):
    """sum(nll * weights), where an ignored position adds 0 even if its nll is NaN (an out-of-range
    target, which `take_along_axis` reads as NaN)."""
    return jnp.sum(jnp.where(weights != 0, nll * weights, 0.0))


def chunked_causal_lm_loss(
    h_BTD: jax.Array, head_DV: jax.Array, targets_BT: jax.Array, weights_BT: jax.Array | None = None, *,
    chunk: int,
):
    """`causal_lm_loss(h @ head, ...)` without materialising the (B, T, vocab) logits.

    A rematerialised scan over sequence chunks of `chunk` positions computes each chunk's logits,
    log-partition and target logit; the backward pass recomputes them chunk by chunk. The batch
    axis stays whole in every chunk, so its sharding is untouched. `head_DV` is cast to the dtype of
    `h_BTD` inside each chunk: give it in the param dtype (float32), so that the backward pass sums
    its gradient over the chunks in float32, not in a bfloat16 compute dtype (whose error grows
    with the number of chunks).

    Returns:
        (loss, num_tokens), as `causal_lm_loss`.
    """
    b, t, d = h_BTD.shape
    if t % chunk:
        raise ValueError(f"train.loss_chunk={chunk} must divide the sequence length {t}")
    weights_BT = jnp.ones((b, t), jnp.float32) if weights_BT is None else weights_BT.astype(jnp.float32)
    n = t // chunk
    h_NBCD = h_BTD.reshape(b, n, chunk, d).swapaxes(0, 1)
    targets_NBC = targets_BT.reshape(b, n, chunk).swapaxes(0, 1)
    weights_NBC = weights_BT.reshape(b, n, chunk).swapaxes(0, 1)

    @functools.partial(jax.checkpoint, prevent_cse=False)
    def one_chunk(total, xs):
        h, targets, weights = xs
        logits = (h @ head_DV.astype(h.dtype)).astype(jnp.float32)
        target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
        nll = jax.nn.logsumexp(logits, axis=-1) - target_logit
        return total + _weighted_sum(nll, weights), None

    total, _ = jax.lax.scan(one_chunk, jnp.zeros((), jnp.float32), (h_NBCD, targets_NBC, weights_NBC))
    num_tokens = jnp.sum(weights_BT)
    return total / jnp.maximum(num_tokens, 1.0), num_tokens
