"""The run directory: where a run lives, and which process owns it.

`resolve_run_dir` gives `<run.dir>/<run.name, or the preset's name>` as an absolute path. Inside a
Ray job whose working directory Ray copied (`ray job submit --working-dir`), the job runs in that
temporary copy, and a relative `run.dir` would put the run there, to be lost at the next Ray restart
or code change (a new copy): it is refused. `podtrain submit` makes `run.dir` absolute on the
submitting side.

`RunLock` makes one process the owner of a run directory while it runs: the driver of a cluster run,
or the process of a `cluster=none` run. It holds an exclusive `flock` on `<run_dir>/podtrain.lock`,
whose text names the holder; a second owner gets a `RunDirectoryInUse` error naming it. The kernel
releases a lock when its holder dies, however it dies, so a killed run never leaves its directory
locked. Linux honours `flock` across hosts on NFS; on filesystems without locks (some FUSE mounts)
it guards one host only.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import socket
from pathlib import Path

from podtrain.orchestrator.common.errors import ConfigError
from podtrain.orchestrator.config.schema import Config

LOCK_FILE = "podtrain.lock"
# Ray hands a job's entrypoint its runtime environment (working_dir included) in this variable.
RAY_JOB_CONFIG_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"


class RunDirectoryInUse(ConfigError):
    """Another process owns the run directory."""


def ray_job_working_dir() -> str | None:
    """The working directory Ray shipped to the job this process runs in (its URI), or None."""
    try:
        job = json.loads(os.environ.get(RAY_JOB_CONFIG_ENV) or "{}")
    except json.JSONDecodeError:
        return None
    runtime_env = job.get("runtime_env") if isinstance(job, dict) else None
    return (runtime_env or {}).get("working_dir") if isinstance(runtime_env, dict) else None


def resolve_run_dir(config: Config, default_name: str) -> Path:
    """`<run.dir>/<run.name or default_name>`, absolute.

    Raises:
        ConfigError: `run.dir` is relative and this process is a Ray job running in Ray's copy of
            its working directory.
    """
    base = Path(config.run.dir).expanduser()
    if not base.is_absolute() and ray_job_working_dir():
        raise ConfigError(
            f"run.dir={config.run.dir!r} is relative, and this Ray job runs in Ray's temporary copy of its working "
            f"directory ({os.getcwd()}): the run would be written there and lost at the next Ray restart or code "
            "change. Give an absolute run.dir (one every host sees), or submit with `podtrain submit`, which makes "
            "it absolute"
        )
    return (base / (config.run.name or default_name)).absolute()


def checkpoint_directory(directory: str, run_dir: str | os.PathLike) -> str:
    """`checkpoint.dir` as Orbax takes it: a URL (gs://...) as is, an absolute path as is, a relative
    path under `run_dir`."""
    if "://" in directory:
        return directory
    return os.path.abspath(Path(run_dir) / Path(directory).expanduser())


def _holder() -> dict:
    return {"pid": os.getpid(), "host": socket.gethostname(),
            "since": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")}


def _describe_holder(text: str) -> str:
    try:
        holder = json.loads(text)
        return f"{holder['what']} (pid {holder['pid']} on {holder['host']}, since {holder['since']})"
    except (json.JSONDecodeError, KeyError, TypeError):
        return "another process (it has not written its name yet)"


class RunLock:
    """Holds `<run_dir>/podtrain.lock` (creating the run directory) from `__enter__` to `__exit__`.

    Args:
        run_dir: the run directory.
        what: what holds it, as a second owner will read it (e.g. "podtrain train cluster=local").
    """

    def __init__(self, run_dir: str | os.PathLike, what: str):
        self.run_dir, self.what = Path(run_dir), what
        self.path = self.run_dir / LOCK_FILE
        self._fd: int | None = None

    def __enter__(self) -> RunLock:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _describe_holder(os.read(fd, 4096).decode(errors="replace"))
                os.close(fd)
                raise RunDirectoryInUse(
                    f"run directory {self.run_dir} is in use by {holder}: two runs must not write one directory; "
                    "wait for it to end or stop it, or choose another run.name"
                ) from None
            # The previous holder removes the file as it leaves: a lock taken on a removed file is no lock.
            with contextlib.suppress(FileNotFoundError):
                if os.fstat(fd).st_ino == os.stat(self.path).st_ino:
                    break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.write(fd, (json.dumps({"what": self.what, **_holder()}) + "\n").encode())
        self._fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self._fd is None:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)  # while still holding it, so no one takes a lock on the removed file
        os.close(self._fd)
        self._fd = None
