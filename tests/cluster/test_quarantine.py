"""A host whose workers always crash is left out of the next reservations, on a Ray cluster of
several nodes (raylets on this machine, as Ray's own cluster tests run them); on TPUs, its whole slice."""

import json
import os
import time
from pathlib import Path

import pytest
from cluster_fixtures import add_fake_slice, env, fake_tpu_slices, finish, job, on_tpu, start, train_command
from xla_flags import xla_flags

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def waits_without_the_quarantined(log: Path, proc) -> None:
    """Until the driver reserves without the quarantined hosts, and a little after (it waits)."""
    deadline = time.time() + 240
    while "reserving without the quarantined hosts" not in log.read_text():
        assert time.time() < deadline and proc.poll() is None, log.read_text()[-3000:]
        time.sleep(0.5)
    time.sleep(3)


def test_a_host_whose_workers_crash_twice_is_quarantined_and_the_job_waits_for_a_spare(tmp_path, monkeypatch):
    """Two nodes of one CPU each: the second one's workers die at `import jax` (a broken library on
    that host). Two crashes blame it; the third reservation leaves it out, waits (no spare), and
    goes on when a third node joins."""
    import ray
    from ray.cluster_utils import Cluster

    e = env(tmp_path)
    for key in ("RAY_TMPDIR", "RAY_AUTH_MODE"):
        monkeypatch.setenv(key, e[key])
    (Path(e["RAY_TMPDIR"]) / "ray").mkdir(exist_ok=True)
    broken = tmp_path / "broken" / "jax"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("import os\nos.abort()\n")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "temp_dir": e["RAY_TMPDIR"],
                                                            "include_dashboard": False})
    try:
        good = os.environ.get("PYTHONPATH", "")
        monkeypatch.setenv("PYTHONPATH", f"{broken.parent}:{good}".rstrip(":"))
        bad = cluster.add_node(num_cpus=1)  # raylets inherit this process's environment
        monkeypatch.setenv("PYTHONPATH", good)
        cluster.wait_for_nodes()
        run_dir = tmp_path / "quarantine"
        proc = start(train_command(run_dir, 4, "cluster=local", "cluster.num_hosts=2", "cluster.devices_per_host=2",
                                   "cluster.cpus_per_host=1", f"cluster.address={cluster.address}",
                                   "cluster.init_timeout_s=60", "cluster.reserve_timeout_s=240",
                                   f"cluster.env.XLA_FLAGS={xla_flags(2)}"), tmp_path, run_dir.name)
        waits_without_the_quarantined(tmp_path / f"{run_dir.name}-driver.log", proc)
        assert "attempt 3: reserved" not in (tmp_path / f"{run_dir.name}-driver.log").read_text()  # no spare yet
        cluster.add_node(num_cpus=1)
        out = finish(proc)
        assert proc.returncode == 0, out[-4000:]
        assert out.count("ended: crash") == 2, out[-4000:]
        host = f"(node {bad.node_id[:8]}) is left out of the next reservations for cluster.quarantine_s=3600s: " \
               "blamed for 2 failures within cluster.quarantine_window_s=3600s, the last: crash"
        assert host in out, out[-4000:]
        job = json.loads((run_dir / "job.json").read_text())
        assert [q["node"] for q in job["quarantined"]] == [bad.node_id] and job["status"] == "succeeded", job
        assert job["restarts"] == {"crash": 2}, job
    finally:
        ray.shutdown()
        cluster.shutdown()


def test_a_tpu_slice_with_a_host_whose_workers_crash_is_left_out_whole_until_another_slice_comes(
        tmp_path, monkeypatch):
    """One v4-16 slice (2 hosts) whose second host's workers die at `import jax`: two crashes
    blame that host; the next reservation takes no slice it is in (a slice is one ICI domain), waits
    for another slice, and trains on the one that joins."""
    broken = tmp_path / "broken" / "jax"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("import os\nos.abort()\n")
    with fake_tpu_slices(tmp_path, monkeypatch, 0) as cluster:
        add_fake_slice(cluster, monkeypatch, 0, second_host_path=str(broken.parent))
        cluster.wait_for_nodes()
        bad = cluster.slices[0][1]
        run_dir = tmp_path / "tpu-quarantine"
        proc = start(train_command(run_dir, 4, *on_tpu(cluster)), tmp_path, run_dir.name)
        waits_without_the_quarantined(tmp_path / f"{run_dir.name}-driver.log", proc)
        assert "attempt 3: reserved" not in (tmp_path / f"{run_dir.name}-driver.log").read_text()  # no other slice
        add_fake_slice(cluster, monkeypatch, 1)
        out = finish(proc)
    assert proc.returncode == 0, out[-4000:]
    assert out.count("ended: crash") == 2, out[-4000:]  # the third attempt, on slice-1, did not crash
    assert f"(node {bad.node_id[:8]}) is left out of the next reservations" in out, out[-4000:]
    record = job(run_dir)
    assert [q["node"] for q in record["quarantined"]] == [bad.node_id] and record["status"] == "succeeded", record
