"""What a host actor and the worker process it starts agree on: environment names, files, exit codes.

Nothing here imports JAX: host actors and the driver never do.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import NamedTuple

from podtrain.orchestrator.common.files import write_atomic

# Exit statuses of a worker process.
EXIT_OK = 0
EXIT_EXCEPTION = 1  # an exception in the training code; its traceback is in the error file
EXIT_CONFIG = 2  # a mistake in the config or the data it names (the same on every retry: not retried)
EXIT_PREEMPTED = 75  # stopped on a preemption notice after committing a checkpoint (EX_TEMPFAIL)
EXIT_COORDINATOR_PORT = 76  # the coordinator could not bind its port: retry on another one

# Environment of a worker process (set by the host actor before JAX is imported).
ENV_CONFIG = "PODTRAIN_CONFIG"  # path of the resolved config YAML
ENV_RUN_DIR = "PODTRAIN_RUN_DIR"
ENV_COORDINATOR = "PODTRAIN_COORDINATOR"  # host:port of process 0's coordination service
ENV_NUM_PROCESSES = "PODTRAIN_NUM_PROCESSES"
ENV_PROCESS_ID = "PODTRAIN_PROCESS_ID"
ENV_LOCAL_DEVICE_IDS = "PODTRAIN_LOCAL_DEVICE_IDS"  # comma-separated, or unset for all
ENV_INIT_TIMEOUT = "PODTRAIN_INIT_TIMEOUT_S"
ENV_HEARTBEAT_TIMEOUT = "PODTRAIN_HEARTBEAT_TIMEOUT_S"
ENV_HEARTBEAT_FILE = "PODTRAIN_HEARTBEAT_FILE"  # the worker writes its last completed step here
ENV_ERROR_FILE = "PODTRAIN_ERROR_FILE"  # what ended the worker: `write_error`'s JSON
ENV_STACKS_FILE = "PODTRAIN_STACKS_FILE"  # faulthandler writes every thread's stack here on SIGUSR1
ENV_PARENT_PID = "PODTRAIN_PARENT_PID"  # the worker exits when this process (its host actor) is gone
ENV_ATTEMPT = "PODTRAIN_ATTEMPT"  # the driver's attempt number, for the goodput ledger
ENV_ROLE = "PODTRAIN_ROLE"  # "serve" for `podtrain serve`'s engine; unset: training
ENV_SERVE_ADDRESS = "PODTRAIN_SERVE_ADDRESS"  # host:port of the driver's step channel (serve)
ENV_SERVE_AUTHKEY = "PODTRAIN_SERVE_AUTHKEY"  # the channel's key, hex


# What a worker is doing, in the order an attempt goes through them. Its heartbeat names the phase
# and when it began (for `step`, when the last step ended); the driver gives each phase its own
# timeout (`PHASE_TIMEOUTS`) and names the ranks that have not reached the phase the others wait in.
PHASES = ("start", "distributed", "restore", "compile", "step", "save", "commit", "serve")
PHASE_TIMEOUTS = {  # the `cluster` key bounding each phase
    "start": "start_timeout_s",  # process start, imports and input checks, to the first heartbeat
    "distributed": "init_timeout_s",  # jax.distributed initialisation: every rank joins
    "restore": "restore_timeout_s",  # building the model, loading a base, restoring a checkpoint
    "compile": "compile_timeout_s",  # the first compile of a program, and the barrier after it
    "step": "hang_timeout_s",  # from one completed training step to the next
    "save": "save_timeout_s",  # the blocking part of a checkpoint save
    "commit": "commit_timeout_s",  # waiting for an async save to commit
    "serve": "hang_timeout_s",  # a serve worker: between engine steps it beats every few seconds
}
PHASE_NAMES = {
    "start": "started its process", "distributed": "joined jax.distributed", "restore": "restored its state",
    "compile": "compiled", "step": "finished a step", "save": "saved a checkpoint",
    "commit": "committed a checkpoint", "serve": "served a step",
}


class Beat(NamedTuple):
    step: int  # the last completed step
    at: float  # wall time the phase began (for `step`: the last step ended)
    phase: str
    notice: str  # "preempting": a serve worker received a preemption notice


def write_heartbeat(path: str | os.PathLike, step: int, phase: str = "step", notice: str = "",
                    at: float | None = None) -> None:
    """Records the last completed `step`, the `phase` the worker is in since `at` (now by
    default), and a `notice` the driver acts on, atomically (a reader never sees half a line)."""
    write_atomic(path, f"{step} {time.time() if at is None else at:.3f} {phase} {notice}".rstrip() + "\n")


def read_heartbeat(path: str | os.PathLike) -> Beat | None:
    """The last `Beat` written to `path`, or None before the first."""
    try:
        step, at, phase, *notice = Path(path).read_text().strip().split(maxsplit=3)
        return Beat(int(step), float(at), phase, notice[0] if notice else "")
    except (OSError, ValueError):
        return None


class Heartbeat:
    """A worker's side of its heartbeat file (`path` None: a process nobody watches, writes nothing)."""

    def __init__(self, path: str | os.PathLike | None):
        self.path, self.step, self.current, self.notice = path, 0, "start", ""

    def phase(self, name: str) -> None:
        """Enters phase `name` now."""
        assert name in PHASES, name
        self.current = name
        self._write()

    def stepped(self, step: int) -> None:
        """A step completed: the `step` phase starts again from now."""
        self.step, self.current = step, "step"
        self._write()

    def noticed(self, notice: str) -> None:
        self.notice = notice
        self._write()

    def beat(self) -> None:
        """The same phase, begun now (an idle serve worker shows it is alive)."""
        self._write()

    def _write(self) -> None:
        if self.path:
            write_heartbeat(self.path, self.step, self.current, self.notice)


def describe_exception(error: BaseException, max_chars: int = 300) -> str:
    """The exception's type and first meaningful line (a line with a letter or digit: Orbax's
    errors run over many lines and end in `})>.`), and the same of its cause when it has one."""

    def first_line(e: BaseException) -> str:
        line = next((line.strip() for line in str(e).splitlines() if re.search(r"\w", line)), "")
        line = line if len(line) <= max_chars else line[:max_chars] + "..."
        return f"{type(e).__name__}: {line}" if line else type(e).__name__

    cause = error.__cause__
    return first_line(error) + (f" (caused by {first_line(cause)})" if cause is not None else "")


def write_error(path: str | os.PathLike, kind: str, summary: str, traceback: str = "") -> None:
    """Records what ended a worker: `kind` "config" (a mistake in the input; `summary` is the message
    for the user) or "exception" (`summary` from `describe_exception`, and the traceback)."""
    Path(path).write_text(json.dumps({"kind": kind, "summary": summary, "traceback": traceback}) + "\n")


def read_error(text: str | None) -> dict | None:
    """`write_error`'s record, or None when there is none (the worker died before writing one)."""
    if not text:
        return None
    try:
        record = json.loads(text)
    except json.JSONDecodeError:
        return None
    return record if isinstance(record, dict) else None
