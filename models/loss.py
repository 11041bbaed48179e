"""Causal language-model loss."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def causal_lm_loss(logits_BTV: jax.Array, targets_BT: jax.Array, weights_BT: jax.Array | None = None):
    """Mean next-token cross-entropy in float32 over the positions whose weight is non-zero.

    Args:
        logits_BTV: logits at each position (any float dtype; upcast to float32).
        targets_BT: the token each position should predict (already shifted by the caller).
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
    return jnp.sum(nll * weights) / jnp.maximum(num_tokens, 1.0), num_tokens
