"""Fake TPU slices on a real Ray cluster (Ray nodes with TPU resources and labels, 2 hosts x 4 chips
each): slices reserved whole, one JAX process per host with the multi-slice environment, and a
mistake the hosts find themselves reported once."""

import re
import time

import pytest
from cluster_fixtures import add_fake_slice, fake_tpu_slices, finish, job, on_tpu, run_train, start, train_command
from train_fixtures import losses, wait_for_step

pytestmark = [pytest.mark.ray, pytest.mark.slow]


RAY_LOG_LINE = re.compile(r"^\[\d{4}-\d\d-\d\d [\d:,]+ [DIWE] \d+ \d+\] ")


@pytest.mark.parametrize("num_slices", [1, 2])
def test_fake_tpu_slices_are_reserved_whole_and_train(tmp_path, monkeypatch, num_slices):
    with fake_tpu_slices(tmp_path, monkeypatch, num_slices) as cluster:
        run_dir = tmp_path / f"tpu-{num_slices}"
        mesh = [f"mesh.dp={num_slices}", "mesh.fsdp=1", "mesh.tp=4"] if num_slices > 1 else []
        done = run_train(tmp_path, run_dir, 2, *on_tpu(cluster, num_slices), *mesh, devices=2)
        assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
        assert f"reserved {2 * num_slices} hosts" in done.stdout
        hosts = 2 * num_slices
        logs = [(run_dir / "logs" / "attempt-1" / f"rank{r}.log").read_text() for r in range(hosts)]
        for rank, log in enumerate(logs):
            assert f"process {rank} of {hosts}, 2 local of {2 * hosts} cpu devices" in log, log[-2000:]
            if num_slices > 1:
                slice_id = rank // 2
                assert f"MEGASCALE_NUM_SLICES={num_slices}" in log and f"MEGASCALE_SLICE_ID={slice_id}" in log
                assert "MEGASCALE_COORDINATOR_ADDRESS=" in log and "MEGASCALE_PORT=" in log
            else:
                assert "MEGASCALE_" not in log
        if num_slices > 1:  # dp spans the slices; everything else stays inside one
            assert "'slices': 2, 'dp_slices': [[0], [1]]" in logs[0], logs[0][-3000:]
        assert job(run_dir)["status"] == "succeeded"


def test_a_mistake_the_hosts_find_is_one_line_exit_2_and_a_rerun_keeps_the_first_runs_logs(tmp_path, monkeypatch):
    """The hosts of a pod slice check their data themselves (the driver need not see their files):
    every worker finds the missing path before joining the JAX world and leaves at once; the driver
    reports it once. Running the run name again neither overwrites nor re-reads the first job's logs."""
    with fake_tpu_slices(tmp_path, monkeypatch, 1) as cluster:
        run_dir = tmp_path / "no-data"
        first_logs = {}
        for attempt in (1, 2):
            done = run_train(tmp_path, run_dir, 4, *on_tpu(cluster), "data.source=jsonl",
                             f"data.path={tmp_path}/missing.jsonl", devices=2)
            assert done.returncode == 2, (done.stdout + done.stderr)[-4000:]
            # Ray's own warning lines ("[<date> W ...] network_util.cc: Failed to determine local IP via
            # external connectivity"), printed here because this network namespace has no route out.
            lines = [line for line in done.stderr.splitlines() if not RAY_LOG_LINE.match(line)]
            assert len(lines) == 1 and lines[0].startswith("podtrain: error: data.path="), done.stderr
            assert "missing.jsonl" in lines[0]
            assert "missing.jsonl" not in done.stdout and f"attempt {attempt}: started 2 worker" in done.stdout
            assert not (run_dir / "job.json").exists() and not (run_dir / "config.yaml").exists()
            if attempt == 1:
                first_logs = {p.name: p.read_text() for p in (run_dir / "logs" / "attempt-1").glob("rank*.log")}
        assert first_logs == {p.name: p.read_text() for p in (run_dir / "logs" / "attempt-1").glob("rank*.log")}
        # The rank that fails first ends the attempt; the other may be stopped before it reports its own.
        assert any("missing.jsonl" in log for log in first_logs.values())
        assert not any("Traceback" in log for log in first_logs.values())
        assert (run_dir / "logs" / "attempt-2" / "rank0.log").exists()


def test_an_elastic_job_goes_on_with_one_slice_when_the_other_is_lost_and_grows_back_when_it_returns(
        tmp_path, monkeypatch):
    """Two slices; slice 1 (both its hosts) is lost after step 11: the job waits
    `cluster.elastic_wait_s`, restarts from its checkpoint on slice 0 alone (dp 2 -> 1, gradient
    accumulation 1 -> 2), and when slice 1 is back it saves where it is and grows to both again. Every
    step's loss equals that of a run on one process with the two-slice mesh, and the grow redoes no step."""
    # Enough steps for the slice to come back while the job runs on one.
    steps, fixed = 100, ["mesh.dp=2", "mesh.fsdp=1", "mesh.tp=4", "optimizer.schedule=constant"]
    reference = tmp_path / "fixed"
    done = run_train(tmp_path, reference, steps, "cluster=none", *fixed, devices=8)
    assert done.returncode == 0, done.stderr[-3000:]
    want = losses(reference)
    with fake_tpu_slices(tmp_path, monkeypatch, 2) as cluster:
        run_dir = tmp_path / "elastic"
        proc = start(train_command(run_dir, steps, *on_tpu(cluster, 2), *fixed, "cluster.elastic=true",
                                   "cluster.elastic_wait_s=5", "cluster.hang_timeout_s=60", every=10), tmp_path,
                     run_dir.name)
        log = tmp_path / f"{run_dir.name}-driver.log"
        wait_for_step(run_dir, proc, 11)
        for node in cluster.slices[1]:
            cluster.remove_node(node)
        deadline = time.time() + 240
        while "restarting on 1 of 2 slices" not in log.read_text():
            assert time.time() < deadline and proc.poll() is None, log.read_text()[-4000:]
            time.sleep(0.5)
        shrunk_at = max(losses(run_dir))
        wait_for_step(run_dir, proc, shrunk_at + 1)  # trained on one slice
        add_fake_slice(cluster, monkeypatch, 1)
        out = finish(proc)
    assert proc.returncode == 0, out[-4000:]
    assert ("the lost slice is not back within cluster.elastic_wait_s=5s: restarting on 1 of 2 slices, mesh.dp=1, "
            "train.grad_accum=2 (the same global batch of 4)") in out
    assert "slices free again: the gang saves at the step it agrees on and restarts on all 2" in out, out[-4000:]
    record = job(run_dir)
    assert record["status"] == "succeeded" and record["restarts"] == {"node_lost": 1, "resized": 1}, record
    lost, one, grown = record["history"]
    assert (lost["slices"], one["slices"], grown["slices"]) == (2, 1, 2)
    assert one["ended"] == "resized" and one["steps_redone"] == 0 and grown["start_step"] == one["last_step"]
    assert "'slices': 1, 'dp_slices': [[0]]" in (run_dir / "logs" / "attempt-2" / "rank0.log").read_text()
    after = losses(run_dir)
    assert sorted(after) == list(range(1, steps + 1))
    for step in want:
        assert after[step] == pytest.approx(want[step], rel=1e-5), (step, after[step], want[step])
