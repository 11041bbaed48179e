"""A driver killed with SIGKILL: what it left running is ended by the next driver on its run directory."""

import json
import os
import signal
import time
from pathlib import Path

import pytest
from cluster_fixtures import finish, start, train_command

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def start_train(tmp_path, run_dir, steps, *extra):
    return start(train_command(run_dir, steps, *extra), tmp_path, run_dir.name)


def wait_for_checkpoint(run_dir: Path, proc, step: int, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while not (run_dir / "checkpoints" / str(step)).is_dir():
        assert time.time() < deadline and proc.poll() is None, f"no checkpoint of step {step} (status {proc.poll()})"
        time.sleep(0.2)


def test_a_driver_killed_with_sigkill_leaves_what_the_next_driver_on_its_run_directory_ends(tmp_path):
    """`kill -9` of the driver leaves its embedded Ray's agents running; the next
    `podtrain train` of the same run ends them first, says so in one line, and resumes."""
    run_dir = tmp_path / "killed-driver"
    proc = start_train(tmp_path, run_dir, 400, "cluster=local", "cluster.num_hosts=1", "cluster.devices_per_host=2")
    wait_for_checkpoint(run_dir, proc, 2)
    recorded = json.loads((run_dir / "driver.json").read_text())
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    proc.log.close()
    time.sleep(5)
    alive = [(pid, name) for pid, started, name in recorded["processes"]
             if Path(f"/proc/{pid}/stat").exists() and Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"]
    names = {name for _, name in alive}
    assert names & {"ray::DashboardA", "ray::RuntimeEnv"}, alive  # Ray's agents outlive their driver

    steps = max(int(d.name) for d in (run_dir / "checkpoints").iterdir() if d.name.isdigit()) + 2
    again = start_train(tmp_path, run_dir, steps, "cluster=local", "cluster.num_hosts=1", "cluster.devices_per_host=2",
                        "checkpoint.resume=auto")
    out = finish(again)
    assert again.returncode == 0, out[-4000:]
    ended = [line for line in out.splitlines() if "left running" in line]
    assert len(ended) == 1 and ended[0].startswith(f"podtrain: ended {len(alive)} processes that the killed driver "
                                                   f"(pid {proc.pid}) of this run directory left running: "), ended
    assert "ray::" in ended[0] and not (run_dir / "driver.json").exists()
    for pid, name in alive:
        stat = Path(f"/proc/{pid}/stat")
        assert not stat.exists() or stat.read_text().split()[2] == "Z", (pid, name)
    assert "resumed from step" in (run_dir / "logs" / "attempt-2" / "rank0.log").read_text()
