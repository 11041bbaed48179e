"""Context parallelism: one sequence split over the devices of the mesh axes the `seq` rule names.

Under a causal mask the last tokens attend to the most keys, so a plain split would give the last
device most of the work. The sequence is cut into 2 x shards chunks and device r holds chunks r and
2 x shards - 1 - r (one early, one late): every device attends about the same number of pairs.
`balance` puts a training batch in that order before the model runs; positions, segment ids,
targets and weights move with their tokens, so the loss, a sum over tokens, is unchanged.
Attention gathers every device's keys and values (`kernels.attention.context_sharded`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from podtrain.sharding.rules import sharded_over


def context_shards() -> tuple[tuple[str, ...], int]:
    """(mesh axes that split the sequence, their product) under the active mesh and rules; ((), 1)
    outside a mesh."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
        return (), 1
    return sharded_over(("seq",), dict(mesh.shape))


def chunk_order(shards: int) -> np.ndarray:
    """The chunks in the order the devices hold them: 0, 2s-1, 1, 2s-2, ..., s-1, s."""
    return np.asarray([c for r in range(shards) for c in (r, 2 * shards - 1 - r)], np.int32)


def balanced_order(length: int, shards: int) -> np.ndarray:
    """Each token's index in the natural order, listed in the balanced order (length divisible by
    2 x shards)."""
    chunk = length // (2 * shards)
    return (chunk_order(shards)[:, None] * chunk + np.arange(chunk)).reshape(-1).astype(np.int32)


def _reorder_chunks(x: jax.Array, order: np.ndarray, axis: int) -> jax.Array:
    """`x` with its `axis` cut into len(order) equal chunks, taken in `order`."""
    n = len(order)
    shape = x.shape
    chunks = x.reshape(*shape[:axis], n, shape[axis] // n, *shape[axis + 1:])
    return jnp.take(chunks, order, axis=axis).reshape(shape)


def to_balanced(x: jax.Array, shards: int, axis: int = 1) -> jax.Array:
    """`x` (natural order along `axis`) in the balanced order."""
    return x if shards == 1 else _reorder_chunks(x, chunk_order(shards), axis)


def to_natural(x: jax.Array, shards: int, axis: int = 1) -> jax.Array:
    """`x` (balanced order along `axis`, e.g. keys gathered from every device) in the natural order."""
    return x if shards == 1 else _reorder_chunks(x, np.argsort(chunk_order(shards)).astype(np.int32), axis)


def balance(batch: dict) -> dict:
    """A training batch of (B, T) arrays in the balanced order when the active mesh splits the
    sequence; unchanged otherwise. Positions (0..T-1 when the batch has none) move with the tokens,
    so attention, RoPE and packed documents see each token where it was."""
    _, shards = context_shards()
    if shards == 1:
        return batch
    b, t = batch["inputs"].shape
    if t % (2 * shards):
        raise ValueError(f"a sequence of {t} tokens cannot be split into 2 chunks on each of {shards} devices")
    if batch.get("positions") is None:
        batch = {**batch, "positions": jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))}
    return {key: None if x is None else to_balanced(x, shards) for key, x in batch.items()}
