"""DeepSeek-V3's mixture-of-experts block: the router, the routed experts and the shared experts."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from podtrain.models.config import ModelConfig
from podtrain.models.layers import MLP
from podtrain.models.linear import dtype_of, param, weight
from podtrain.models.moe.dispatch import routed_experts
from podtrain.models.moe.dropless import Kernels
from podtrain.models.moe.experts import EXPERT_DOWN_NAMES, EXPERT_GATE_NAMES, SwiGLUExperts
from podtrain.models.moe.router import route


class MoE(nnx.Module):
    """Routed experts `(E, ...)` (sharded over the "experts" axis) plus always-on shared experts.

    Its call returns `(y, stats)`: `stats["expert_load"]` counts the tokens routed to each expert
    over the whole batch, `stats["dropped_tokens"]` the assignments over capacity.
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        c, moe = config, config.moe
        pdt = dtype_of(c.param_dtype)
        self.config = moe
        # "auto" unresolved (a model made outside a run's build): the kernels that run anywhere.
        self.kernels = Kernels(grouped_matmul="ragged_dot" if moe.grouped_matmul == "auto" else moe.grouped_matmul,
                               exchange="all_to_all" if moe.exchange == "auto" else moe.exchange,
                               interpret=c.interpret_kernels)
        self.dtype = dtype_of(c.dtype)
        init = nnx.initializers.normal(c.initializer_range)
        d, e, f = c.hidden_size, moe.num_experts, moe.moe_intermediate_size
        # The router stays float32 whatever the parameter dtype (HF keeps it so too).
        self.router = param(rngs, init, (d, e), ("embed", None), jnp.float32)
        self.router_bias = param(rngs, nnx.initializers.zeros, (e,), (None,), jnp.float32)
        self.w_gate = param(rngs, init, (e, d, f), EXPERT_GATE_NAMES, pdt)
        self.w_up = param(rngs, init, (e, d, f), EXPERT_GATE_NAMES, pdt)
        self.w_down = param(rngs, init, (e, f, d), EXPERT_DOWN_NAMES, pdt)
        shared = f * moe.num_shared_experts
        self.shared = MLP(c, rngs=rngs, intermediate_size=shared) if shared else None

    def experts(self) -> SwiGLUExperts:
        """The routed experts' weights in the compute dtype."""
        return SwiGLUExperts(*(p[...].astype(self.dtype) for p in (self.w_gate, self.w_up, self.w_down)))

    def __call__(self, x_BTD, *, experts=None, adapter_B=None):
        """`experts` replaces the routed experts `experts()` gives (a feature made around them);
        `adapter_B` gives each batch row its adapter slot, for experts with slots."""
        weights, chosen = route(x_BTD, weight(self.router, jnp.float32), self.router_bias[...], self.config)
        y, load, dropped = routed_experts(x_BTD, chosen, weights, self.experts() if experts is None else experts,
                                          capacity_factor=self.config.capacity_factor,
                                          buffer_factor=self.config.buffer_factor, kernels=self.kernels,
                                          adapter_B=adapter_B)
        y = y.astype(x_BTD.dtype)
        if self.shared is not None:
            y = y + self.shared(x_BTD)
        return y, {"expert_load": load, "dropped_tokens": dropped}
