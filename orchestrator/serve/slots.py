"""The engine's programs on one adapter slot, and a slot's saved form.

A new adapter, an unloaded one, a loaded one and a saved one each touch one slot of arrays that
hold every slot. Each is one jitted program with the slot index traced (and for a new adapter its
rank, targets and seed), so that adapters coming and going compile nothing after the first time.

A saved slot is a flat dict of host arrays named `adapter.<path>` (and `mu.<path>`, `nu.<path>`
with the optimizer), each without the adapter axis and cut to the adapter's rank.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec

from podtrain.models.lora import LoRAParam, init_slot
from podtrain.orchestrator.serve.programs import AdamState, at_slot, axes_tree


@functools.partial(jax.jit, static_argnames=("axes",), donate_argnums=(0, 1, 2))
def clear_slot(adapters: nnx.State, grads: nnx.State, state: AdamState, index, *, axes):
    """Slot `index` empty: zero adapters, gradient, moments and step count."""
    tree = axes_tree(adapters, axes)
    zero = lambda x, axis: x.at[at_slot(axis, index)].set(0)  # noqa: E731
    moments = lambda m: m.at[index].set(0)  # noqa: E731
    return (jax.tree.map(zero, adapters, tree), jax.tree.map(zero, grads, tree),
            AdamState(jax.tree.map(moments, state.mu), jax.tree.map(moments, state.nu), state.count.at[index].set(0)))


@functools.partial(jax.jit, static_argnames=("graphdef",), donate_argnums=(1,))
def new_slot(graphdef: nnx.GraphDef, adapters: nnx.State, rest: nnx.State, index, seed, rank,
             chosen: dict[str, jax.Array]) -> nnx.State:
    """The adapters with slot `index` a new adapter of `rank` on the targets `chosen` marks
    ({target: bool} over every target the slots hold), from `seed` (`models.lora_slots.init_slot`)."""
    model = nnx.merge(graphdef, adapters, rest)
    init_slot(model, index, rank, chosen, seed)
    return nnx.state(model, LoRAParam)


@functools.partial(jax.jit, static_argnames=("axes",), donate_argnums=(0, 1))
def write_slot(adapters: nnx.State, state: AdamState, index, values, moments, count, *, axes):
    """Slot `index` set to `values` (the adapters' leaves without their adapter axis) and, unless
    `moments` is None, its Adam moments `(mu, nu)` (shaped as `values`) and step `count`."""
    tree = axes_tree(adapters, axes)
    put = lambda x, v, axis: x.at[at_slot(axis, index)].set(v.astype(x.dtype))  # noqa: E731
    adapters = jax.tree.map(put, adapters, values, tree)
    if moments is not None:
        mu, nu = (jax.tree.map(lambda m, v, axis: m.at[index].set(v), old, new, tree)
                  for old, new in zip((state.mu, state.nu), moments, strict=True))
        state = AdamState(mu, nu, state.count.at[index].set(count))
    return adapters, state


@functools.partial(jax.jit, static_argnames=("axes", "optimizer"), out_shardings=PartitionSpec())
def read_slot(adapters: nnx.State, state: AdamState, index, *, axes, optimizer: bool):
    """Slot `index`'s adapters (and, with `optimizer`, its moments `(mu, nu)`), without the adapter
    axis, replicated so that every process can read them whole."""
    tree = axes_tree(adapters, axes)
    values = jax.tree.map(lambda x, axis: x[at_slot(axis, index)], adapters, tree)
    if not optimizer:
        return values, None
    return values, (jax.tree.map(lambda m: m[index], state.mu), jax.tree.map(lambda m: m[index], state.nu))


def flat_names(tree) -> list[str]:
    return [".".join(map(str, path)) for path, _ in nnx.to_flat_state(tree)]


def cut_rank(one: np.ndarray, name: str, axis: int, rank: int) -> np.ndarray:
    """One slot's array (adapter axis removed) cut to `rank`: A's last axis, B's axis after its lead."""
    if name.endswith("lora_a"):
        return np.ascontiguousarray(one[..., :rank])
    return np.ascontiguousarray(one[(slice(None),) * axis + (slice(0, rank),)])


def pad_rank(one: np.ndarray, name: str, axis: int, max_rank: int) -> np.ndarray:
    """`cut_rank` undone: zero ranks appended up to `max_rank`; ValueError if it holds more."""
    rank_axis = one.ndim - 1 if name.endswith("lora_a") else axis
    if one.shape[rank_axis] > max_rank:
        raise ValueError(f"rank: the saved adapter's rank {one.shape[rank_axis]} exceeds serve.max_rank ({max_rank})")
    pad = [(0, 0)] * one.ndim
    pad[rank_axis] = (0, max_rank - one.shape[rank_axis])
    return np.pad(one, pad)
