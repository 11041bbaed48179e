"""Shardings of what a train step carries besides the params (`place.state_shardings`): the
optimizer state's, which follow the params, and the batch's, whose rows go over the data axes."""

from __future__ import annotations

import jax
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from podtrain.sharding.rules import Rules, logical_to_spec


def replicated(mesh: Mesh) -> NamedSharding:
    """Every device holds the whole array (scalars, counters)."""
    return NamedSharding(mesh, PartitionSpec())


def optimizer_state_shardings(tx: optax.GradientTransformation, abstract_params: nnx.State,
                              shardings: nnx.State, mesh: Mesh) -> optax.OptState:
    """Shardings of `tx`'s state for params with `shardings`: moments shaped like their params follow
    them; factored statistics (Adafactor's row and column moments) and counters are replicated."""
    everywhere = replicated(mesh)
    return optax.tree_map_params(
        tx, lambda leaf, sharding, param: sharding if leaf.shape == param.shape else everywhere,
        jax.eval_shape(tx.init, abstract_params), shardings, abstract_params,
        transform_non_params=lambda _: everywhere,
        is_leaf=lambda x: isinstance(x, nnx.Variable),
    )


def batch_sharding(mesh: Mesh, rules: Rules, batch_size: int) -> NamedSharding:
    """The sharding of a (batch_size, seq) batch array: rows over the axes the rules give `batch`."""
    spec = logical_to_spec(("batch", None), dict(mesh.shape), shape=(batch_size, 1), rules=rules, what="batch")
    return NamedSharding(mesh, spec)
