"""The stacked KV cache: one (keys, values) pair of arrays per layer stack."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class KVCache:
    """Keys and values of every layer, stacked per layer stack, plus the position held in each entry.

    A model with one stack (Llama, Qwen3) has one pair; DeepSeek-V3 has two (dense layers, then
    MoE layers). `split()` hands each stack its own pair and `join()` puts updated pairs back, so
    no array is sliced or concatenated across stacks.

    Attributes:
        k: per stack, (num_layers, batch, max_len, kv_heads, key_dim). MLA stores its latent here.
        v: per stack, (num_layers, batch, max_len, kv_heads, value_dim). MLA stores the shared
            rotary key here.
        positions: (batch, max_len) int32, the token position held in each entry; -1 marks an
            empty entry (never written, or written by a padding token) that nothing attends to.
        index: int32 scalar, the next entry to write.
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    positions: jax.Array
    index: jax.Array

    @classmethod
    def init(cls, *, stack_layers: Sequence[int], batch: int, max_len: int, kv_heads: int, key_dim: int,
             value_dim: int | None = None, dtype=jnp.float32) -> KVCache:
        """Empty cache for stacks of `stack_layers` layers each (a stack of 0 layers holds nothing)."""
        value_dim = key_dim if value_dim is None else value_dim
        return cls(
            k=tuple(jnp.zeros((n, batch, max_len, kv_heads, key_dim), dtype) for n in stack_layers),
            v=tuple(jnp.zeros((n, batch, max_len, kv_heads, value_dim), dtype) for n in stack_layers),
            positions=jnp.full((batch, max_len), -1, jnp.int32),
            index=jnp.zeros((), jnp.int32),
        )

    @property
    def max_len(self) -> int:
        return self.positions.shape[1]

    def split(self) -> list[tuple[jax.Array, jax.Array]]:
        """The (k, v) pair of each stack, in stack order."""
        return list(zip(self.k, self.v, strict=True))

    def join(self, pairs: Sequence[tuple[jax.Array, jax.Array]], *, positions: jax.Array, index) -> KVCache:
        """A cache holding the updated `pairs` (one per stack, as `split` gave them)."""
        if len(pairs) != len(self.k):
            raise ValueError(f"KVCache.join: expected {len(self.k)} (k, v) pairs, found {len(pairs)}")
        return KVCache(k=tuple(k for k, _ in pairs), v=tuple(v for _, v in pairs), positions=positions, index=index)

    def bytes_per_token(self) -> int:
        """Cache bytes one token occupies across all layers and stacks."""
        total = 0
        for array in (*self.k, *self.v):
            total += array.shape[0] * array.shape[3] * array.shape[4] * array.dtype.itemsize
        return total


def write_tokens(stacked: jax.Array, new_LBT: jax.Array, index) -> jax.Array:
    """`stacked` (L, B, S, ...) with the new tokens' entries `new_LBT` (L, B, T, ...) in entries `index`..`index + T`.

    One `dynamic_update_slice` of the new tokens only: on a loop carry (the decode loop) or a
    donated buffer XLA updates the cache in place.
    """
    starts = [jnp.zeros((), jnp.int32)] * stacked.ndim
    starts[2] = jnp.asarray(index, jnp.int32)
    return jax.lax.dynamic_update_slice(stacked, new_LBT.astype(stacked.dtype), starts)
