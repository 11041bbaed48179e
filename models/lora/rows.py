"""How each batch row reaches its adapter in a model built with adapter slots
(`apply_lora(..., slots=N)`): the one place this is decided.

A model with slots holds N adapters in every adapted weight, along an adapter axis. The caller
runs the model inside `rows(index, scale, rank)`, which gives batch row b the adapter in slot
`index[b]`, scaled by `scale[b]`, its ranks from `rank[b]` on masked (`Rows.mask`), so adapters
of any rank up to the built one share a batch. The choice travels as a context, not as an argument
of the model's forward, so the forward keeps one signature with or without adapters; every adapter
module reads it with `current_rows()`, and a model with slots called outside `rows(...)` is an
error that says so.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass

import jax
import jax.numpy as jnp


@dataclass(frozen=True)
class Rows:
    """Per batch row: its adapter slot `index` (B,) int32, that adapter's `scale` (B,) float32 and
    `rank` (B,) int32."""

    index: jax.Array
    scale: jax.Array
    rank: jax.Array

    def mask(self, max_rank: int, dtype) -> jax.Array:
        """(B, max_rank) in `dtype`: each row's scale on its ranks, zero above them."""
        return ((jnp.arange(max_rank) < self.rank[:, None]) * self.scale[:, None]).astype(dtype)

    def by_slot(self, slots: int) -> Rows:
        """The same choice seen from the `slots` slots: slot s's scale and rank as its rows give
        them (a slot no row takes, or only padding rows of scale 0, gets scale 0)."""
        scale = jnp.zeros((slots,), jnp.float32).at[self.index].max(self.scale)
        rank = jnp.zeros((slots,), jnp.int32).at[self.index].max(self.rank)
        return Rows(jnp.arange(slots, dtype=jnp.int32), scale, rank)


_ROWS: contextvars.ContextVar[Rows | None] = contextvars.ContextVar("podtrain_lora_rows", default=None)


@contextlib.contextmanager
def rows(index: jax.Array, scale: jax.Array, rank: jax.Array):
    """Inside the block, a model with adapter slots gives batch row b the adapter in slot
    `index[b]`, scaled by `scale[b]`, its ranks from `rank[b]` on masked."""
    token = _ROWS.set(Rows(index, scale, rank))
    try:
        yield
    finally:
        _ROWS.reset(token)


def current_rows() -> Rows:
    current = _ROWS.get()
    if current is None:
        raise ValueError("a model with adapter slots runs inside lora.rows(index, scale, rank), which gives each "
                         "batch row its adapter")
    return current
