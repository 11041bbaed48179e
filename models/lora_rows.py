"""Which adapter slot each batch row takes (`rows`), for models built with adapter slots
(`lora.apply_lora(..., slots=N)`)."""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass

import jax


@dataclass(frozen=True)
class Rows:
    """Per batch row: its adapter slot `index` (B,) int32, that adapter's `scale` (B,) float32 and
    `rank` (B,) int32."""

    index: jax.Array
    scale: jax.Array
    rank: jax.Array


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
