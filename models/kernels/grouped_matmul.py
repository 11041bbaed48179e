"""Grouped matmuls: rows in group order, each group times its own weight matrix."""

from __future__ import annotations

import math

import jax

IMPLEMENTATIONS = ("auto", "megablox", "ragged_dot")


def resolve_grouped_matmul(name: str, platform: str) -> str:
    """The implementation `name` resolves to on devices of `platform`: megablox on TPU, XLA's
    `ragged_dot` elsewhere."""
    if name != "auto":
        return name
    return "megablox" if platform == "tpu" else "ragged_dot"


def grouped_matmul(rows, w_LKN, sizes, *, implementation: str = "ragged_dot", interpret: bool = False):
    """rows[i] @ w[group of i] with rows in group order, `sizes[l]` rows in group l (rows past
    them give zeros).

    "megablox" is the Pallas grouped matmul that ships with JAX (TPU; its weight gradient visits
    only the rows of each group, where XLA's ragged dot transposed costs every row times every
    group); "ragged_dot" is `jax.lax.ragged_dot` (any platform).
    """
    if implementation == "ragged_dot":
        return jax.lax.ragged_dot(rows, w_LKN, sizes)
    from jax.experimental.pallas.ops.tpu.megablox import ops

    tiling = (math.gcd(rows.shape[0], 128), 128, 128)
    return ops.gmm(rows, w_LKN.astype(rows.dtype), sizes, rows.dtype, tiling, interpret=interpret)
