"""The one table that turns logical axis names into mesh axes.

Models name logical axes only ("embed", "heads", ...). A rule maps each name to a mesh axis, a
list of mesh axes, or None (replicated). The active table lives in a context variable so that
activation constraints inside a model follow the same rules as its parameters.
"""

from __future__ import annotations

import contextlib
import contextvars
import difflib
from collections.abc import Mapping, Sequence

import jax
from jax.sharding import PartitionSpec

MESH_AXES = ("dp", "fsdp", "ep", "cp", "tp")

DEFAULT_RULES: dict[str, str | list[str] | None] = {
    # parameters
    "layers": None,
    "vocab": "tp",
    # Parameters are sharded over the context axis too: its devices hold different tokens of the
    # same rows, so they gather weights as FSDP's devices do.
    "embed": ["fsdp", "cp"],
    "heads": "tp",
    "kv_heads": "tp",
    "head_dim": None,
    "mlp": "tp",
    "experts": "ep",
    # DeepSeek-V3 up-projections (L, rank, heads, dim): among its largest arrays if replicated
    "q_lora": ["fsdp", "cp"],
    "kv_lora": ["fsdp", "cp"],
    "norm": None,
    "lora_rank": None,  # LoRA adapters: A (..., rank), B (rank, ...)
    "lora_adapters": None,  # the adapter axis of adapter slots, A (layers, adapters, ..., rank)
    # The rank axis of adapter slots: their state sharded over the batch axes the weight's own axes
    # leave free, as ZeRO shards an optimizer's (the serve engine keeps the axes that divide its rank).
    "lora_slot_rank": ["dp", "fsdp", "ep"],
    # activations
    "batch": ["dp", "fsdp", "ep"],
    "seq": "cp",  # context parallelism: one sequence split over devices (`models.context`)
    "act_embed": None,
    "act_heads": "tp",
    "act_vocab": "tp",
}

# Every logical axis name the models use: a rule for any other name would never apply, so it is a typo.
LOGICAL_AXES = tuple(DEFAULT_RULES)

Rules = Mapping[str, "str | Sequence[str] | None"]

_ACTIVE_RULES: contextvars.ContextVar[Rules] = contextvars.ContextVar("podtrain_rules", default=DEFAULT_RULES)


def axes_of(entry) -> tuple[str, ...]:
    """The mesh axes of a rule target or a PartitionSpec entry: None, one name, or a sequence."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def sharded_over(names: Sequence[str | None], mesh_axis_sizes: Mapping[str, int], rules: Rules | None = None
                 ) -> tuple[tuple[str, ...], int]:
    """The mesh axes (of size > 1) that the logical axes `names` map to, and their product."""
    spec = logical_to_spec(names, mesh_axis_sizes, rules=rules)
    axes = tuple(a for entry in spec for a in axes_of(entry))
    count = 1
    for axis in axes:
        count *= mesh_axis_sizes[axis]
    return axes, count


def check_rules(rules: Rules, key: str = "sharding.rules") -> None:
    """Raises ValueError if a rule is for a logical axis no model uses or names an axis no mesh has."""
    for name, target in rules.items():
        if name not in LOGICAL_AXES:
            near = difflib.get_close_matches(name, LOGICAL_AXES, n=1)
            hint = f"; did you mean {key}.{near[0]}?" if near else ""
            raise ValueError(f"{key}.{name}: unknown logical axis {name!r}; expected one of {list(LOGICAL_AXES)}{hint}")
        for axis in axes_of(target):
            if axis not in MESH_AXES:
                raise ValueError(
                    f"{key}.{name}: mesh axis {axis!r} does not exist; expected one of {list(MESH_AXES)} or null"
                )


@contextlib.contextmanager
def use_rules(rules: Rules):
    """Makes `rules` the table used by `logical_to_spec` and `constrain` inside the block."""
    check_rules(rules)
    token = _ACTIVE_RULES.set(dict(rules))
    try:
        yield
    finally:
        _ACTIVE_RULES.reset(token)


def active_rules() -> Rules:
    return _ACTIVE_RULES.get()


def logical_to_spec(
    names: Sequence[str | None],
    mesh_axis_sizes: Mapping[str, int],
    *,
    shape: Sequence[int] | None = None,
    rules: Rules | None = None,
    what: str = "array",
) -> PartitionSpec:
    """Maps logical axis names to a PartitionSpec on a mesh with the given axis sizes.

    Mesh axes of size 1 are dropped, and a mesh axis already used by an earlier dimension is not
    used again. With `shape`, a dimension that its mesh axes do not divide is an error naming `what`.
    """
    rules = active_rules() if rules is None else rules
    used: set[str] = set()
    spec = []
    for dim, name in enumerate(names):
        if name is None:
            spec.append(None)
            continue
        if name not in rules:
            raise ValueError(
                f"{what}: logical axis {name!r} has no rule in sharding.rules; known: {sorted(rules)}"
            )
        axes = [a for a in axes_of(rules[name]) if mesh_axis_sizes.get(a, 1) > 1 and a not in used]
        if shape is not None and axes:
            size = 1
            for a in axes:
                size *= mesh_axis_sizes[a]
            if shape[dim] % size:
                raise ValueError(
                    f"{what}: dimension {dim} ({name!r}, size {shape[dim]}) is not divisible by mesh axes "
                    f"{axes} (product {size}); change the mesh or the rule for {name!r}"
                )
        used.update(axes)
        spec.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
    return PartitionSpec(*spec)


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """Sharding constraint on an activation by logical names; a no-op outside a mesh context."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
        return x
    spec = logical_to_spec(names, dict(mesh.shape))
    return jax.lax.with_sharding_constraint(x, spec)
