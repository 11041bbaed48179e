"""DeepSeek-V3 mixture of experts: sigmoid router with group-limited top-k, routed and shared experts."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from podtrain.models.config import ModelConfig, MoEConfig
from podtrain.models.layers import MLP, dtype_of, param, weight
from podtrain.models.lora import Adapter, LoRAConfig
from podtrain.sharding.experts import EXPERT_DOWN_NAMES, EXPERT_GATE_NAMES, ExpertAdapters, routed_experts


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


class MoE(nnx.Module):
    """Routed experts `(E, ...)` (sharded over the "experts" axis) plus always-on shared experts.

    Its call returns `(y, stats)`: `stats["expert_load"]` counts the tokens routed to each expert
    over the whole batch, `stats["dropped_tokens"]` the assignments over capacity. With the LoRA
    target "experts" each routed expert has an adapter on its fused gate and up projections
    (`w_gate_up_lora`, one `A` for both) and one on its down projection (`w_down_lora`).
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, lora: LoRAConfig | None = None):
        c, moe = config, config.moe
        pdt = dtype_of(c.param_dtype)
        self.config = moe
        self.dtype = dtype_of(c.dtype)
        init = nnx.initializers.normal(c.initializer_range)
        d, e, f = c.hidden_size, moe.num_experts, moe.moe_intermediate_size
        # The router stays float32 whatever the parameter dtype (HF keeps it so too).
        self.router = param(rngs, init, (d, e), ("embed", None), jnp.float32)
        self.router_bias = param(rngs, nnx.initializers.zeros, (e,), (None,), jnp.float32)
        self.w_gate = param(rngs, init, (e, d, f), EXPERT_GATE_NAMES, pdt)
        self.w_up = param(rngs, init, (e, d, f), EXPERT_GATE_NAMES, pdt)
        self.w_down = param(rngs, init, (e, f, d), EXPERT_DOWN_NAMES, pdt)
        if lora is not None and lora.wants("experts"):
            per_expert = dict(batch_shape=(e,), batch_names=("experts",), rngs=rngs)
            self.w_gate_up_lora = Adapter(lora, "experts", (d,), ("embed",), (2, f), (None, "mlp"), pdt,
                                          parts=("w_gate", "w_up"), **per_expert)
            self.w_down_lora = Adapter(lora, "experts", (f,), ("mlp",), (d,), ("embed",), pdt, **per_expert)
        else:
            self.w_gate_up_lora = self.w_down_lora = None
        shared = f * moe.num_shared_experts
        self.shared = MLP(c, rngs=rngs, intermediate_size=shared, lora=lora) if shared else None

    def __call__(self, x_BTD, *, dropout_key=None):
        """`dropout_key` drops the shared experts' adapter inputs in training (`lora.Adapter.dropped`)."""
        weights, experts = route(x_BTD, weight(self.router, jnp.float32), self.router_bias[...], self.config)
        w = [p[...].astype(self.dtype) for p in (self.w_gate, self.w_up, self.w_down)]
        y, load, dropped = routed_experts(x_BTD, experts, weights, *w, lora=self._adapters(),
                                          capacity_factor=self.config.capacity_factor,
                                          buffer_factor=self.config.buffer_factor)
        y = y.astype(x_BTD.dtype)
        if self.shared is not None:
            y = y + self.shared(x_BTD, dropout_key=dropout_key)
        return y, {"expert_load": load, "dropped_tokens": dropped}

    def _adapters(self) -> ExpertAdapters | None:
        """The experts' adapters in the compute dtype, the `B`s scaled."""
        if self.w_gate_up_lora is None:
            return None
        gate_up, down = self.w_gate_up_lora, self.w_down_lora
        scale = jnp.asarray(gate_up.scale, self.dtype)
        return ExpertAdapters(gate_up.a[...].astype(self.dtype), gate_up.b[...].astype(self.dtype) * scale,
                              down.a[...].astype(self.dtype), down.b[...].astype(self.dtype) * scale)


def balance_router_bias(bias_LE: jax.Array, load_LE: jax.Array, rate: float) -> jax.Array:
    """DeepSeek-V3's auxiliary-loss-free balancing: raise the bias of under-loaded experts, lower
    that of over-loaded ones, by `rate` per step (sign of mean load minus load)."""
    error = load_LE.mean(-1, keepdims=True) - load_LE
    return bias_LE + rate * jnp.sign(error).astype(bias_LE.dtype)
