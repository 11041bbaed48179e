"""What the Ray tests share: two simulated hosts, the driver's command line and environment, and
drivers started with their output in a file."""

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from train_fixtures import ROOT, TINY
from xla_flags import xla_flags

TWO_HOSTS = ["cluster=local", "cluster.num_hosts=2", "cluster.devices_per_host=2", "cluster.init_timeout_s=60",
             "cluster.heartbeat_timeout_s=20", "cluster.startup_timeout_s=240"]


def ray_tmpdir(tmp_path: Path) -> str:
    """A short directory for Ray's session files (its socket paths must stay under 108 bytes)."""
    link = tmp_path / "ray"
    if not link.exists():
        link.symlink_to(tempfile.mkdtemp(prefix="ray", dir="/tmp"))
    return os.readlink(link)


def env(tmp_path: Path, devices: int = 2) -> dict:
    return dict(os.environ, PYTHONPATH=str(ROOT), RAY_TMPDIR=ray_tmpdir(tmp_path), RAY_AUTH_MODE="disabled",
                XLA_FLAGS=xla_flags(devices),
                PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")


def train_command(run_dir: Path, steps: int, *extra: str, every: int = 2) -> list[str]:
    return [sys.executable, "-m", "podtrain.launch.cli", "train", "-c", "llama3-tiny", *TINY, f"train.steps={steps}",
            f"checkpoint.every_steps={every}", f"run.dir={run_dir.parent}", f"run.name={run_dir.name}", *extra]


def run_train(tmp_path, run_dir, steps, *extra, devices=2, timeout=420) -> subprocess.CompletedProcess:
    return subprocess.run(train_command(run_dir, steps, *extra), cwd=ROOT, env=env(tmp_path, devices),
                          capture_output=True, text=True, timeout=timeout)


def start(command: list[str], tmp_path: Path, name: str, devices: int = 2) -> subprocess.Popen:
    """Starts `command` with its output in a file (a pipe nobody reads until the end could fill
    and stall it); `finish` returns it."""
    log = open(tmp_path / f"{name}-driver.log", "w+")  # noqa: SIM115 (closed by finish)
    proc = subprocess.Popen(command, cwd=ROOT, env=env(tmp_path, devices), stdout=log, stderr=subprocess.STDOUT,
                            text=True)
    proc.log = log
    return proc


def finish(proc: subprocess.Popen, timeout: float = 420) -> str:
    """Waits for the driver and returns its output."""
    proc.wait(timeout=timeout)
    proc.log.seek(0)
    out = proc.log.read()
    proc.log.close()
    return out
