"""The step estimate's parts against hand-computed values, on tiny programs compiled for v5p chips
(compile-only devices): one matmul, a scan of matmuls, one all-gather."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

pytest.importorskip("libtpu")

from podtrain.orchestrator.common.chips import CHIPS  # noqa: E402
from podtrain.orchestrator.plan.hlo_comm import as_rows, collectives  # noqa: E402
from podtrain.orchestrator.plan.hlo_cost import step_time  # noqa: E402
from podtrain.orchestrator.plan.on_target import link_bandwidth, members  # noqa: E402
from podtrain.orchestrator.plan.targets import compile_devices, parse_target  # noqa: E402

pytestmark = [pytest.mark.slow,
              pytest.mark.filterwarnings("ignore:Error reading persistent compilation cache entry:UserWarning")]
V5P = CHIPS["v5p"]
TARGET = parse_target("v5p-16")  # 8 chips, 2x2x2


@pytest.fixture(scope="module")
def devices():
    return compile_devices(TARGET)


def _estimate(hlo, seconds=lambda name: 0.0):
    return step_time(hlo, peak_flops=V5P.peak_flops, hbm_bandwidth=V5P.hbm_bandwidth, comm_seconds=seconds)


def test_one_matmul_costs_its_flops_at_the_peak_or_its_bytes_at_the_hbm_bandwidth(devices):
    m, k, n = 2048, 4096, 1024
    one = SingleDeviceSharding(devices[0])
    x = jax.ShapeDtypeStruct((m, k), jnp.bfloat16, sharding=one)
    w = jax.ShapeDtypeStruct((k, n), jnp.bfloat16, sharding=one)
    r = _estimate(jax.jit(lambda a, b: a @ b).lower(x, w).compile().as_text())
    assert r["flops"] == 2 * m * n * k
    assert r["hbm_bytes"] == 2 * (m * k + k * n + m * n)  # both operands read, the result written
    compute, memory = 2 * m * n * k / V5P.peak_flops, r["hbm_bytes"] / V5P.hbm_bandwidth
    assert r["compute_s"] == pytest.approx(compute) and r["bound_by"] == "compute"
    # The compiler may copy an operand to on-chip memory first, and the matmul waits for the copy.
    assert compute <= r["step_s"] <= compute + memory
    assert r["comm_s"] == r["exposed_s"] == 0


def test_a_loop_body_counts_once_per_iteration(devices):
    """Six layers of a scan: six times one layer's matmul FLOPs (XLA's own cost analysis counts the
    body once), and the layer's weight sliced out of the stack, not the stack read in full."""
    layers, m, d = 6, 512, 1024
    one = SingleDeviceSharding(devices[0])
    x = jax.ShapeDtypeStruct((m, d), jnp.bfloat16, sharding=one)
    ws = jax.ShapeDtypeStruct((layers, d, d), jnp.bfloat16, sharding=one)

    def run(h, stack):
        return jax.lax.scan(lambda c, w: (c @ w, None), h, stack)[0]

    compiled = jax.jit(run).lower(x, ws).compile()
    r = _estimate(compiled.as_text())
    assert 0 <= r["flops"] - layers * 2 * m * d * d <= 2 * layers  # and the loop counter's add and compare
    assert compiled.cost_analysis()["flops"] < r["flops"] / 2
    weights = layers * d * d * 2
    assert weights <= r["hbm_bytes"] < 2 * weights + layers * 4 * m * d * 2


def test_one_all_gather_takes_its_bytes_over_the_links_its_group_spans(devices):
    """8 chips of a 2x2x2 v5p slice along one mesh axis: a ring all-gather sends 7/8 of its result,
    over one link per torus dimension (each of extent 2), 3 of the chip's 6; nothing to overlap it
    with, so all of it is waited for."""
    mesh = Mesh(np.asarray(devices).reshape(8), ("fsdp",))
    x = jax.ShapeDtypeStruct((8 * 1024, 4096), jnp.bfloat16, sharding=NamedSharding(mesh, P("fsdp", None)))
    gather = jax.jit(lambda a: a, out_shardings=NamedSharding(mesh, P(None, None)))
    hlo = gather.lower(x).compile().as_text()
    rows = as_rows(collectives(hlo, mesh.devices.shape, mesh.axis_names))
    assert [r["kind"] for r in rows] == ["all-gather"]
    row = rows[0] | {"crosses": False}
    result = 8 * 1024 * 4096 * 2
    assert row["traffic"] == result * 7 / 8
    coords = {tuple(devices[i].coords) for i in members(row, mesh)}
    assert coords == {(x, y, z) for x in (0, 1) for y in (0, 1) for z in (0, 1)}
    bandwidth = link_bandwidth(row, mesh, TARGET)
    assert bandwidth == 3 * V5P.ici_bandwidth / 6
    r = _estimate(hlo, lambda name: row["traffic"] / bandwidth if name == row["name"] else 0.0)
    assert r["comm_s"] == pytest.approx(result * 7 / 8 / bandwidth)
    assert r["exposed_s"] == pytest.approx(r["comm_s"]) and r["bound_by"] == "communication"
    assert r["step_s"] >= r["comm_s"]
    # Across slices the same group would go over the data-centre network.
    assert link_bandwidth(row | {"crosses": True}, mesh, TARGET) == V5P.dcn_bandwidth
