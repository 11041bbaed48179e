"""Placing NNX models on a mesh: shardings from logical names, and params born sharded."""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding

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


def _shard_bytes(value: jax.ShapeDtypeStruct) -> int:
    shape = value.sharding.shard_shape(value.shape)
    return math.prod(shape) * value.dtype.itemsize


def _per_variable_inits(factory: Callable[[], nnx.Module], mesh: Mesh, rules: Rules | None):
    """One jitted init per variable, each with that variable's output sharding.

    Each program builds the whole model but returns one variable, so XLA drops every other
    initialiser: at any time a device holds the variables made so far plus the random-number
    scratch of one variable's shard (one program for all would keep many of those alive at once;
    on CPU, JAX's rolled threefry loop needs about 3x the shard in scratch). The largest shards
    come first, while the device holds the least.
    """
    graphdef, abstract = abstract_model(factory, mesh, rules)
    inits = []
    by_size = sorted(nnx.to_flat_state(abstract), key=lambda item: -_shard_bytes(item[1].get_value()))
    for path, var in by_size:

        def init(path=path):
            with nnx.use_eager_sharding(False):
                state = nnx.state(factory())
            return dict(nnx.to_flat_state(state))[path].get_value()

        inits.append((path, var, jax.jit(init, out_shardings=var.get_value().sharding)))
    return graphdef, inits


def create_sharded(factory: Callable[[], nnx.Module], mesh: Mesh, rules: Rules | None = None) -> nnx.Module:
    """Builds the model with every parameter born sharded: no device holds more than its shards."""
    graphdef, inits = _per_variable_inits(factory, mesh, rules)
    with jax.set_mesh(mesh):
        flat = [(path, var.replace(init())) for path, var, init in inits]
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def init_peak_bytes(factory: Callable[[], nnx.Module], mesh: Mesh, rules: Rules | None = None) -> dict:
    """Per-device bytes of the sharded init from the compiled programs' `memory_analysis()`.

    Returns:
        {"param_bytes": bytes of all variables, "peak_bytes": the most held at once (variables
        already made, plus the current program's output and scratch)}.
    """
    _, inits = _per_variable_inits(factory, mesh, rules)
    made = peak = 0
    with jax.set_mesh(mesh):
        for _, _, init in inits:
            mem = init.lower().compile().memory_analysis()
            peak = max(peak, made + mem.output_size_in_bytes + mem.temp_size_in_bytes)
            made += mem.output_size_in_bytes
    return {"param_bytes": made, "peak_bytes": peak}
