"""DeepSeek-V3's routed experts with adapters (the "experts" target): one adapter per
expert on the fused gate and up projections and one on the down projection, applied inside the
expert dispatch beside each grouped matmul. With adapter slots, every expert holds one adapter per
slot and each row's tokens take their row's slot's (`SlotAdaptedExperts`)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from podtrain.models.lora.adapter import Adapter
from podtrain.models.lora.rows import current_rows
from podtrain.models.moe.block import MoE
from podtrain.models.moe.experts import SwiGLUExperts


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

    def adapters(self) -> int:
        return 1

    def names(self) -> AdaptedExperts:
        return AdaptedExperts(self.base.names(), ("experts", "embed", "lora_rank"),
                              ("experts", "lora_rank", None, "mlp"), ("experts", "mlp", "lora_rank"),
                              ("experts", "lora_rank", "embed"))

    def frozen(self) -> SwiGLUExperts:
        """The base experts, which get no gradient."""
        return jax.tree.map(jax.lax.stop_gradient, self.base)

    def adapter_matmul(self, matmul):
        """How rows meet the adapters' matrices: by their expert's."""
        return matmul

    def in_projections(self, rows, matmul):
        gate, up = self.frozen().in_projections(rows, matmul)
        low_rank, f = self.adapter_matmul(matmul), self.gate_up_b.shape[-1]
        update = low_rank(low_rank(rows, self.gate_up_a), self.gate_up_b.reshape(*self.gate_up_b.shape[:-2], 2 * f))
        return gate + update[..., :f], up + update[..., f:]

    def out_projection(self, hidden, matmul):
        low_rank = self.adapter_matmul(matmul)
        return self.frozen().out_projection(hidden, matmul) + low_rank(low_rank(hidden, self.down_a), self.down_b)

    def split(self):
        return self.base, (self.gate_up_a, self.gate_up_b, self.down_a, self.down_b)

    @classmethod
    def join(cls, frozen, trained):
        return cls(frozen, *trained)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SlotAdaptedExperts(AdaptedExperts):
    """`AdaptedExperts` with an adapter axis after the expert axis (`(E, S, ...)`): each row takes
    the adapter of its slot (`matmul.by_adapter`), `B`s scaled and masked above the slot's rank."""

    def adapters(self) -> int:
        return self.gate_up_a.shape[1]

    def names(self) -> SlotAdaptedExperts:
        return SlotAdaptedExperts(self.base.names(), ("experts", "lora_adapters", "embed", "lora_rank"),
                                  ("experts", "lora_adapters", "lora_rank", None, "mlp"),
                                  ("experts", "lora_adapters", "mlp", "lora_rank"),
                                  ("experts", "lora_adapters", "lora_rank", "embed"))

    def adapter_matmul(self, matmul):
        """By their expert's and their slot's."""
        return matmul.by_adapter


class LoRAExperts(nnx.Module):
    """A MoE block whose routed experts have adapters (`AdaptedExperts`), the base experts frozen."""

    def __init__(self, base: MoE, gate_up: Adapter, down: Adapter):
        self.base, self.gate_up, self.down = base, gate_up, down

    def __call__(self, x_BTD):
        dtype = self.base.dtype
        a_gate_up, b_gate_up, a_down, b_down = (m[...].astype(dtype) for m in (
            self.gate_up.lora_a, self.gate_up.lora_b, self.down.lora_a, self.down.lora_b))
        if not self.gate_up.slots:
            scale = jnp.asarray(self.gate_up.scale, dtype)
            experts = AdaptedExperts(self.base.experts(), a_gate_up, b_gate_up * scale, a_down, b_down * scale)
            return self.base(x_BTD, experts=experts)
        current = current_rows()
        keep = current.by_slot(self.gate_up.slots).mask(a_down.shape[-1], dtype)  # (S, r)
        experts = SlotAdaptedExperts(self.base.experts(), a_gate_up, b_gate_up * keep[None, :, :, None, None], a_down,
                                     b_down * keep[None, :, :, None])
        return self.base(x_BTD, experts=experts, adapter_B=current.index)
