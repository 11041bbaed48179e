"""The mesh of a config on its devices."""

from __future__ import annotations

from collections.abc import Sequence

import jax
from jax.sharding import Mesh

from podtrain.orchestrator.common.errors import ConfigError
from podtrain.orchestrator.config.schema import Config
from podtrain.orchestrator.config.validate import mesh_sizes
from podtrain.sharding.mesh import build_mesh


def make_mesh(config: Config, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Checks the config's mesh against the devices (all of JAX's by default) and the model, then
    builds it (multi-slice when `cluster.num_slices` > 1)."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = mesh_sizes(config, len(devices))
    try:
        return build_mesh(sizes, devices, num_slices=config.cluster.num_slices)
    except ValueError as e:  # a mesh the devices' topology cannot hold, or dp not spanning the slices
        raise ConfigError(str(e)) from None
