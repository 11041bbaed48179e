"""The token embedding: a (vocab, hidden) table whose rows are looked up without gathering it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from podtrain.sharding.rules import axes_of, constrain, logical_to_spec


def embed_tokens(table_VD: jax.Array, ids_BT: jax.Array, dtype) -> jax.Array:
    """Rows `ids_BT` of the (vocab, hidden) table, in the compute `dtype`, sharded over the batch.

    The table is not gathered (that would move vocab x hidden per device and step): it stays sharded
    over its hidden dimension, each device takes from its shard the rows of all tokens of its group
    along those mesh axes, and one all-to-all hands every device its own tokens' whole rows. Pinning
    the rows to that layout after the cast keeps the all-to-all and its transpose in `dtype` (left to
    itself, XLA casts the cotangent to float32 before moving it) and the batch sharded over the other
    axes; the tp devices, which hold the same tokens, then need not sum the table's gradient. The
    gradient is summed in the table's dtype, as for a plain `take(table, ids).astype(dtype)`.
    """
    # Gathering rows from a vocab-sharded table would make XLA replicate it: unshard vocab first.
    table = constrain(table_VD, (None, "embed"))
    mesh = jax.sharding.get_abstract_mesh()
    hidden = None if mesh is None or mesh.empty else logical_to_spec(("embed",), dict(mesh.shape))[0]
    if hidden is not None:
        # Gather the ids only over the hidden dimension's mesh axes: the other batch axes keep theirs.
        batch_axes = [a for a in axes_of(logical_to_spec(("batch",), dict(mesh.shape))[0]) if a not in axes_of(hidden)]
        batch = tuple(batch_axes) or None
        ids_BT = jax.lax.with_sharding_constraint(ids_BT, PartitionSpec(batch, None))
    h = jnp.take(table, ids_BT, axis=0).astype(dtype)
    if hidden is not None:
        h = jax.lax.with_sharding_constraint(h, PartitionSpec(batch, None, hidden))
        h = _hidden_to_tokens(h, batch_axes, list(axes_of(hidden)), dict(mesh.shape))
    return constrain(h, ("batch", "seq", "act_embed"))


def _hidden_to_tokens(h_BTD: jax.Array, batch_axes: list[str], hidden_axes: list[str], sizes: dict) -> jax.Array:
    """Moves the hidden dimension's mesh axes to the token dimensions their rules give them (batch or
    sequence), one axis per all-to-all: XLA cannot move two at once (fsdp to the batch and cp to the
    sequence) without replicating the array."""
    to_batch = axes_of(logical_to_spec(("batch",), sizes)[0])
    to_seq = axes_of(logical_to_spec(("seq",), sizes)[0])
    seq_axes: list[str] = []
    entry = lambda axes: tuple(axes) or None  # noqa: E731
    for axis in list(hidden_axes):
        if axis in to_batch:
            batch_axes = sorted([*batch_axes, axis], key=to_batch.index)
        elif axis in to_seq:
            seq_axes = sorted([*seq_axes, axis], key=to_seq.index)
        else:
            continue
        hidden_axes.remove(axis)
        h_BTD = jax.lax.with_sharding_constraint(h_BTD, PartitionSpec(entry(batch_axes), entry(seq_axes),
                                                                      entry(hidden_axes)))
    return h_BTD


class Embedding(nnx.Param):
    """The (vocab, hidden) token table, logical axes ("vocab", "embed"); called on ids (B, T) it
    gives their rows in the compute `dtype` (`embed_tokens`)."""

    def __call__(self, ids_BT: jax.Array, dtype) -> jax.Array:
        return embed_tokens(self[...], ids_BT, dtype)

    def merged(self) -> jax.Array:
        """The table as stored (what a tied LM head reads)."""
        return self[...]

    def axes(self) -> tuple:
        """The table's logical axes."""
        return tuple(self.get_metadata().get("out_sharding") or ())


def embedding(rngs: nnx.Rngs, init, vocab: int, hidden: int, param_dtype) -> Embedding:
    """An `Embedding` of `vocab` rows of `hidden` values, created by `init` in `param_dtype`."""
    value = nnx.with_partitioning(init, ("vocab", "embed"), eager_sharding=False)(rngs.params(), (vocab, hidden),
                                                                                 param_dtype)
    return Embedding(value)
