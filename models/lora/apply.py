"""`apply_lora`: low-rank adapters applied to a built model, a pass over its projections and routed
experts; the way back (`merged`, `with_base`).

`apply_lora(model, lora)` wraps every weight a config targets (by its HF module name, as PEFT's
`target_modules` do) in an adapter module (`adapter.py`) holding the weight as `base`, with a
leading layer axis inside a stack, so the frozen matmul gets no gradient. `B` starts at zero (for
embeddings `A`, as PEFT does), so a new adapter leaves the model unchanged.

"experts" adapts DeepSeek-V3's routed experts as PEFT's `target_parameters` adapt transformers'
fused expert weights (`experts.py`). In a model with tied embeddings, "lm_head" adapts the output
projection alone (`LoRATiedHead`), as PEFT's adapter on such a model's `lm_head` does: the logits
are `h @ E^T + scale * (h @ A) @ B` and the embedding the input reads is unchanged.

With `slots=N`, every adapter holds N independent adapters along an adapter axis after the layer
axis (`A (layers, N, *in, rank)`, logical name "lora_adapters"; routed experts' after the expert
axis), all empty (zero) until a slot is initialised (`slots.init_slot`); each batch row then takes
its own slot's adapter (`rows.py`).
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from podtrain.models.config import ModelConfig
from podtrain.models.embedding import Embedding
from podtrain.models.linear import Linear
from podtrain.models.lora.adapter import (
    ADAPTER_DTYPE,
    AdaptedWeight,
    Adapter,
    LoRAEmbedding,
    LoRALinear,
    LoRAParam,
    LoRATiedHead,
    adapter_stream,
    initial_values,
)
from podtrain.models.lora.config import WEIGHT_TARGETS, LoRAConfig, check_slot_targets, check_targets
from podtrain.models.lora.experts import LoRAExperts
from podtrain.models.moe.block import MoE


def _stacked(variable: nnx.Variable) -> bool:
    names = variable.get_metadata().get("out_sharding") or ()
    return bool(names) and names[0] == "layers"


def rank_name(slots: int) -> str:
    """The logical name of an adapter's rank axis: with slots, "lora_slot_rank", which shards the
    slots' state over the batch axes its weight's axes leave free; else "lora_rank" (replicated)."""
    return "lora_slot_rank" if slots else "lora_rank"


def _wrap_linear(weight: Linear | Embedding, target: str, lora: LoRAConfig, key, stack: int | None, slots: int):
    names = tuple(weight.get_metadata().get("out_sharding") or (None,) * weight.ndim)
    lead = 1 if _stacked(weight) else 0
    embedding = isinstance(weight, Embedding)
    n_in = 1 if embedding else weight.n_in
    in_shape, out_shape = weight.shape[lead:lead + n_in], weight.shape[lead + n_in:]
    batch, batch_names = ((slots,), ("lora_adapters",)) if slots else ((), ())
    a, b = initial_values(key, in_shape, out_shape, weight.shape[0] if lead else 0, ADAPTER_DTYPE, lora.rank,
                          embedding=embedding, batch=batch, empty=bool(slots))
    lead_names, rank = (*names[:lead], *batch_names), rank_name(slots)
    in_names, out_names = names[lead:lead + n_in], names[lead + n_in:]
    args = (a, b, (*lead_names, *in_names, rank), (*lead_names, rank, *out_names))
    kwargs = dict(n_in=n_in, scale=lora.scale, target=target, rate=lora.dropout, stack=stack, slots=slots)
    return LoRAEmbedding(weight, *args, **kwargs) if embedding else LoRALinear(weight, *args, **kwargs)


def _wrap_tied_head(embed: Embedding, lora: LoRAConfig, key, slots: int) -> LoRATiedHead:
    (vocab, hidden), (vocab_name, hidden_name) = embed.shape, embed.axes() or (None, None)
    batch, batch_names = ((slots,), ("lora_adapters",)) if slots else ((), ())
    a, b = initial_values(key, (hidden,), (vocab,), 0, ADAPTER_DTYPE, lora.rank, embedding=False, batch=batch,
                          empty=bool(slots))
    rank = rank_name(slots)
    return LoRATiedHead(embed, a, b, (*batch_names, hidden_name, rank), (*batch_names, rank, vocab_name),
                        n_in=1, scale=lora.scale, target="lm_head", rate=lora.dropout, stack=None, slots=slots)


def _wrap_experts(moe: MoE, lora: LoRAConfig, stream, where: str, stack: int | None, slots: int) -> LoRAExperts:
    """Adapters on `moe`'s experts, each drawn from `stream` folded with its path (`adapters`' key)."""
    stacked = _stacked(moe.w_gate)
    *layers, experts, d, f = moe.w_gate.shape
    dtype = ADAPTER_DTYPE
    kwargs = dict(scale=lora.scale, target="experts", rate=0.0, stack=stack, slots=slots)
    batch, batch_names = ((experts, slots), ("experts", "lora_adapters")) if slots else ((experts,), ("experts",))
    lead, count = ("layers", *batch_names) if stacked else batch_names, layers[0] if stacked else 0

    def values(name, in_shape, out_shape):
        key = jax.random.fold_in(stream, zlib.crc32(f"{where}.{name}".encode()))
        return initial_values(key, in_shape, out_shape, count, dtype, lora.rank, embedding=False, batch=batch,
                              empty=bool(slots))

    gate_up = Adapter(*values("w_gate_up", (d,), (2, f)), (*lead, "embed", "lora_rank"),
                      (*lead, "lora_rank", None, "mlp"), n_in=1, **kwargs)
    down = Adapter(*values("w_down", (f,), (d,)), (*lead, "mlp", "lora_rank"), (*lead, "lora_rank", "embed"), n_in=1,
                   **kwargs)
    return LoRAExperts(moe, gate_up, down)


def apply_lora(model: nnx.Module, lora: LoRAConfig, seed: int = 0, *, slots: int = 0) -> nnx.Module:
    """`model` with adapters on the weights `lora` targets (changed in place and returned); a
    model without adapters when `lora.rank` is 0. Adapters draw from `seed`'s adapter stream folded
    with each weight's path, so a weight's adapters are the same whatever else is targeted. With
    `slots`, each adapter holds that many empty adapters of rank up to `lora.rank` (see `rows`)."""
    if not lora.rank:
        return model
    lora.validate()
    if isinstance(getattr(model, "config", None), ModelConfig):  # a whole model, not a block of one
        check_targets(lora, model.config)
        if slots:
            check_slot_targets(lora, model.config)
    stream = adapter_stream(seed)
    stacks = {id(stack): i for i, stack in enumerate(model.stacks())} if hasattr(model, "stacks") else {}
    for path, module in list(nnx.iter_modules(model)):
        stack = next((stacks[id(m)] for m in _ancestors(model, path) if id(m) in stacks), None)
        for name, value in list(vars(module).items()):
            where = ".".join(str(p) for p in (*path, name))
            key = jax.random.fold_in(stream, zlib.crc32(where.encode()))
            if isinstance(value, MoE) and lora.wants("experts"):
                setattr(module, name, _wrap_experts(value, lora, stream, where, stack, slots))
            elif isinstance(value, Linear | Embedding) and lora.wants(WEIGHT_TARGETS.get(name, "")):
                setattr(module, name, _wrap_linear(value, WEIGHT_TARGETS[name], lora, key, stack, slots))
    if getattr(model, "lm_head", 0) is None and lora.wants("lm_head"):  # tied to the embedding
        key = jax.random.fold_in(stream, zlib.crc32(b"lm_head"))
        model.lm_head = nnx.data(_wrap_tied_head(model.embed, lora, key, slots))  # was a static None
    if isinstance(model, MoE) and lora.wants("experts"):  # a MoE block alone
        return _wrap_experts(model, lora, stream, "", None, slots)
    return model


def _ancestors(model: nnx.Module, path: Sequence) -> list[nnx.Module]:
    """The modules on the way from `model` to the one at `path` (that one included)."""
    modules, node = [], model
    for part in path:
        node = getattr(node, part) if isinstance(part, str) else node[part]
        modules.append(node)
    return modules


def _plain_path(model: nnx.Module, path: Sequence) -> tuple:
    """`path` without its steps into adapters' `base`: the path in the model without adapters."""
    parts, node = [], model
    for part in path:
        if not (part == "base" and isinstance(node, Adapter | LoRAExperts)):
            parts.append(part)
        node = getattr(node, part) if isinstance(part, str) else node[part]
    return tuple(parts)


def with_base(model: nnx.Module, plain: nnx.State, keep=None) -> nnx.State:
    """The variables of `model` (a model with adapters, abstract or not) that `keep` matches
    (default: all but the adapters), each the value `plain` (a state of the same model without
    adapters) holds at its path there."""
    values = dict(nnx.to_flat_state(plain))
    kept = nnx.filterlib.to_predicate(nnx.Not(LoRAParam) if keep is None else keep)
    return nnx.from_flat_state([(path, var.replace(values[_plain_path(model, path)].get_value()))
                                for path, var in nnx.to_flat_state(nnx.state(model)) if kept(path, var)])


def adapters(model: nnx.Module):
    """(the adapted weight's path in the model without adapters, adapter) of every adapter; an
    experts adapter's path is its MoE block's followed by `w_gate_up` or `w_down`."""
    for path, module in nnx.iter_modules(model):
        key = ".".join(str(p) for p in _plain_path(model, path))
        if isinstance(module, AdaptedWeight):
            yield key, module
        elif isinstance(module, LoRAExperts):
            yield f"{key}.w_gate_up", module.gate_up
            yield f"{key}.w_down", module.down


def merged(model: nnx.Module) -> nnx.State:
    """The parameters of the same model without adapters, each adapter's update added to its
    weight (`W + scale * A @ B`, in the weights' dtype). `model` is not changed."""
    plain = nnx.clone(model)
    for _, module in list(nnx.iter_modules(plain)):
        for name, value in list(vars(module).items()):
            if isinstance(value, LoRATiedHead):
                raise ValueError("lora.targets: the LM head's adapter of a model with tied embeddings cannot be "
                                 "merged into it (its head is its embedding); keep the adapter apart (PEFT)")
            if isinstance(value, AdaptedWeight):
                setattr(module, name, value.base.replace(value.merged()))
            elif isinstance(value, LoRAExperts):
                moe, gate_up = value.base, value.gate_up.delta()  # (..., E, D, 2, F)
                for w, delta in ((moe.w_gate, gate_up[..., 0, :]), (moe.w_up, gate_up[..., 1, :]),
                                 (moe.w_down, value.down.delta())):
                    w.set_value((w[...].astype(jnp.float32) + delta).astype(w.dtype))
                setattr(module, name, moe)
    return nnx.state(plain)

