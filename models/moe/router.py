"""DeepSeek-V3's router: sigmoid scores, group-limited top-k, and auxiliary-loss-free balancing."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from podtrain.models.config import MoEConfig


def route(x_BTD: jax.Array, router_DE: jax.Array, bias_E: jax.Array, moe: MoEConfig) -> tuple[jax.Array, jax.Array]:
    """Chooses `num_experts_per_tok` experts per token, in float32 (as HF does).

    Scores are sigmoid(x @ router). The choice adds the load-balancing bias and keeps only
    experts in the `topk_group` groups whose two best biased scores sum highest; the combine
    weights are the unbiased scores of the chosen experts, normalised if `norm_topk_prob`, times
    `routed_scaling_factor`.

    Returns:
        (weights_BTK float32, experts_BTK int32).
    """
    scores = jax.nn.sigmoid(x_BTD.astype(jnp.float32) @ router_DE.astype(jnp.float32))
    choice = scores + jax.lax.stop_gradient(bias_E.astype(jnp.float32))
    if moe.n_group > 1:
        grouped = choice.reshape(*choice.shape[:-1], moe.n_group, -1)
        group_scores = jax.lax.top_k(grouped, 2)[0].sum(-1)
        best_groups = jax.lax.top_k(group_scores, moe.topk_group)[1]
        in_best = jax.nn.one_hot(best_groups, moe.n_group, dtype=jnp.bool_).any(-2)
        choice = jnp.where(in_best[..., None], grouped, -jnp.inf).reshape(choice.shape)
    experts = jax.lax.top_k(choice, moe.num_experts_per_tok)[1]
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    if moe.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return weights * moe.routed_scaling_factor, experts.astype(jnp.int32)


def balance_router_bias(bias_LE: jax.Array, load_LE: jax.Array, rate: float) -> jax.Array:
    """DeepSeek-V3's auxiliary-loss-free balancing: raise the bias of under-loaded experts, lower
    that of over-loaded ones, by `rate` per step (sign of mean load minus load)."""
    error = load_LE.mean(-1, keepdims=True) - load_LE
    return bias_LE + rate * jnp.sign(error).astype(bias_LE.dtype)
