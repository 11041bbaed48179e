"""Device meshes with the axes (dp, fsdp, ep, tp), on one process, many processes or many slices."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from sharding.rules import MESH_AXES


def resolve_axis_sizes(sizes: Mapping[str, int], num_devices: int, *, key: str = "mesh") -> dict[str, int]:
    """Fills in the one axis given as -1 and checks that the product equals `num_devices`.

    Raises:
        ValueError: naming the keys, the product and the device count when they disagree.
    """
    unknown = sorted(set(sizes) - set(MESH_AXES))
    if unknown:
        raise ValueError(f"{key}: unknown mesh axes {unknown}; expected {list(MESH_AXES)}")
    resolved = {axis: int(sizes.get(axis, 1)) for axis in MESH_AXES}
    free = [axis for axis, size in resolved.items() if size == -1]
    bad = [axis for axis, size in resolved.items() if size == 0 or size < -1]
    if bad:
        raise ValueError(f"{key}.{bad[0]}: expected a positive size or -1, found {resolved[bad[0]]}")
    if len(free) > 1:
        raise ValueError(f"{key}: at most one axis may be -1, found {', '.join(f'{key}.{a}' for a in free)}")
    fixed = math.prod(size for size in resolved.values() if size != -1)
    if free:
        if num_devices % fixed:
            raise ValueError(
                f"{key}: the fixed axes multiply to {fixed}, which does not divide the {num_devices} devices, "
                f"so {key}.{free[0]}=-1 cannot be filled"
            )
        resolved[free[0]] = num_devices // fixed
    product = math.prod(resolved.values())
    if product != num_devices:
        shape = " * ".join(f"{key}.{a}={resolved[a]}" for a in MESH_AXES)
        raise ValueError(f"{key}: {shape} = {product} devices, but {num_devices} devices are present")
    return resolved


def device_grid(
    sizes: Mapping[str, int],
    devices: Sequence[jax.Device],
    *,
    num_slices: int | None = None,
) -> np.ndarray:
    """Arranges `devices` into an array of shape (dp, fsdp, ep, tp), tp innermost.

    On several slices (devices carry `slice_index`), `dp` spans the slices: each slice holds
    `dp // num_slices` of it and the other axes stay inside a slice (fast interconnect).
    """
    devices = list(devices)
    resolved = resolve_axis_sizes(sizes, len(devices))
    shape = [resolved[a] for a in MESH_AXES]
    if num_slices is None:
        num_slices = len({getattr(d, "slice_index", 0) for d in devices})
    if num_slices <= 1:
        return np.asarray(mesh_utils.create_device_mesh(shape, devices))
    if resolved["dp"] % num_slices:
        raise ValueError(
            f"mesh.dp={resolved['dp']} must be a multiple of the number of slices ({num_slices}): "
            "the dp axis spans the slices"
        )
    ici = [resolved["dp"] // num_slices] + shape[1:]
    dcn = [num_slices] + [1] * (len(shape) - 1)
    return np.asarray(mesh_utils.create_hybrid_device_mesh(ici, dcn, devices))


def build_mesh(
    sizes: Mapping[str, int],
    devices: Sequence[jax.Device] | None = None,
    *,
    num_slices: int | None = None,
) -> Mesh:
    """Builds a Mesh with axes (dp, fsdp, ep, tp) over `devices` (default: all), every axis `Auto`."""
    grid = device_grid(sizes, jax.devices() if devices is None else devices, num_slices=num_slices)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def describe_mesh(mesh: Mesh) -> dict:
    """A JSON-ready summary: axis sizes, device count, processes and the device kind."""
    devices = mesh.devices.flat
    first = next(iter(mesh.devices.flat))
    return {
        "axes": {name: int(size) for name, size in mesh.shape.items()},
        "devices": int(mesh.devices.size),
        "processes": len({d.process_index for d in devices}),
        "device_kind": first.device_kind,
        "platform": first.platform,
    }
