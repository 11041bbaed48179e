"""The stacked KV cache shared by all layers of a stack."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class KVCache:
    """Keys and values of every layer, stacked, plus the position held in each slot.

    Attributes:
        k: (num_layers, batch, max_len, kv_heads, head_dim).
        v: same shape as `k`.
        positions: (batch, max_len) int32, the token position held in each slot; -1 marks an
            empty slot (never written, or written by a padding token) that nothing attends to.
        index: int32 scalar, the next slot to write.
    """

    k: jax.Array
    v: jax.Array
    positions: jax.Array
    index: jax.Array

    @classmethod
    def init(cls, *, num_layers: int, batch: int, max_len: int, num_kv_heads: int, head_dim: int,
             dtype=jnp.float32) -> KVCache:
        shape = (num_layers, batch, max_len, num_kv_heads, head_dim)
        return cls(
            k=jnp.zeros(shape, dtype),
            v=jnp.zeros(shape, dtype),
            positions=jnp.full((batch, max_len), -1, jnp.int32),
            index=jnp.zeros((), jnp.int32),
        )

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    def bytes_per_token(self) -> int:
        """Cache bytes one token occupies across all layers (keys and values)."""
        per_slot = self.k.shape[0] * self.k.shape[3] * self.k.shape[4] * self.k.dtype.itemsize
        return 2 * per_slot
