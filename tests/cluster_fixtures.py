"""What the Ray tests share: two simulated hosts, fake TPU slices (Ray nodes with TPU resources and
labels), the driver's command line and environment, and drivers started with their output in a
file."""

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from train_fixtures import ROOT, TINY
from xla_flags import xla_flags

TWO_HOSTS = ["cluster=local", "cluster.num_hosts=2", "cluster.devices_per_host=2", "cluster.init_timeout_s=60",
             "cluster.heartbeat_timeout_s=20", "cluster.compile_timeout_s=240"]


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


def job(run_dir: Path) -> dict:
    """The driver's record of the job (`job.json`): its status and last checkpoint."""
    return json.loads((run_dir / "job.json").read_text())


def finish(proc: subprocess.Popen, timeout: float = 420) -> str:
    """Waits for the driver and returns its output."""
    proc.wait(timeout=timeout)
    proc.log.seek(0)
    out = proc.log.read()
    proc.log.close()
    return out


TPU_NODE_ENV = {"TPU_NAME": "fake-slice", "TPU_ACCELERATOR_TYPE": "v4-16", "TPU_TOPOLOGY": "2x2x2"}


@contextlib.contextmanager
def fake_tpu_slices(tmp_path, monkeypatch, num_slices):
    """A Ray cluster of v4-16 slices (2 hosts x 4 chips each): Ray nodes with TPU resources and labels."""
    import ray
    from ray.cluster_utils import Cluster

    e = env(tmp_path)
    for key in ("RAY_TMPDIR", "RAY_AUTH_MODE", *TPU_NODE_ENV):
        monkeypatch.setenv(key, e.get(key) or TPU_NODE_ENV[key])
    (Path(e["RAY_TMPDIR"]) / "ray").mkdir(exist_ok=True)  # cluster_utils writes ray_current_cluster there
    # No dashboard: these clusters take jobs through their GCS address, not `ray job submit`.
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "temp_dir": e["RAY_TMPDIR"],
                                                            "include_dashboard": False})
    try:
        cluster.slices = {}
        for s in range(num_slices):
            add_fake_slice(cluster, monkeypatch, s)
        cluster.wait_for_nodes()
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def add_fake_slice(cluster, monkeypatch, s: int, second_host_path: str = "") -> None:
    """Slice `s` (named slice-<s>): its two hosts' Ray nodes, kept in `cluster.slices[s]`;
    `second_host_path` goes first on the second host's PYTHONPATH (a broken library there)."""
    # Ray names a reserved slice by the TPU_NAME its head host sees; raylets inherit this process's env.
    monkeypatch.setenv("TPU_NAME", f"slice-{s}")
    cluster.slices[s] = []
    path = os.environ.get("PYTHONPATH", "")
    for worker in range(2):
        resources = {"TPU": 4, **({"TPU-v4-16-head": 1} if worker == 0 else {})}
        labels = {"ray.io/tpu-slice-name": f"slice-{s}", "ray.io/tpu-worker-id": str(worker),
                  "ray.io/tpu-pod-type": "v4-16", "ray.io/tpu-topology": "2x2x2"}
        if worker == 1 and second_host_path:
            monkeypatch.setenv("PYTHONPATH", f"{second_host_path}:{path}".rstrip(":"))
        cluster.slices[s].append(cluster.add_node(num_cpus=1, resources=resources, labels=labels))
        monkeypatch.setenv("PYTHONPATH", path)


def on_tpu(cluster, num_slices=1) -> list[str]:
    return ["cluster=tpu", "cluster.tpu_type=v4-16", "cluster.reserve_timeout_s=60", f"cluster.num_slices={num_slices}",
            f"cluster.address={cluster.address}", "cluster.env.JAX_PLATFORMS=cpu", "cluster.init_timeout_s=60",
            f"cluster.env.XLA_FLAGS={xla_flags(2)}"]
