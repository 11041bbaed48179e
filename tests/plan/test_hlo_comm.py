# ruff: noqa: E501 (HLO text is written as the compiler prints it, one instruction per line)
"""Collective bytes from optimized HLO text: replica-group forms, loop trip counts, traffic per kind."""

import pytest

from podtrain.orchestrator.plan.hlo_comm import collectives, replica_groups, summarize

AXES = ("dp", "fsdp", "ep", "tp")

HLO = """HloModule jit_step, is_scheduled=true

%cond (p: (s32[], bf16[8,256])) -> pred[] {
  %p = (s32[], bf16[8,256]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(6)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%body (p.1: (s32[], bf16[8,256])) -> (s32[], bf16[8,256]) {
  %p.1 = (s32[], bf16[8,256]) parameter(0)
  %x = bf16[8,256]{1,0} get-tuple-element(%p.1), index=1
  %ag = bf16[32,256]{1,0} all-gather(%x), channel_id=1, replica_groups=[2,4]<=[4,2]T(1,0), dimensions={0}, use_global_device_ids=true, metadata={op_name="jit(step)/while/body/dot_general"}
  %cp = (bf16[8,256]{1,0}, bf16[8,256]{1,0}, u32[], u32[]) collective-permute-start(%x), channel_id=2, source_target_pairs={{0,2},{2,4},{4,6},{6,0},{1,3},{3,5},{5,7},{7,1}}
  %cpd = bf16[8,256]{1,0} collective-permute-done(%cp)
  ROOT %t = (s32[], bf16[8,256]) tuple(%i.1, %cpd)
}

ENTRY %main (a: bf16[8,256], b: f32[1024]) -> f32[1024] {
  %a = bf16[8,256]{1,0} parameter(0)
  %b = f32[1024]{0} parameter(1)
  %w = (s32[], bf16[8,256]) while(%t0), condition=%cond, body=%body
  %ar = f32[1024]{0} all-reduce(%b), channel_id=3, replica_groups={{0,1},{2,3},{4,5},{6,7}}, use_global_device_ids=true, to_apply=%add
  %rs = f32[256]{0} reduce-scatter(%b), channel_id=4, replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_0'}, dimensions={0}
  %a2a = bf16[8,256]{1,0} all-to-all(%a), channel_id=5, replica_groups=mesh['axis_0'=2,'axis_1'=4], device_ids=([4,2]T(1,0)) {'axis_0','axis_1'}, dimensions={0}
  %rss = (f32[1024]{0}, f32[256]{0}) reduce-scatter-start(%b), channel_id=6, replica_groups=[2,4]<=[4,2]T(1,0), dimensions={0}
  %rsd = f32[256]{0} reduce-scatter-done(%rss)
  ROOT %out = f32[1024]{0} copy(%ar)
}
"""


def test_replica_group_forms():
    assert replica_groups("replica_groups={{0,1},{2,3}}", 4) == [[0, 1], [2, 3]]
    assert replica_groups("replica_groups=[2,4]<=[8]", 8) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert replica_groups("replica_groups=[2,4]<=[4,2]T(1,0)", 8) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert replica_groups("replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_0'}", 8) == [[0, 2, 4, 6],
                                                                                             [1, 3, 5, 7]]
    assert replica_groups("replica_groups=mesh['axis_0'=2,'axis_1'=4], device_ids=([4,2]T(1,0)) {'axis_1'}",
                          8) == [[0, 2, 4, 6], [1, 3, 5, 7]]


def test_bytes_axes_and_loop_trip_counts():
    found = {c.name: c for c in collectives(HLO, (1, 4, 1, 2), AXES)}
    ag, cp, ar, rs, a2a = (found[n] for n in ("ag", "cp", "ar", "rs", "a2a"))
    # Logical device i is mesh.devices.flat[i] of a (1, 4, 1, 2) mesh: i = 2 * fsdp + tp.
    assert (ag.axes, ag.group, ag.executions, ag.bytes) == (("fsdp",), 4, 6, 32 * 256 * 2)
    assert ag.traffic == pytest.approx(6 * 32 * 256 * 2 * 3 / 4)
    assert (cp.axes, cp.executions, cp.bytes, cp.traffic) == (("fsdp",), 6, 8 * 256 * 2, 6 * 8 * 256 * 2)
    assert (ar.axes, ar.group, ar.executions) == (("tp",), 2, 1) and ar.traffic == 2 * 4096 * 1 / 2
    assert (rs.axes, rs.group) == (("fsdp",), 4) and rs.traffic == 1024 * 3  # its output times (g - 1)
    assert (a2a.axes, a2a.group) == (("fsdp", "tp"), 8) and a2a.traffic == pytest.approx(4096 * 7 / 8)
    assert ag.op_name == "jit(step)/while/body/dot_general"
    # An async collective's shape pairs operands with outputs: it moves its outputs.
    assert (found["rss"].kind, found["rss"].bytes, found["rss"].traffic) == ("reduce-scatter", 256 * 4, 256 * 4 * 3)
    assert "rsd" not in found
    summary = summarize(list(found.values()))
    assert summary["by_kind"]["all-gather"] == {"ops": 1, "executions": 6, "traffic_bytes": ag.traffic}
    assert summary["by_axes"]["fsdp"] == pytest.approx(ag.traffic + cp.traffic + rs.traffic + found["rss"].traffic)
    assert summary["traffic_bytes"] == pytest.approx(sum(c.traffic for c in found.values()))


def test_a_megascale_send_counts_as_the_collective_across_slices():
    hlo = """HloModule m

ENTRY %main (a: f32[64,8,128]) -> f32[64,8,128] {
  %a = f32[64,8,128]{2,1,0} parameter(0)
  %after = token[] after-all()
  %send.1 = (f32[64,8,128]{2,1,0}, u32[], token[]) send(%a, %after), channel_id=2, is_host_transfer=true, frontend_attributes={_xla_megascale_target="{1,2}x{0:7}",_xla_megascale_transfer_type="ALL_REDUCE"}
  %recv.1 = (f32[64,8,128]{2,1,0}, u32[], token[]) recv(%after), channel_id=3, is_host_transfer=true, frontend_attributes={_xla_megascale_transfer_type="ALL_REDUCE"}
  ROOT %c = f32[64,8,128]{2,1,0} copy(%a)
}
"""
    (send,) = collectives(hlo, (2, 8, 1, 1), AXES, num_slices=2, slice_axes=("dp",))
    assert (send.kind, send.axes, send.group, send.bytes) == ("all-reduce", ("dp",), 2, 64 * 8 * 128 * 4)
    assert send.traffic == 64 * 8 * 128 * 4  # 2 * size * (2 - 1) / 2


def test_a_loop_stepping_its_counter_by_two_runs_half_its_bound():
    """The TPU compiler's unrolled windowed-einsum loops: counter from 0, +2 per iteration, < 8."""
    hlo = """HloModule m

%cond (p: (s32[], bf16[8,256])) -> pred[] {
  %p = (s32[], bf16[8,256]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(8)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%body (p.1: (s32[], bf16[8,256])) -> (s32[], bf16[8,256]) {
  %p.1 = (s32[], bf16[8,256]) parameter(0)
  %i.1 = s32[] get-tuple-element(%p.1), index=0
  %two = s32[] constant(2)
  %next = s32[] add(%i.1, %two)
  %x = bf16[8,256]{1,0} get-tuple-element(%p.1), index=1
  %cp = bf16[8,256]{1,0} collective-permute(%x), channel_id=2, source_target_pairs={{0,1},{1,0}}
  ROOT %t = (s32[], bf16[8,256]) tuple(%next, %cp)
}

ENTRY %main (a: bf16[8,256]) -> bf16[8,256] {
  %a = bf16[8,256]{1,0} parameter(0)
  %start = s32[] constant(START)
  %t0 = (s32[], bf16[8,256]) tuple(%start, %a)
  %w = (s32[], bf16[8,256]) while(%t0), condition=%cond, body=%body
  ROOT %out = bf16[8,256]{1,0} get-tuple-element(%w), index=1
}
"""
    for start, trips in ((0, 4), (1, 4), (2, 3), (8, 0)):
        (cp,) = collectives(hlo.replace("START", str(start)), (1, 2, 1, 1), AXES)
        assert cp.executions == trips, start
    # The same condition written with the bound first.
    flipped = hlo.replace("compare(%i, %n), direction=LT", "compare(%n, %i), direction=GT").replace("START", "0")
    assert collectives(flipped, (1, 2, 1, 1), AXES)[0].executions == 4


def test_an_attribute_broken_over_lines_does_not_end_its_computation():
    """A Pallas kernel's custom call carries metadata with line breaks, a line of which starts with
    "}}": the collectives after it still belong to the loop body and run once per iteration."""
    kernel = ('  %k = bf16[8,256]{1,0} custom-call(%x), custom_call_target="tpu_custom_call", '
              'frontend_attributes={kernel_metadata={"xprof_metadata":"{\\"block_q\\": 512,\n'
              '\\"block_kv\\": 512\n}}, metadata={op_name="jit(step)/pallas_call"}\n')
    hlo = HLO.replace("  %cp = ", kernel + "  %cp = ")
    found = {c.name: c for c in collectives(hlo, (1, 4, 1, 2), AXES)}
    assert found["cp"].executions == 6 and found["ag"].executions == 6 and "ar" in found
