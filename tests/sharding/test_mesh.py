"""Meshes: axis sizes, axis order, slices of TPUs and GPU nodes, layouts on a physical torus."""

import types

import jax
import numpy as np
import pytest

from podtrain.sharding import build_mesh, resolve_axis_sizes
from podtrain.sharding.mesh import device_grid, device_slices


def test_resolve_axis_sizes():
    assert resolve_axis_sizes({"fsdp": -1, "tp": 2}, 8) == {"dp": 1, "fsdp": 4, "ep": 1, "cp": 1, "tp": 2}
    with pytest.raises(ValueError, match="at most one axis may be -1"):
        resolve_axis_sizes({"fsdp": -1, "tp": -1}, 8)
    with pytest.raises(ValueError, match="does not divide the 8 devices"):
        resolve_axis_sizes({"fsdp": -1, "tp": 3}, 8)
    with pytest.raises(ValueError, match="unknown mesh axes"):
        resolve_axis_sizes({"model": 2}, 8)


def test_mesh_axes_and_order():
    mesh = build_mesh({"dp": 2, "fsdp": 2, "tp": 2})
    assert mesh.axis_names == ("dp", "fsdp", "ep", "cp", "tp")
    assert dict(mesh.shape) == {"dp": 2, "fsdp": 2, "ep": 1, "cp": 1, "tp": 2}
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)


def test_multislice_dp_spans_slices():
    """With devices on two slices, each slice holds half of dp and all of the other axes."""
    devices = [  # two slices of 2x2 chips (one core each)
        types.SimpleNamespace(id=i, slice_index=i // 4, process_index=i // 2, platform="tpu",
                              device_kind="fake", coords=(i % 2, i // 2 % 2, 0), core_on_chip=0)
        for i in range(8)
    ]
    grid = device_grid({"dp": 2, "fsdp": 2, "tp": 2}, devices)
    assert grid.shape == (2, 2, 1, 1, 2)
    slices = np.vectorize(lambda d: d.slice_index)(grid)
    assert (slices[0] == 0).all() and (slices[1] == 1).all()
    with pytest.raises(ValueError, match="multiple of the number of slices"):
        device_grid({"dp": 1, "fsdp": 8}, devices)


def test_gpu_nodes_are_one_slice_whatever_their_slice_index():
    """XLA gives each GPU host its own slice_index: two nodes must not force dp to span "slices"."""
    devices = [types.SimpleNamespace(id=i, slice_index=i // 4, process_index=i // 4, platform="gpu",
                                     device_kind="fake") for i in range(8)]
    assert device_slices(devices) == [0] * 8
    assert device_slices(devices, num_slices=2) == [0] * 4 + [1] * 4  # asked for: blocks of processes


def test_a_mesh_axis_may_split_a_physical_tpu_axis_when_it_must():
    """mesh_utils keeps each mesh axis within whole torus axes unless told otherwise, and some
    shapes (fsdp=8 x tp=2 on a 4x4 slice) then have no layout: those retry allowing a split."""
    from podtrain.sharding.mesh import _physical_mesh

    calls = []

    def create(shape, devices, allow_split_physical_axes=False):
        calls.append(allow_split_physical_axes)
        if not allow_split_physical_axes:
            raise NotImplementedError("Failed to find assignment for logical_axis_index 1")
        return np.arange(16).reshape(shape)

    assert _physical_mesh(create, (8, 2), None, what="mesh.fsdp=8 * mesh.tp=2").shape == (8, 2)
    assert calls == [False, True]

    def never(shape, devices, allow_split_physical_axes=False):
        raise NotImplementedError("Failed to find assignment")

    with pytest.raises(ValueError, match=r"mesh: mesh.fsdp=8 \* mesh.tp=2 cannot be laid out on these devices' "
                                         r"physical topology: Failed to find assignment"):
        _physical_mesh(never, (8, 2), None, what="mesh.fsdp=8 * mesh.tp=2")
