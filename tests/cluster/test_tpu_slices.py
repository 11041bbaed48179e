"""Fake TPU slices on a real Ray cluster (Ray nodes with TPU resources and labels, 2 hosts x 4 chips
each): slices reserved whole, one JAX process per host with the multi-slice environment, and a
mistake the hosts find themselves reported once."""

import re

import pytest
from cluster_fixtures import fake_tpu_slices, job, on_tpu, run_train

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
