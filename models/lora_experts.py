"""DeepSeek-V3's routed experts with adapters (`models.lora`'s "experts" target): one adapter per
expert on the fused gate and up projections and one on the down projection, applied inside the
expert dispatch beside each grouped matmul."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from flax import nnx

from podtrain.models.moe.block import MoE
from podtrain.models.moe.experts import SwiGLUExperts

if TYPE_CHECKING:
    from podtrain.models.lora import Adapter


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AdaptedExperts:
    """SwiGLU experts with an adapter on their fused gate and up projections (one `A` for both)
    and one on their down projection, `B`s scaled; only the adapters are trained."""

    base: SwiGLUExperts
    gate_up_a: jax.Array  # (E, D, r)
    gate_up_b: jax.Array  # (E, r, 2, F): gate's, then up's
    down_a: jax.Array  # (E, F, r)
    down_b: jax.Array  # (E, r, D)

    def weights(self) -> SwiGLUExperts:
        return self.base

    def names(self) -> AdaptedExperts:
        return AdaptedExperts(self.base.names(), ("experts", "embed", "lora_rank"),
                              ("experts", "lora_rank", None, "mlp"), ("experts", "mlp", "lora_rank"),
                              ("experts", "lora_rank", "embed"))

    def frozen(self) -> SwiGLUExperts:
        """The base experts, which get no gradient."""
        return jax.tree.map(jax.lax.stop_gradient, self.base)

    def in_projections(self, rows, matmul):
        gate, up = self.frozen().in_projections(rows, matmul)
        experts, rank, _, f = self.gate_up_b.shape
        update = matmul(matmul(rows, self.gate_up_a), self.gate_up_b.reshape(experts, rank, 2 * f))
        return gate + update[..., :f], up + update[..., f:]

    def out_projection(self, hidden, matmul):
        return self.frozen().out_projection(hidden, matmul) + matmul(matmul(hidden, self.down_a), self.down_b)

    def split(self):
        return self.base, (self.gate_up_a, self.gate_up_b, self.down_a, self.down_b)

    @staticmethod
    def join(frozen, trained):
        return AdaptedExperts(frozen, *trained)


class LoRAExperts(nnx.Module):
    """A MoE block whose routed experts have adapters (`AdaptedExperts`), the base experts frozen."""

    def __init__(self, base: MoE, gate_up: Adapter, down: Adapter):
        self.base, self.gate_up, self.down = base, gate_up, down

    def __call__(self, x_BTD):
        dtype = self.base.dtype
        scale = jnp.asarray(self.gate_up.scale, dtype)
        matrices = [m[...].astype(dtype) for m in (self.gate_up.lora_a, self.gate_up.lora_b, self.down.lora_a,
                                                   self.down.lora_b)]
        experts = AdaptedExperts(self.base.experts(), matrices[0], matrices[1] * scale, matrices[2],
                                 matrices[3] * scale)
        return self.base(x_BTD, experts=experts)
