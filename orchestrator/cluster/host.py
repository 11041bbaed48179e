"""The host actor: one per host (TPU VM, GPU node, simulated host); starts and watches its JAX process.

The actor never imports JAX (a TPU's libtpu may be opened by one process only, and a stale one in
the actor would block every later attempt). For each attempt it starts a fresh OS process in its
own process group, with the environment set before the worker imports JAX, and reports the
process's exit status, heartbeat and new log lines when the driver polls it.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from podtrain.orchestrator.common import protocol as p

# Lock files libtpu leaves behind when its process is killed; the next process would wait on them.
TPU_LOCK_FILES = ("/tmp/libtpu_lockfile", "/tmp/tpu_logs/libtpu_lockfile")


def port_is_free(port: int, host: str = "") -> bool:
    """Whether a coordinator could bind `port` on this host.

    IPv4 is the check that matters: gRPC (JAX's coordination service) binds `[::]` dual-stack and
    falls back to `0.0.0.0` when that fails, so a port held on IPv6 only does not stop it, while
    one held on any IPv4 address (or dual-stack) does.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def process_state(pid: int) -> str | None:
    """The kernel's state letter for a process (R running, S sleeping, T stopped, D in I/O...), or
    None where /proc does not tell (another OS, or the process is gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return None


def free_port(host: str = "") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class HostActor:
    """Runs one worker process per attempt on its host (the Ray actor class is made by the driver)."""

    def __init__(self, host_index: int):
        self.host_index = host_index
        self.proc: subprocess.Popen | None = None
        self.files: dict[str, Path] = {}
        self.log_offset = 0
        self.started_at = 0.0
        self.ended_at: float | None = None  # when a poll first found the worker ended

    def info(self) -> dict:
        """Where this actor runs: node IP, hostname, and what Ray gave it (GPU ids, TPU variables)."""
        import ray

        # Ray's ids are ints, or strings (even UUIDs) when the node was started with CUDA_VISIBLE_DEVICES.
        gpu_ids = [str(i) for i in ray.get_gpu_ids()]
        if all(i.isdigit() for i in gpu_ids):
            gpu_ids.sort(key=int)
        return {
            "host_index": self.host_index,
            "ip": ray.util.get_node_ip_address(),
            "hostname": socket.gethostname(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "gpu_ids": gpu_ids,
            "tpu_env": {k: v for k, v in os.environ.items() if k.startswith(("TPU_", "MEGASCALE_"))},
            "labels": dict(ray.get_runtime_context().get_node_labels() or {}),
        }

    def pick_port(self, preferred: int) -> int:
        """`preferred` when it is free on this host, else a free port."""
        if preferred and port_is_free(preferred):
            return preferred
        return free_port()

    def start(self, env: dict[str, str], config_yaml: str, attempt_dir: str, rank: int) -> int:
        """Starts the worker process of this attempt; returns its pid."""
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError(f"host {self.host_index}: the previous worker (pid {self.proc.pid}) still runs")
        directory = Path(attempt_dir)
        directory.mkdir(parents=True, exist_ok=True)
        self.files = {
            "config": directory / f"config-rank{rank}.yaml",
            "log": directory / f"rank{rank}.log",
            "heartbeat": directory / f"rank{rank}.heartbeat",
            "error": directory / f"rank{rank}.error",
            "stacks": directory / f"rank{rank}.stacks",
        }
        self.files["config"].write_text(config_yaml)
        for key in ("heartbeat", "error"):
            self.files[key].unlink(missing_ok=True)
        # MEGASCALE_* come from the driver for several slices only: ones left in this node's
        # environment (a multi-slice pod) would make a single-slice run look for other slices.
        inherited = {k: v for k, v in os.environ.items() if not k.startswith("MEGASCALE_")}
        worker_env = {
            **inherited, **env,
            p.ENV_CONFIG: str(self.files["config"]),
            p.ENV_HEARTBEAT_FILE: str(self.files["heartbeat"]),
            p.ENV_ERROR_FILE: str(self.files["error"]),
            p.ENV_STACKS_FILE: str(self.files["stacks"]),
            p.ENV_PARENT_PID: str(os.getpid()),
            "PYTHONUNBUFFERED": "1",
        }
        log = open(self.files["log"], "ab")  # noqa: SIM115 (the child holds it; closed after Popen)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "podtrain.orchestrator.cluster.worker"], env=worker_env, stdout=log,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True, cwd=os.getcwd(),
            )
        finally:
            log.close()
        self.log_offset, self.started_at, self.ended_at = 0, time.time(), None
        (directory / f"rank{rank}.pid").write_text(f"{self.proc.pid}\n")
        return self.proc.pid

    def poll(self) -> dict:
        """The worker's exit status (None while it runs), last heartbeat (its step, phase and notice),
        and log lines since the last poll."""
        status = None if self.proc is None else self.proc.poll()
        if status is not None and self.ended_at is None:
            self.ended_at = time.time()
        lines = []
        log = self.files.get("log")
        if log is not None and log.exists():
            with open(log, "rb") as f:
                f.seek(self.log_offset)
                data = f.read()
            end = data.rfind(b"\n") + 1 if status is None else len(data)  # whole lines while it runs
            lines = data[:end].decode("utf-8", "replace").splitlines()
            self.log_offset += end
        error = self.files.get("error")
        beat = p.read_heartbeat(self.files["heartbeat"]) if "heartbeat" in self.files else None
        return {
            "returncode": status,
            "pid": None if self.proc is None else self.proc.pid,
            "state": None if self.proc is None or status is not None else process_state(self.proc.pid),
            "heartbeat": (beat.step, beat.at) if beat else None,
            "phase": beat.phase if beat else "start",  # before its first beat the process is starting
            "phase_at": beat.at if beat else self.started_at,
            "notice": beat.notice if beat else "",
            "lines": lines,
            "error": error.read_text() if status is not None and error is not None and error.exists() else None,
            "error_at": error.stat().st_mtime if status is not None and error is not None and error.exists() else None,
            "started_at": self.started_at,
            "ended_at": self.ended_at,
            "now": time.time(),
        }

    def send_signal(self, signum: int) -> None:
        """Sends `signum` to the worker's whole process group (no-op when it has exited)."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signum)

    def dump_stacks(self, path: str) -> str:
        """Writes the worker's Python stacks to `path`: py-spy (works on a stopped process), else faulthandler."""
        if self.proc is None or self.proc.poll() is not None:
            return "no running worker"
        out = ""
        py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
        if os.path.exists(py_spy):
            try:
                # --nonblocking reads the stacks without suspending the process (which fails on a stopped one).
                done = subprocess.run([py_spy, "dump", "--nonblocking", "--pid", str(self.proc.pid)],
                                      capture_output=True, text=True, timeout=30)
                out = done.stdout if done.returncode == 0 else f"py-spy failed ({done.returncode}): {done.stderr}"
            except subprocess.TimeoutExpired:
                out = "py-spy dump timed out after 30 s"
        if not out.startswith("Process"):  # py-spy missing or failed: ask the worker's faulthandler
            self.send_signal(signal.SIGUSR1)
            self.send_signal(signal.SIGCONT)  # a stopped process handles the signal only once it runs
            time.sleep(2.0)
            stacks = self.files["stacks"]
            out += "\nfaulthandler:\n" + (stacks.read_text() if stacks.exists() else "(nothing written)")
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(out)
        return out

    def kill(self) -> int | None:
        """SIGKILLs the worker's process group, waits for it, then removes TPU lock files. Returns its status."""
        if self.proc is None:
            return None
        try:
            os.killpg(self.proc.pid, signal.SIGCONT)  # a stopped process must run to die of SIGKILL promptly
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        status = self.proc.wait()
        for pattern in TPU_LOCK_FILES:
            for lock in glob.glob(pattern):
                Path(lock).unlink(missing_ok=True)
        return status
