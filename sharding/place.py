"""Placing NNX models on a mesh: shardings from logical names, and params born sharded."""

from __future__ import annotations

from collections.abc import Callable

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from sharding.rules import Rules, logical_to_spec


def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


def path_str(path) -> str:
    return ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def logical_names(state: nnx.State) -> dict[str, tuple]:
    """Maps each variable's dotted path to the logical axis names it was annotated with."""
    out = {}
    for path, var in nnx.to_flat_state(state):
        names = var.get_metadata().get("out_sharding") or (None,) * len(var.shape)
        out[".".join(str(k) for k in path)] = tuple(names)
    return out


def state_shardings(state: nnx.State, mesh: Mesh, rules: Rules | None = None) -> nnx.State:
    """A tree like `state` whose leaves are the NamedShardings its logical names ask for."""

    def one(path, var):
        names = var.get_metadata().get("out_sharding") or (None,) * len(var.shape)
        spec = logical_to_spec(names, dict(mesh.shape), shape=var.shape, rules=rules, what=path_str(path))
        return var.replace(NamedSharding(mesh, spec))

    return jax.tree.map_with_path(one, state, is_leaf=_is_var)


def abstract_model(factory: Callable[[], nnx.Module], mesh: Mesh, rules: Rules | None = None):
    """Shapes, dtypes and shardings of the model `factory` builds, without allocating anything.

    Returns:
        (graphdef, abstract_state): the state's leaves are `jax.ShapeDtypeStruct`s carrying
        concrete NamedShardings (what Orbax restores and `jit` lowering need).
    """
    with nnx.use_eager_sharding(False):
        model = nnx.eval_shape(factory)
    graphdef, state = nnx.split(model)
    shardings = state_shardings(state, mesh, rules)
    abstract = jax.tree.map(
        lambda v, s: v.replace(jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s.get_value())),
        state, shardings, is_leaf=_is_var,
    )
    return graphdef, abstract


def _sharded_init(factory: Callable[[], nnx.Module], mesh: Mesh, rules: Rules | None):
    graphdef, abstract = abstract_model(factory, mesh, rules)
    shardings = jax.tree.map(lambda v: v.replace(v.get_value().sharding), abstract, is_leaf=_is_var)

    def init():
        with nnx.use_eager_sharding(False):
            return nnx.state(factory())

    return graphdef, jax.jit(init, out_shardings=shardings)


def create_sharded(factory: Callable[[], nnx.Module], mesh: Mesh, rules: Rules | None = None) -> nnx.Module:
    """Builds the model inside one jitted init whose outputs are already sharded.

    No device ever holds more than its shard of a parameter: each random initialiser runs under
    `jit` with `out_shardings`, so XLA generates only the local piece.
    """
    graphdef, init = _sharded_init(factory, mesh, rules)
    with jax.set_mesh(mesh):
        state = init()
    return nnx.merge(graphdef, state)


def compiled_init(factory: Callable[[], nnx.Module], mesh: Mesh, rules: Rules | None = None):
    """The compiled sharded init (for `memory_analysis()`), without running it."""
    _, init = _sharded_init(factory, mesh, rules)
    with jax.set_mesh(mesh):
        return init.lower().compile()


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())
