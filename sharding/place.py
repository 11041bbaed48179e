"""Placing NNX models on a mesh: shardings from logical names, and params born sharded."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from sharding.rules import Rules, logical_to_spec


def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


def path_str(path) -> str:
    return ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


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


def _pick(state: nnx.State, path) -> jax.Array:
    return dict(nnx.to_flat_state(state))[path].get_value()


@dataclasses.dataclass
class _VariableInit:
    """How one variable is born sharded: one program, or zeros then one program per layer."""

    path: tuple
    var: nnx.Variable
    init: Callable | None = None
    zeros: Callable | None = None
    write_layer: Callable | None = None
    num_layers: int = 0


def _variable_inits(factory: Callable[[], nnx.Module], mesh: Mesh, rules: Rules | None, layer_slice):
    """Programs that create each variable directly in its sharding, largest shards first.

    Each program builds the whole model but returns one variable, so XLA drops every other
    initialiser. A stacked variable (leading logical axis "layers") is allocated as zeros and then
    written one layer per call (`layer_slice(i)` makes the factory create layer i only, the buffer
    is donated), so the random-number scratch is that of one layer's shard (on CPU, JAX's rolled
    threefry loop needs about 3x what it generates).
    """
    graphdef, abstract = abstract_model(factory, mesh, rules)

    def build():
        with nnx.use_eager_sharding(False):
            return nnx.state(factory())

    inits = []
    by_size = sorted(nnx.to_flat_state(abstract), key=lambda item: -_shard_bytes(item[1].get_value()))
    for path, var in by_size:
        value = var.get_value()
        names = var.get_metadata().get("out_sharding") or ()
        if layer_slice is None or not names or names[0] != "layers":
            program = jax.jit(lambda path=path: _pick(build(), path), out_shardings=value.sharding)
            inits.append(_VariableInit(path, var, init=program))
            continue

        def write_layer(buffer, index, path=path):
            with layer_slice(index):
                one = _pick(build(), path)
            return jax.lax.dynamic_update_slice_in_dim(buffer, one.astype(buffer.dtype), index, axis=0)

        inits.append(_VariableInit(
            path, var,
            zeros=jax.jit(lambda v=value: jnp.zeros(v.shape, v.dtype), out_shardings=value.sharding),
            write_layer=jax.jit(write_layer, out_shardings=value.sharding, donate_argnums=0),
            num_layers=value.shape[0],
        ))
    return graphdef, inits


def create_sharded(factory: Callable[[], nnx.Module], mesh: Mesh, rules: Rules | None = None, *,
                   layer_slice=None) -> nnx.Module:
    """Builds the model with every parameter born sharded: no device holds more than its shards.

    Args:
        factory: builds the (unsharded) model; called only under tracing.
        layer_slice: optional context-manager factory `layer_slice(i)` under which the factory
            creates only layer i of its stacks (`models.runner.only_layer`); with it, stacked
            parameters are filled one layer at a time.
    """
    graphdef, inits = _variable_inits(factory, mesh, rules, layer_slice)
    flat = []
    with jax.set_mesh(mesh):
        for item in inits:
            if item.init is not None:
                value = item.init()
            else:
                value = item.zeros()
                for index in range(item.num_layers):
                    value = item.write_layer(value, jnp.int32(index))
            flat.append((item.path, item.var.replace(value)))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def init_peak_bytes(factory: Callable[[], nnx.Module], mesh: Mesh, rules: Rules | None = None, *,
                    layer_slice=None) -> dict:
    """Per-device bytes of `create_sharded`, from the compiled programs' `memory_analysis()`.

    Returns:
        {"param_bytes": bytes of all variables, "peak_bytes": the most held at once (variables
        already made, plus the running program's new output and scratch)}.
    """
    _, inits = _variable_inits(factory, mesh, rules, layer_slice)
    made = peak = 0
    with jax.set_mesh(mesh):
        for item in inits:
            if item.init is not None:
                mem = item.init.lower().compile().memory_analysis()
                peak = max(peak, made + mem.output_size_in_bytes + mem.temp_size_in_bytes)
                made += mem.output_size_in_bytes
                continue
            made += item.zeros.lower().compile().memory_analysis().output_size_in_bytes
            mem = item.write_layer.lower(item.var.get_value(), jnp.int32(0)).compile().memory_analysis()
            peak = max(peak, made + mem.output_size_in_bytes - mem.alias_size_in_bytes + mem.temp_size_in_bytes)
    return {"param_bytes": made, "peak_bytes": peak}
