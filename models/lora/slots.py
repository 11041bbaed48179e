"""Adapter slots one at a time: a new adapter put into a slot of a model built with
`apply_lora(..., slots=N)`, one slot's adapter copied out as a plain adapter (what PEFT export and
single-adapter references read), and one put back."""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from podtrain.models.lora.adapter import AdaptedWeight, Adapter, LoRAEmbedding, adapter_stream, initial_values
from podtrain.models.lora.apply import adapters
from podtrain.models.lora.experts import LoRAExperts


def _slot_adapters(model: nnx.Module):
    """(path key, adapter) of every adapter with slots (`adapters`)."""
    for key, adapter in adapters(model):
        if adapter.slots:
            yield key, adapter


def init_slot(model: nnx.Module, slot, rank, targets: Sequence[str] | Mapping[str, object], seed) -> None:
    """Sets slot `slot` of `model`'s adapters (changed in place) to a new adapter of rank `rank` on
    `targets`, initialised as PEFT does (A kaiming-uniform, B zero; for embeddings A zero, B
    normal) from `seed`, and to zero on the other targets and ranks (which then get no gradient).

    The values are a new adapter's at the slots' maximum rank, cut to `rank`: every rank is drawn
    alike, so this is PEFT's init at `rank`. `slot`, `rank`, `seed` and, given as a mapping of
    target names to booleans, the choice of targets may be traced, so that one compiled program
    makes any new adapter."""
    chosen = dict(targets) if isinstance(targets, Mapping) else {target: True for target in targets}
    stream = adapter_stream(seed)
    for key, adapter in _slot_adapters(model):
        axis, a_all = adapter.slot_axis(), adapter.lora_a[...]
        max_rank = a_all.shape[-1]
        if isinstance(rank, int | np.integer) and not 0 < rank <= max_rank:
            raise ValueError(f"rank: expected 1 to {max_rank}, found {rank}")
        in_shape = a_all.shape[axis + 1:-1]
        out_shape = adapter.lora_b.shape[axis + 2:]
        layers = 1 if adapter.lora_a.get_metadata()["out_sharding"][0] == "layers" else 0
        a, b = initial_values(jax.random.fold_in(stream, zlib.crc32(key.encode())), in_shape, out_shape,
                              a_all.shape[0] if layers else 0, a_all.dtype, max_rank,
                              embedding=isinstance(adapter, LoRAEmbedding), batch=a_all.shape[layers:axis])
        keep = (jnp.arange(max_rank) < rank) & jnp.asarray(chosen.get(adapter.target, False))
        a = jnp.where(keep, a, 0)
        b = jnp.where(keep.reshape([1] * axis + [max_rank] + [1] * (b.ndim - axis - 1)), b, 0)
        set_slot_arrays(adapter, slot, a, b)


def _padded_rank(a: jax.Array, b: jax.Array, lead: int, max_rank: int) -> tuple[jax.Array, jax.Array]:
    """`A (*lead, *in, r)` and `B (*lead, r, *out)` with zero ranks appended up to `max_rank`."""
    extra = max_rank - a.shape[-1]
    return (jnp.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, extra)]),
            jnp.pad(b, [(0, 0)] * lead + [(0, extra)] + [(0, 0)] * (b.ndim - lead - 1)))


def set_slot_arrays(adapter: Adapter, slot: int, a: jax.Array, b: jax.Array) -> None:
    """Sets slot `slot` of `adapter` to `(A, B)` (shaped without the adapter axis, ranks up to the
    built one), each array keeping its sharding (when not traced)."""
    axis = adapter.slot_axis()
    for param, value in ((adapter.lora_a, a), (adapter.lora_b, b)):
        whole = param[...]
        index = (slice(None),) * axis + (slot,)
        updated = whole.at[index].set(value.astype(whole.dtype))
        if not isinstance(whole, jax.core.Tracer):
            updated = jax.device_put(updated, whole.sharding)
        param.set_value(updated)


def _one_slot(adapter: Adapter, slot: int, rank: int, alpha: float) -> tuple[tuple, dict]:
    """The constructor arguments of slot `slot`'s adapter alone, cut to `rank`."""
    axis = adapter.slot_axis()
    keep = (slice(None),) * axis
    a = adapter.lora_a[...][(*keep, slot)][..., :rank]
    b = adapter.lora_b[...][(*keep, slot, slice(0, rank))]
    plain = {"lora_slot_rank": "lora_rank"}
    names_a = tuple(plain.get(n, n) for n in adapter.lora_a.get_metadata()["out_sharding"] if n != "lora_adapters")
    names_b = tuple(plain.get(n, n) for n in adapter.lora_b.get_metadata()["out_sharding"] if n != "lora_adapters")
    return (a, b, names_a, names_b), dict(n_in=adapter.n_in, scale=alpha / rank, target=adapter.target,
                                          rate=adapter.rate, stack=adapter.stack)


def slot_view(model: nnx.Module, slot: int, rank: int, alpha: float, targets: Sequence[str]) -> nnx.Module:
    """A copy of `model` whose adapters are slot `slot`'s alone, as `apply_lora` would make an
    adapter of rank `rank` and `alpha` on `targets` (what PEFT export and single-adapter runs read);
    `model` is not changed."""
    view = nnx.clone(model)
    for _, module in list(nnx.iter_modules(view)):
        for name, value in list(vars(module).items()):
            if isinstance(value, LoRAExperts) and value.gate_up.slots:
                if "experts" not in targets:
                    setattr(module, name, value.base)
                    continue
                gate_up, down = (Adapter(*args, **kwargs) for args, kwargs in (
                    _one_slot(value.gate_up, slot, rank, alpha), _one_slot(value.down, slot, rank, alpha)))
                setattr(module, name, LoRAExperts(value.base, gate_up, down))
            elif isinstance(value, AdaptedWeight) and value.slots:
                if value.target not in targets:
                    setattr(module, name, value.base)
                    continue
                args, kwargs = _one_slot(value, slot, rank, alpha)
                setattr(module, name, type(value)(value.base, *args, **kwargs))
    return view


def set_slot(model: nnx.Module, slot: int, single: nnx.Module) -> None:
    """Sets slot `slot` of `model`'s adapters (in place) to the adapters of `single`, the same model
    with one adapter of rank up to the slots' (`slot_view`'s shape); targets `single` lacks are zeroed."""
    given = dict(adapters(single))
    for key, adapter in _slot_adapters(model):
        axis = adapter.slot_axis()
        a_shape = adapter.lora_a.shape[:axis] + adapter.lora_a.shape[axis + 1:]
        b_shape = adapter.lora_b.shape[:axis] + adapter.lora_b.shape[axis + 1:]
        if key not in given:
            set_slot_arrays(adapter, slot, jnp.zeros(a_shape), jnp.zeros(b_shape))
            continue
        a, b = given[key].lora_a[...], given[key].lora_b[...]
        rank, max_rank = a.shape[-1], a_shape[-1]
        if rank > max_rank:
            raise ValueError(f"rank: expected at most {max_rank} (the service's maximum), found {rank}")
        set_slot_arrays(adapter, slot, *_padded_rank(a, b, axis, max_rank))
