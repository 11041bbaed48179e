"""Device meshes with the axes (dp, fsdp, ep, cp, tp), on one process, many processes or many slices."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from podtrain.sharding.rules import MESH_AXES


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
            axes = " * ".join(f"{key}.{a}={size}" for a, size in resolved.items() if size != -1)
            raise ValueError(
                f"{key}: the fixed axes {axes} = {fixed}, which does not divide the {num_devices} devices, "
                f"so {key}.{free[0]}=-1 cannot be filled; change those axes"
            )
        resolved[free[0]] = num_devices // fixed
    product = math.prod(resolved.values())
    if product != num_devices:
        shape = " * ".join(f"{key}.{a}={resolved[a]}" for a in MESH_AXES)
        raise ValueError(f"{key}: {shape} = {product} devices, but {num_devices} devices are present")
    return resolved


def _tpu_slice_count(devices: Sequence[jax.Device]) -> int:
    """How many TPU slices `devices` span by their `slice_index`; 0 for other devices, whose
    `slice_index` XLA sets per host (every GPU node would count as a slice)."""
    if not all(d.platform == "tpu" and hasattr(d, "slice_index") for d in devices):
        return 0
    return len({d.slice_index for d in devices})


def device_slices(devices: Sequence[jax.Device], num_slices: int | None = None) -> list[int]:
    """The slice of each device: its `slice_index` where TPU devices carry several; otherwise, for
    `num_slices` > 1 simulated slices (CPU hosts standing in for TPU VMs, several processes),
    consecutive equal blocks of processes, in process order. GPU nodes are one slice."""
    devices = list(devices)
    if _tpu_slice_count(devices) > 1:
        return [int(d.slice_index) for d in devices]
    processes = sorted({d.process_index for d in devices})
    if not num_slices or num_slices == 1 or len(processes) == 1:
        return [0] * len(devices)
    if len(processes) % num_slices:
        raise ValueError(f"cluster.num_slices={num_slices} needs a process count divisible by it, "
                         f"found {len(processes)} processes")
    rank = {process: i for i, process in enumerate(processes)}
    return [rank[d.process_index] * num_slices // len(processes) for d in devices]


def _physical_mesh(create, *args, what: str) -> np.ndarray:
    """`create(*args)` (a `mesh_utils` builder): first keeping each mesh axis within whole physical
    axes of the TPU torus, else letting it split one (e.g. fsdp=8 x tp=2 on a 4x4 slice), else a
    ValueError naming the mesh."""
    try:
        return np.asarray(create(*args))
    except NotImplementedError:
        pass
    try:
        return np.asarray(create(*args, allow_split_physical_axes=True))
    except (NotImplementedError, ValueError) as error:
        raise ValueError(f"mesh: {what} cannot be laid out on these devices' physical topology: {error}") from None


def device_grid(
    sizes: Mapping[str, int],
    devices: Sequence[jax.Device],
    *,
    num_slices: int | None = None,
) -> np.ndarray:
    """Arranges `devices` into an array of shape (dp, fsdp, ep, cp, tp), tp innermost.

    On several slices (see `device_slices`), `dp` spans the slices: each slice holds
    `dp // num_slices` of it and the other axes stay inside a slice (fast interconnect).
    """
    devices = list(devices)
    resolved = resolve_axis_sizes(sizes, len(devices))
    shape = [resolved[a] for a in MESH_AXES]
    slices = device_slices(devices, num_slices)
    count = len(set(slices))
    what = " * ".join(f"mesh.{a}={resolved[a]}" for a in MESH_AXES)
    if count <= 1:
        return _physical_mesh(mesh_utils.create_device_mesh, shape, devices, what=what)
    if resolved["dp"] % count:
        raise ValueError(
            f"mesh.dp={resolved['dp']} must be a multiple of the number of slices ({count}): "
            "the dp axis spans the slices"
        )
    ici = [resolved["dp"] // count] + shape[1:]
    if _tpu_slice_count(devices) == count:
        dcn = [count] + [1] * (len(shape) - 1)
        return _physical_mesh(mesh_utils.create_hybrid_device_mesh, ici, dcn, devices, what=what)
    per_slice = [[d for d, s in zip(devices, slices, strict=True) if s == i] for i in sorted(set(slices))]
    return np.concatenate([_physical_mesh(mesh_utils.create_device_mesh, ici, group, what=what)
                           for group in per_slice])


def build_mesh(
    sizes: Mapping[str, int],
    devices: Sequence[jax.Device] | None = None,
    *,
    num_slices: int | None = None,
) -> Mesh:
    """Builds a Mesh with axes (dp, fsdp, ep, cp, tp) over `devices` (default: all), every axis `Auto`."""
    grid = device_grid(sizes, jax.devices() if devices is None else devices, num_slices=num_slices)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def describe_mesh(mesh: Mesh, num_slices: int | None = None) -> dict:
    """A JSON-ready summary: axis sizes, device count, processes, slices and the device kind.

    `dp_slices[i]` lists the slices that hold the devices at dp index i: on several slices each dp
    index lies in one slice (the dp axis spans slices, the other axes stay inside one).
    `num_slices` is the simulated slice count for devices without a `slice_index` (see `device_slices`).
    """
    devices = list(mesh.devices.flat)
    first = devices[0]
    slice_of = np.asarray(device_slices(devices, num_slices)).reshape(mesh.devices.shape)
    dp = mesh.axis_names.index("dp") if "dp" in mesh.axis_names else None
    return {
        "axes": {name: int(size) for name, size in mesh.shape.items()},
        "devices": int(mesh.devices.size),
        "processes": len({d.process_index for d in devices}),
        "slices": len(np.unique(slice_of)),
        "dp_slices": None if dp is None else [
            sorted(set(np.take(slice_of, i, axis=dp).ravel().tolist())) for i in range(mesh.devices.shape[dp])
        ],
        "device_kind": first.device_kind,
        "platform": first.platform,
    }
