"""`podtrain plan --target` compiles the real train step for TPU slices and GPU nodes on compile-only
devices; `train`/`submit` refuse a TPU or GPU launch whose step does not fit, before any Ray call.

The plans run as the CLI does, in a child process without the tests' CPU compile flags."""

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from podtrain.launch import cli
from podtrain.orchestrator.common.chips import CHIPS
from podtrain.orchestrator.common.errors import ConfigError
from podtrain.orchestrator.plan.targets import parse_target, verdict_line

pytestmark = pytest.mark.slow
needs_tpu = pytest.mark.skipif(not __import__("importlib").util.find_spec("libtpu"), reason="needs podtrain[aot]")
GiB = 2**30
# A model whose params, gradients and AdamW state, replicated over 8 chips (mesh.dp=8), need more
# than a v5e's 16 GiB, and fit when sharded (fsdp).
REPLICATED_TOO_BIG = ["mesh.dp=8", "mesh.fsdp=1", "model.hidden_size=4096", "model.intermediate_size=11008",
                      "model.num_layers=6", "model.num_heads=32", "model.num_kv_heads=8", "model.head_dim=128",
                      "model.vocab_size=32000"]


def _env():
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR")}
    return env | {"JAX_PLATFORMS": "cpu"}


def podtrain(*args, timeout=600, env=None):
    return subprocess.run([sys.executable, "-m", "podtrain.launch.cli", *args], capture_output=True, text=True,
                          env=_env() | (env or {}), timeout=timeout)


def plan(target, *overrides, preset="llama3-tiny", code=0, env=None):
    done = podtrain("plan", "-c", preset, "--target", target, "--json", *overrides, env=env)
    assert done.returncode == code, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_target_names_parse_to_slices_and_nodes():
    t = parse_target("2xv5p-64")
    assert (t.chip.name, t.groups, t.per_group, t.topology, t.devices, t.hosts) == ("v5p", 2, 32, "2x4x4", 64, 16)
    assert (parse_target("v6e-256").topology, parse_target("v4-32").per_group) == ("16x16", 16)
    g = parse_target("4xh100x8")
    assert (g.chip.name, g.groups, g.per_group, g.hosts) == ("h100", 4, 8, 4)
    assert parse_target("a100-80gbx8").chip.hbm_bytes == 80 * GiB
    with pytest.raises(ConfigError, match=r"^--target='v9x-8': not a known target; expected TPU slices .*v5p.* h100"):
        parse_target("v9x-8")
    with pytest.raises(ConfigError, match="v5p-24 is not a TPU slice"):
        parse_target("v5p-24")


def test_mfu_peaks_come_from_the_chip_table_under_every_name_jax_reports(monkeypatch):
    """A training run's MFU divides by the chip table's peak, whichever device kind JAX reports for the chip."""
    from types import SimpleNamespace

    from podtrain.orchestrator.train import metrics

    def reports(kind):
        monkeypatch.setattr(metrics.jax, "devices", lambda: [SimpleNamespace(device_kind=kind, platform="gpu")])

    for kind, chip in (("TPU v5 lite", "v5e"), ("TPU v5e", "v5e"), ("TPU v5", "v5p"), ("NVIDIA H100", "h100"),
                       ("NVIDIA H200", "h200"), ("NVIDIA A100-SXM4-40GB", "a100-40gb")):
        reports(kind)
        assert metrics.peak_flops_per_device() == (CHIPS[chip].peak_flops, f"table ({kind})")
    assert parse_target("a100-40gbx8").chip.hbm_bytes == 40 * GiB
    reports("NVIDIA B200")
    with pytest.raises(ConfigError, match="no peak FLOP/s known for device kind 'NVIDIA B200'"):
        metrics.peak_flops_per_device()
    assert metrics.peak_flops_per_device(1e9) == (1e9, "configured (train.peak_flops_per_device)")


def test_unknown_target_is_one_line_listing_the_known_ones(capsys):
    assert cli.main(["plan", "--target", "tpu9000"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--target='tpu9000': not a known target" in err[0]
    for example in ("v4", "v5e", "v5p", "v6e", "h100", "h200", "a100-80gb"):
        assert example in err[0]


@needs_tpu
def test_v5p_plan_of_llama3_tiny_reports_memory_traffic_and_estimate():
    out = plan("v5p-16")
    t = out["target"]
    assert (t["devices"], t["hosts"], t["chip"], t["fits"]) == (8, 2, "v5p", True)
    assert t["checked_by"] == "the TPU compiler" and t["hbm_bytes"] == CHIPS["v5p"].hbm_bytes
    assert t["params_bytes"] == sum(row["bytes_per_device"] for row in out["sharding"])
    assert 0 < t["peak_bytes"] < t["hbm_bytes"] and t["headroom_bytes"] == t["hbm_bytes"] - t["peak_bytes"]
    comm = t["communication"]
    assert comm["traffic_bytes"] == pytest.approx(sum(v["traffic_bytes"] for v in comm["by_kind"].values()))
    assert set(comm["by_axes"]) == {"fsdp"}  # the only mesh axis of size > 1
    r = t["estimate"]
    # The schedule's time covers each part on its own, and at most all of them one after another.
    assert max(r["compute_s"], r["hbm_s"], r["exposed_s"]) <= r["step_s"]
    assert r["step_s"] <= r["compute_s"] + r["hbm_s"] + r["comm_s"] + 1e-12
    assert 0 <= r["exposed_s"] <= r["comm_s"] and r["comm_s"] > 0
    tokens = 8 * 128
    # The compiled step does at least the model's FLOPs per device (full remat recomputes the forward).
    assert r["flops"] >= r["model_flops_per_step"] / 8
    assert r["mfu"] == pytest.approx(r["model_flops_per_step"] / (r["step_s"] * 8 * CHIPS["v5p"].peak_flops))
    assert r["tokens_per_s"] == pytest.approx(tokens / r["step_s"])
    assert r["tokens_per_s_per_chip"] == pytest.approx(tokens / r["step_s"] / 8)
    # Host RAM: 2 hosts of 4 chips. Orbax's replica-parallel save splits each array of the state
    # (params, two AdamW moments) evenly between them; a restore reads each device's shard.
    host = t["host"]
    params = sum(math.prod(row["shape"]) * np.dtype(row["dtype"]).itemsize for row in out["sharding"])
    assert host["orbax"]["save_staging_bytes"] == pytest.approx(3 * params / 2, rel=1e-6)
    assert host["orbax"]["restore_read_bytes"] == pytest.approx(3 * 4 * t["params_bytes"], rel=1e-6)
    assert host["ram_bytes"] == 448 * GiB and host["fits"] and t["fits"]


@needs_tpu
def test_llama3_8b_on_16_v5p_chips_needs_no_more_memory_or_traffic_than_maxtext():
    """fsdp 16 on v5p-32, one 8192-token sequence per chip, full remat, AdamW, float32 params and
    bfloat16 compute: MaxText's compile of the same config peaks at 13.3 GiB per chip and moves about
    47 GB per chip and step."""
    t = plan("v5p-32", "train.batch_size=16", "mesh.fsdp=-1", "mesh.tp=1", preset="llama3-8b")["target"]
    assert t["attention"] == "splash" and t["mesh"]["fsdp"] == 16
    assert t["peak_bytes"] <= 13.3 * GiB
    assert t["communication"]["traffic_bytes"] <= 47e9


@needs_tpu
def test_llama3_8b_at_131072_tokens_split_over_8_chips_fits_in_less_than_maxtext_needs():
    """cp 8 x fsdp 2 on v5p-32, one 131072-token sequence per fsdp shard, full remat: MaxText's
    compile of the same config (load-balanced all-gather context parallelism, splash) peaks at
    20.1 GiB per chip and its collectives' results add up to 101 GB per chip and step."""
    t = plan("v5p-32", "train.seq_len=131072", "train.batch_size=2", "mesh.cp=8", "mesh.fsdp=2",
             preset="llama3-8b")["target"]
    assert t["attention"] == "splash" and t["fits"] and t["peak_bytes"] <= 20.1 * GiB
    collectives = t["communication"]["collectives"]
    assert sum(c["bytes"] * c["executions"] for c in collectives) <= 101e9
    # Each device gathers the keys and values (8 heads of 128, bfloat16) of both sequences' other
    # chunks in the forward and in its recompute: 4 gathers per layer, and reduce-scatters their
    # gradients (none is an all-reduce).
    kv = [c for c in collectives if "attention.py" in c["source"]]
    gathered = 32 * 4 * 131072 * 8 * 128 * 2
    assert sum(c["bytes"] * c["executions"] for c in kv if c["kind"] == "all-gather") == gathered
    assert {c["kind"] for c in kv} == {"all-gather", "reduce-scatter"}


@needs_tpu
def test_a_step_over_the_chips_memory_does_not_fit_and_the_suggested_change_fits():
    t = plan("v5e-8", *REPLICATED_TOO_BIG, code=1)["target"]
    assert not t["fits"] and t["checked_by"] == "the TPU compiler (RESOURCE_EXHAUSTED)"
    assert (t["peak_bytes"], t["hbm_bytes"]) == (int(21.53 * GiB), int(15.75 * GiB))  # the compiler's figures
    # Parameters, gradients and AdamW moments replicated: only sharding them helps, found by one compile.
    fit = t["suggestion"]
    assert fit["overrides"] == ["mesh.dp=1", "mesh.fsdp=8"] and fit["compiles"] == 1
    assert 0 < fit["peak_bytes"] < t["hbm_bytes"] and fit["headroom_bytes"] == 16 * GiB - fit["peak_bytes"]
    assert verdict_line(t) == ("does not fit on v5e-8: peak 21.53 GiB of 15.75 GiB per device (over by 5.78 GiB); "
                               f"fits with mesh.dp=1 mesh.fsdp=8 (peak {fit['peak_bytes'] / GiB:.2f} GiB)")


@pytest.mark.skipif(not __import__("importlib").util.find_spec("jax_plugins.xla_cuda12"), reason="needs podtrain[aot]")
def test_h100x8_plan_compiles_and_podtrain_compares_the_peak_with_the_gpus_memory():
    t = plan("h100x8")["target"]
    assert (t["devices"], t["hosts"], t["chip"]) == (8, 1, "h100")
    assert t["checked_by"].startswith("podtrain")
    assert t["fits"] and t["headroom_bytes"] == 80 * GiB - t["peak_bytes"] and t["peak_bytes"] > t["params_bytes"]
    # The GPU compiler accepts any size: the comparison is ours (peak = arguments + outputs - aliased + temp).
    deeper = [o for o in REPLICATED_TOO_BIG if not o.startswith("model.num_layers")] + ["model.num_layers=30"]
    big = plan("h100x8", *deeper, "plan.max_fit_compiles=1", code=1)["target"]
    assert not big["fits"] and big["peak_bytes"] > 80 * GiB and big["headroom_bytes"] == 80 * GiB - big["peak_bytes"]
    assert big["peak_bytes"] >= big["params_bytes"] + big["optimizer_bytes"]
    assert big["suggestion"]["overrides"] == ["mesh.dp=1", "mesh.fsdp=8"] and big["suggestion"]["peak_bytes"] < 80 * GiB


@needs_tpu
def test_train_on_a_tpu_slice_that_cannot_fit_refuses_before_any_ray_call(tmp_path, monkeypatch, capsys):
    import podtrain.orchestrator.cluster.driver as driver

    monkeypatch.setattr(driver, "Driver", lambda *a, **k: pytest.fail("the driver started"))
    monkeypatch.setenv("XLA_FLAGS", "")
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    args = ["train", "cluster=tpu", "cluster.tpu_type=v5e-8", f"run.dir={tmp_path / 'runs'}",
            "plan.max_fit_compiles=0", *REPLICATED_TOO_BIG]
    assert cli.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("podtrain: error: plan check: does not fit on v5e-8: peak 21.53 GiB of 15.75 GiB")
    assert "nothing was reserved" in err[0] and not (tmp_path / "runs").exists()


@needs_tpu
def test_submit_refuses_a_step_that_cannot_fit_before_asking_ray():
    done = podtrain("submit", "--address", "http://127.0.0.1:9", "cluster=tpu", "cluster.tpu_type=v5e-8",
                    "plan.max_fit_compiles=0", *REPLICATED_TOO_BIG)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].startswith("podtrain: error: plan check: does not fit on v5e-8")
    assert "cannot reach Ray" not in done.stderr


def test_the_check_is_skipped_for_cpu_stand_ins_and_unnamed_gpus():
    from podtrain.orchestrator.config.compose import load_config
    from podtrain.orchestrator.plan.launch_check import check_before_launch

    said = []
    stand_in = load_config("llama3-tiny", ["cluster=tpu", "cluster.tpu_type=v4-16", "cluster.env.JAX_PLATFORMS=cpu"])
    assert not check_before_launch(stand_in, said.append)
    gpu = load_config("llama3-tiny", ["cluster=gpu"])
    assert not check_before_launch(gpu, said.append)
    off = load_config("llama3-tiny", ["cluster=tpu", "cluster.tpu_type=v5p-16", "plan.check_before_launch=false"])
    assert not check_before_launch(off, said.append)
    assert [s.split(":")[0] for s in said] == ["plan check skipped"] * 2 and "cluster.gpu_type" in said[1]


@needs_tpu
def test_two_slices_reduce_gradients_over_the_data_centre_network_along_dp():
    t = plan("2xv5p-16", "mesh.dp=2", "train.batch_size=16")["target"]
    assert (t["devices"], t["hosts"]) == (16, 4)
    comm, r = t["communication"], t["estimate"]
    assert comm["by_axes"]["dp"] > 0 and comm["by_category"]["all-reduce over dp"]["ideal"] > 0
    # What crosses slices goes at the DCN's bandwidth; the rest over ICI links, at most all 6 of a chip's.
    dcn = comm["by_axes"]["dp"] / CHIPS["v5p"].dcn_bandwidth
    ici = (comm["traffic_bytes"] - comm["by_axes"]["dp"]) / CHIPS["v5p"].ici_bandwidth
    assert dcn + ici <= r["comm_s"] <= dcn + 6 * ici


# The flags MaxText's recipes pass libtpu for asynchronous all-gathers.
ASYNC_ALL_GATHER = " ".join(f"--{flag}=true" for flag in (
    "xla_tpu_enable_async_collective_fusion", "xla_tpu_enable_async_collective_fusion_fuse_all_gather",
    "xla_tpu_enable_async_collective_fusion_multiple_steps", "xla_tpu_overlap_compute_collective_tc",
    "xla_enable_async_all_gather"))


@needs_tpu
def test_collectives_the_compiler_splits_over_async_fusions_move_their_bytes_once_and_overlap():
    """With MaxText's flags the TPU compiler splits each FSDP all-gather over a start, fusions beside
    matmuls and a done, each holding a copy of it: the traffic is the same as without the flags, and
    the estimate hides part of it under the matmuls, where without them it waits for all of it."""
    shape = ["model.dtype=bfloat16", "model.attention=xla", "train.seq_len=1024", "train.batch_size=8"]
    plain = plan("v5p-8", *shape)["target"]
    split = plan("v5p-8", *shape, env={"LIBTPU_INIT_ARGS": ASYNC_ALL_GATHER})["target"]
    assert {k: v["traffic_bytes"] for k, v in split["communication"]["by_kind"].items()} == \
        {k: v["traffic_bytes"] for k, v in plain["communication"]["by_kind"].items()}
    assert plain["estimate"]["exposed_s"] == pytest.approx(plain["estimate"]["comm_s"])
    assert split["estimate"]["comm_s"] == pytest.approx(plain["estimate"]["comm_s"])
    assert split["estimate"]["exposed_s"] < 0.8 * split["estimate"]["comm_s"]


def _layer_weights(m) -> int:
    """Elements of one decoder layer's matmul weights: q, k, v, o and the three MLP matrices."""
    return (2 * m["num_heads"] + 2 * m["num_kv_heads"]) * m["head_dim"] * m["hidden_size"] + \
        3 * m["hidden_size"] * m["intermediate_size"]


@needs_tpu
def test_fsdp_traffic_equals_the_ideal_computed_by_hand():
    out = plan("v5p-8", "model.dtype=bfloat16", "model.hidden_size=1024", "mesh.fsdp=4")
    m, t = out["config"]["model"], out["config"]["train"]
    comm = out["target"]["communication"]
    rows = comm["collectives"]
    layers, share = m["num_layers"], 3 / 4  # a ring over 4 devices sends 3/4 of the gathered array
    weights = layers * _layer_weights(m) * 2  # bytes, bfloat16
    in_loop = [r for r in rows if r["executions"] == layers and r["axes"] == ["fsdp"]]
    # Each layer's weights reduce-scattered once, gathered once for the forward pass and once for the
    # backward iteration (which recomputes the forward).
    assert sum(r["traffic"] for r in in_loop if r["kind"] == "reduce-scatter") == weights * share
    assert sum(r["traffic"] for r in in_loop if r["kind"] == "all-gather") == 2 * weights * share
    # Token rows, not the table: one all-to-all each way of the (tokens, hidden) rows of a device.
    tokens = t["batch_size"] * t["seq_len"] / 4
    assert comm["by_category"]["all-to-all over fsdp"]["measured"] == 2 * tokens * m["hidden_size"] * 2 * share


@needs_tpu
def test_tp_traffic_equals_the_ideal_computed_by_hand():
    out = plan("v5p-8", "model.dtype=bfloat16", "mesh.fsdp=1", "mesh.tp=4")
    m, t = out["config"]["model"], out["config"]["train"]
    comm = out["target"]["communication"]
    arrays = [r for r in comm["collectives"] if "[]" not in r["shape"]]  # without the metrics' scalars
    tokens, share = t["batch_size"] * t["seq_len"], 2 * 3 / 4  # an all-reduce over 4 sends 2 x 3/4
    # Per layer: attention and MLP outputs in the forward pass, the attention output again in the
    # recompute (full remat), the two input gradients in the backward pass; the LM head's input gradient.
    activations = (5 * m["num_layers"] + 1) * tokens * m["hidden_size"] * 2
    softmax = tokens * (2 + 4 + 4)  # the loss over vocabulary shards: the logits' max, two float32 sums
    measured = sum(r["traffic"] for r in arrays if r["kind"] == "all-reduce" and r["axes"] == ["tp"])
    assert measured == share * (activations + softmax)
    assert comm["ideal"]["by_category"]["all-reduce over tp"] == share * (activations + softmax)
    # The vocabulary-sharded table gathered once along tp, in the compute dtype.
    assert comm["by_category"]["gather/scatter over tp"]["measured"] == m["vocab_size"] * m["hidden_size"] * 2 * 3 / 4


def test_the_fit_search_tries_only_micro_batches_that_leave_every_batch_shard_a_row():
    from podtrain.orchestrator.config.compose import load_config
    from podtrain.orchestrator.plan.on_target import _candidates

    config = load_config("llama3-tiny", ["train.batch_size=32", "model.remat=dots"])
    report = {"params_bytes": 0, "optimizer_bytes": 0, "mesh": {"dp": 1, "fsdp": 8, "ep": 1, "tp": 1}}
    tried = list(_candidates(config, parse_target("v5p-16"), report))
    # 32 rows over 8 batch shards: 2 and 4 micro-batches keep a row per shard, 8 would not.
    assert tried == [["train.grad_accum=2"], ["train.grad_accum=4"], ["model.remat=full"],
                     ["model.remat=full", "train.grad_accum=4"]]
