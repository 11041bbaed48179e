"""LoRA adapters: a low-rank update `scale * A @ B` beside a frozen weight, stacked with its layers.

A weight `W (*in, *out)` that a config targets gets `A (*in, rank)` and `B (rank, *out)`, both
`LoRAParam`s (the only parameters a LoRA run trains), created with the layer, so inside a stack
they are `(num_layers, ...)` like the weight. `A` carries the weight's input logical axes and `B`
its output axes, so the sharding rules place them as they place the weight; the rank axis,
"lora_rank", is replicated. `B` starts at zero (for embeddings `A`, as PEFT does), so a new
adapter leaves the model unchanged. Adapters draw their initial values from their own stream,
so the base weights are the same with and without them.

Targets use the HF module names, as PEFT's `target_modules` do; "experts" adapts DeepSeek-V3's
routed experts as PEFT's `target_parameters` adapt transformers' fused expert weights: one adapter
per expert on `gate_up_proj` (gate and up share its `A`) and one on `down_proj`, sharded over the
expert axis with their experts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLA_TARGETS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
TARGETS = (*ATTENTION_TARGETS, *MLA_TARGETS, *MLP_TARGETS, "experts", "embed_tokens", "lm_head")
# The stream a layer's adapters draw from: its params key folded with this (the params stream
# itself draws exactly what it draws without adapters).
_STREAM = 0x10A


@dataclass(frozen=True)
class LoRAConfig:
    """`rank` 0 means no adapters. `alpha / rank` scales the update (PEFT's `lora_alpha`);
    `dropout` is the rate at which training drops an adapter's inputs (PEFT's `lora_dropout`);
    `targets` are HF module names (`TARGETS`); `base` is what a training run adapts (read by
    `orchestrator.load.load_base`), `init` a PEFT adapter its adapters start from."""

    rank: int = 0
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    base: str | None = None  # a run's base weights: an HF directory or podtrain checkpoint (None: train.seed's)
    init: str | None = None  # a PEFT adapter directory a run's adapters start from (None: new adapters)

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def wants(self, target: str) -> bool:
        return self.rank > 0 and target in self.targets

    def validate(self, prefix: str = "lora") -> None:
        if self.rank < 0:
            raise ValueError(f"{prefix}.rank: expected 0 (no adapters) or a positive integer, found {self.rank}")
        if not self.alpha > 0:
            raise ValueError(f"{prefix}.alpha: expected a number > 0, found {self.alpha}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"{prefix}.dropout: expected a rate in [0, 1), found {self.dropout}")
        undropped = [t for t in ("experts", "lm_head") if t in self.targets]
        if self.dropout and undropped:
            raise ValueError(f"{prefix}.dropout: expected 0 with the target(s) {undropped}, found {self.dropout} (the "
                             "experts' adapters, as PEFT's on fused expert weights, and the LM head's, which the loss "
                             "reads merged into the head, take no dropout); set lora.dropout=0 or leave them out")
        unknown = [t for t in self.targets if t not in TARGETS]
        if unknown:
            raise ValueError(f"{prefix}.targets: unknown module name(s) {unknown}; expected some of {list(TARGETS)}")
        if self.rank and not self.targets:
            raise ValueError(f"{prefix}.targets: expected at least one module name with {prefix}.rank > 0")


class LoRAParam(nnx.Param):
    """A LoRA adapter matrix: what a LoRA run trains and checkpoints."""


def layer_rngs(key: jax.Array) -> nnx.Rngs:
    """The Rngs of one stacked layer made from its params `key`: adapters get their own stream."""
    return nnx.Rngs(params=key, lora=jax.random.fold_in(key, _STREAM))


def model_rngs() -> nnx.Rngs:
    """The stream of the adapters outside the layer stacks (embeddings, LM head)."""
    return nnx.Rngs(lora=jax.random.key(_STREAM))


def _lora_param(value, names) -> LoRAParam:
    # Sharding comes from the logical names (`sharding/`), never eagerly at creation.
    return LoRAParam(nnx.with_partitioning(lambda *_: value, tuple(names), eager_sharding=False)(None))


class Adapter(nnx.Module):
    """`scale * (x @ A) @ B` for a weight of input shape `in_shape` and output shape `out_shape`
    (logical axes `in_names`, `out_names`); `rngs` must hold a "lora" stream.

    `batch_shape` (logical axes `batch_names`) leads independent adapters, one per expert.
    `parts` names the weights whose outputs the first output axis indexes (an adapter of fused
    weights); empty, the adapter `<w>_lora` adapts the weight `<w>` beside it.
    """

    def __init__(self, lora: LoRAConfig, target: str, in_shape: Sequence[int], in_names: Sequence[str | None],
                 out_shape: Sequence[int], out_names: Sequence[str | None], dtype, *, rngs: nnx.Rngs,
                 embedding: bool = False, batch_shape: Sequence[int] = (), batch_names: Sequence[str | None] = (),
                 parts: tuple[str, ...] = ()):
        key_a, key_b = jax.random.split(rngs.lora())
        self.n_in, self.scale, self.parts = len(in_shape), lora.scale, parts
        self.target, self.dropout = target, lora.dropout
        a_shape, b_shape = (*batch_shape, *in_shape, lora.rank), (*batch_shape, lora.rank, *out_shape)
        if embedding:  # PEFT's init: for embeddings A zero and B normal, else A kaiming-uniform and B zero
            a, b = jnp.zeros(a_shape, dtype), jax.random.normal(key_b, b_shape, dtype)
        else:
            bound = 1 / math.sqrt(math.prod(in_shape))
            a, b = jax.random.uniform(key_a, a_shape, dtype, -bound, bound), jnp.zeros(b_shape, dtype)
        self.a = _lora_param(a, (*batch_names, *in_names, "lora_rank"))
        self.b = _lora_param(b, (*batch_names, "lora_rank", *out_names))

    def dropped(self, x: jax.Array, key: jax.Array | None) -> jax.Array:
        """The adapter's input `x` in training: each entry zeroed at the `dropout` rate and the rest
        scaled up to keep the mean, as PEFT's `lora_dropout` does; the mask is drawn from `key` (a
        layer's dropout key) folded with the target, so each adapter of a layer draws its own. `x`
        itself without a key (evaluation, generation) or without dropout."""
        if key is None or not self.dropout:
            return x
        keep = jax.random.bernoulli(jax.random.fold_in(key, TARGETS.index(self.target)), 1 - self.dropout, x.shape)
        return jnp.where(keep, x / jnp.asarray(1 - self.dropout, x.dtype), jnp.zeros((), x.dtype))

    def delta(self) -> jax.Array:
        """`scale * A @ B`, shaped as the weight (leading stack and batch axes included), in float32."""
        a, b = self.a[...].astype(jnp.float32), self.b[...].astype(jnp.float32)
        lead = a.ndim - self.n_in - 1
        a = a.reshape(*a.shape[:lead], -1, a.shape[-1])
        update = jnp.einsum("...ir,...ro->...io", a, b.reshape(*b.shape[: lead + 1], -1))
        return (update * self.scale).reshape(*self.a.shape[:-1], *self.b.shape[lead + 1:])


def adapter(lora: LoRAConfig | None, target: str, w: nnx.Param, n_in: int, *, rngs: nnx.Rngs,
            embedding: bool = False) -> Adapter | None:
    """The adapter of the weight `w` (its first `n_in` axes the input) when `lora` targets it."""
    if lora is None or not lora.wants(target):
        return None
    names = tuple(w.get_metadata().get("out_sharding") or (None,) * w.ndim)
    return Adapter(lora, target, w.shape[:n_in], names[:n_in], w.shape[n_in:], names[n_in:], w.dtype, rngs=rngs,
                   embedding=embedding)


def merged(model: nnx.Module) -> nnx.State:
    """The model's base parameters with every adapter's update added (`W + scale * A @ B`, in the
    weights' dtype): the parameters of the same model without adapters. `model` is not changed."""
    model = nnx.clone(model)
    for _path, module in nnx.iter_modules(model):
        for name, value in list(vars(module).items()):
            if name.endswith("_lora") and isinstance(value, Adapter):
                delta = value.delta()
                if value.parts:  # the first output axis follows A's rank axis
                    weights, deltas = value.parts, jnp.moveaxis(delta, value.a.ndim - 1, 0)
                else:
                    weights, deltas = (name[: -len("_lora")],), delta[None]
                for weight, update in zip(weights, deltas, strict=True):
                    w = getattr(module, weight)
                    w.set_value((w[...].astype(jnp.float32) + update).astype(w.dtype))
    return nnx.state(model, nnx.All(nnx.Param, nnx.Not(LoRAParam)))
