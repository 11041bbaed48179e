"""Meshes, the logical-to-mesh rule table and placing weights on a mesh."""

from podtrain.sharding.mesh import build_mesh, describe_mesh, resolve_axis_sizes
from podtrain.sharding.place import abstract_model, create_sharded, state_shardings
from podtrain.sharding.rules import DEFAULT_RULES, MESH_AXES, constrain, logical_to_spec, use_rules

__all__ = [
    "DEFAULT_RULES", "MESH_AXES", "abstract_model", "build_mesh", "constrain", "create_sharded",
    "describe_mesh", "logical_to_spec", "resolve_axis_sizes", "state_shardings", "use_rules",
]
