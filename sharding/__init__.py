"""Meshes, the logical-to-mesh rule table, placing weights on a mesh, the optimizer state and batch shardings."""

from podtrain.sharding.mesh import build_mesh, describe_mesh, resolve_axis_sizes
from podtrain.sharding.place import abstract_model, create_sharded, state_shardings
from podtrain.sharding.rules import DEFAULT_RULES, MESH_AXES, constrain, logical_to_spec, use_rules
from podtrain.sharding.state import batch_sharding, optimizer_state_shardings, replicated

__all__ = [
    "DEFAULT_RULES", "MESH_AXES", "abstract_model", "batch_sharding", "build_mesh", "constrain", "create_sharded",
    "describe_mesh", "logical_to_spec", "optimizer_state_shardings", "replicated", "resolve_axis_sizes",
    "state_shardings", "use_rules",
]
