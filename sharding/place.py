"""Placing NNX models on a mesh: shardings from logical names, and params born sharded."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from podtrain.sharding.rules import Rules, logical_to_spec


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


@dataclasses.dataclass
class _VariableInit:
    """How a group of unstacked variables is born sharded: one program that returns them."""

    paths: list
    vars: list
    init: Callable


@dataclasses.dataclass
class _StackInit:
    """How a group of stacked variables of one depth is born sharded: one program makes them all
    zeros, then one program, called once per layer with the layer index, writes layer i of each."""

    paths: list
    vars: list
    zeros: Callable
    write_layer: Callable
    num_layers: int


def _variable_inits(factory: Callable[[], nnx.Module], mesh: Mesh, rules: Rules | None, layer_slice, keep=None):
    """Programs that create every variable directly in its sharding, largest shards first.

    Each program builds the whole model but returns only its variables, so XLA drops every other
    initialiser. Stacked variables (leading logical axis "layers") are allocated as zeros and then
    written one layer at a time (`layer_slice(i)` makes the factory create layer i only, the
    buffers are donated), so the random-number scratch is that of one layer's shards (on CPU,
    JAX's rolled threefry loop needs about 3x what it generates). Variables share programs in
    groups no larger (per layer, for stacked ones of one depth) than the largest single one
    (`_groups`): far fewer programs to trace and compile, the same scratch bound.

    `keep` (an nnx filter) limits them to the variables it matches.

    Returns:
        (graphdef, [_VariableInit | _StackInit, ...])
    """
    graphdef, abstract = abstract_model(factory, mesh, rules)
    kept = None if keep is None else nnx.filterlib.to_predicate(keep)

    def build():
        with nnx.use_eager_sharding(False):
            return nnx.state(factory())

    inits, by_depth = [], {}
    by_size = sorted(nnx.to_flat_state(abstract), key=lambda item: -_shard_bytes(item[1].get_value()))
    for path, var in by_size:
        if kept is not None and not kept(path, var):
            continue
        value = var.get_value()
        names = var.get_metadata().get("out_sharding") or ()
        stacked = layer_slice is not None and names and names[0] == "layers"
        by_depth.setdefault(value.shape[0] if stacked else None, []).append((path, var))
    # Unstacked variables first: their programs' scratch is whole variables', so they run while the
    # least is held.
    by_depth = dict(sorted(by_depth.items(), key=lambda item: item[0] is not None))
    for num_layers, group in _groups(by_depth):
        paths, variables = [p for p, _ in group], [v for _, v in group]
        values = [v.get_value() for v in variables]
        shardings = tuple(v.sharding for v in values)
        if num_layers is None:
            def init(paths=paths):
                flat = dict(nnx.to_flat_state(build()))
                return tuple(flat[path].get_value() for path in paths)

            inits.append(_VariableInit(paths, variables, jax.jit(init, out_shardings=shardings)))
            continue

        def write_layer(buffers, index, paths=paths):
            with layer_slice(index):
                flat = dict(nnx.to_flat_state(build()))
            return tuple(jax.lax.dynamic_update_slice_in_dim(buffer, flat[path].get_value().astype(buffer.dtype),
                                                             index, axis=0)
                         for buffer, path in zip(buffers, paths, strict=True))

        inits.append(_StackInit(
            paths, variables,
            zeros=jax.jit(lambda values=values: tuple(jnp.zeros(v.shape, v.dtype) for v in values),
                          out_shardings=shardings),
            write_layer=jax.jit(write_layer, out_shardings=shardings, donate_argnums=0),
            num_layers=num_layers,
        ))
    return graphdef, inits


def _groups(by_depth: dict[int | None, list]) -> list[tuple[int | None, list]]:
    """(num_layers, [(path, var), ...]) groups of variables that share their programs (num_layers
    None: unstacked, made whole): per depth, packed largest first so that an unstacked group holds
    at most as many bytes per device as the largest unstacked variable, and one layer of a stacked
    group at most as many as one layer of the largest stacked variable (the scratch bounds of
    per-variable programs)."""
    sized = {n: [(path, var, _shard_bytes(var.get_value()) // (n or 1)) for path, var in items]
             for n, items in by_depth.items()}
    caps = {stacked: max((size for n, items in sized.items() if (n is not None) == stacked for *_, size in items),
                         default=0) for stacked in (False, True)}
    groups = []
    for num_layers, items in sized.items():
        cap = caps[num_layers is not None]
        bins: list[list] = []  # [one layer's bytes, members]
        for path, var, size in items:  # largest first: first fit
            target = next((b for b in bins if b[0] + size <= cap), None)
            if target is None:
                bins.append(target := [0, []])
            target[0] += size
            target[1].append((path, var))
        groups += [(num_layers, members) for _, members in bins]
    return groups


def create_sharded(factory: Callable[[], nnx.Module], mesh: Mesh, rules: Rules | None = None, *,
                   layer_slice=None) -> nnx.Module:
    """Builds the model with every parameter born sharded: no device holds more than its shards.

    Args:
        factory: builds the (unsharded) model; called only under tracing.
        layer_slice: optional context-manager factory `layer_slice(i)` under which the factory
            creates only layer i of its stacks (`models.runner.only_layer`); with it, stacked
            parameters are filled one layer at a time.
    """
    graphdef, state = _create(factory, mesh, rules, layer_slice, None)
    return nnx.merge(graphdef, state)


def create_sharded_state(factory: Callable[[], nnx.Module], mesh: Mesh, rules: Rules | None = None, *,
                         layer_slice=None, keep=None) -> nnx.State:
    """The variables of the model `keep` (an nnx filter) matches, born sharded as in
    `create_sharded`; the others are never made."""
    return _create(factory, mesh, rules, layer_slice, keep)[1]


def _create(factory, mesh, rules, layer_slice, keep) -> tuple[nnx.GraphDef, nnx.State]:
    graphdef, inits = _variable_inits(factory, mesh, rules, layer_slice, keep)
    flat = []
    with jax.set_mesh(mesh):
        for item in inits:
            if isinstance(item, _VariableInit):
                flat += [(path, var.replace(value))
                         for path, var, value in zip(item.paths, item.vars, item.init(), strict=True)]
                continue
            buffers = item.zeros()
            for index in range(item.num_layers):
                buffers = item.write_layer(buffers, jnp.int32(index))
            flat += [(path, var.replace(value))
                     for path, var, value in zip(item.paths, item.vars, buffers, strict=True)]
    return graphdef, nnx.from_flat_state(flat)


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
            if isinstance(item, _VariableInit):
                mem = item.init.lower().compile().memory_analysis()
                peak = max(peak, made + mem.output_size_in_bytes + mem.temp_size_in_bytes)
                made += mem.output_size_in_bytes
                continue
            made += item.zeros.lower().compile().memory_analysis().output_size_in_bytes
            values = tuple(v.get_value() for v in item.vars)
            mem = item.write_layer.lower(values, jnp.int32(0)).compile().memory_analysis()
            peak = max(peak, made + mem.output_size_in_bytes - mem.alias_size_in_bytes + mem.temp_size_in_bytes)
    return {"param_bytes": made, "peak_bytes": peak}
