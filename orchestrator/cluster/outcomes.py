"""How an attempt and a job end, and which budget each ending draws on (see `driver`)."""

from __future__ import annotations

import dataclasses
import enum

from podtrain.orchestrator.common import protocol as p


class Ending(enum.StrEnum):
    """How one attempt ended: its class in the driver's restart rules."""

    DONE = "done"
    STOPPED = "stopped"
    PREEMPTED = "preempted"
    NODE_LOST = "node_lost"
    CRASH = "crash"
    EXCEPTION = "exception"
    HANG = "hang"
    PORT = "port"
    RESERVATION = "reservation"
    CONFIG = "config"


class JobStatus(enum.StrEnum):
    """How a job ended."""

    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"


# What each ending draws on: a preemption budget (`cluster.max_preemptions`) and a failure one
# (`cluster.max_failures`); a reservation failure right after a preemption is part of it.
PREEMPTION_CLASSES = (Ending.PREEMPTED, Ending.NODE_LOST)
FAILURE_CLASSES = (Ending.CRASH, Ending.EXCEPTION, Ending.HANG, Ending.RESERVATION)


@dataclasses.dataclass
class Outcome:
    """How one attempt ended."""

    kind: Ending
    rank: int | None = None
    detail: str = ""
    traceback: str | None = None
    phase: str | None = None  # for a hang: the phase that ran past its timeout


@dataclasses.dataclass
class JobResult:
    """How a job ended: what `job.json` records and the driver prints."""

    status: JobStatus
    reason: str
    attempts: int
    restarts: dict[str, int]
    last_step: int | None
    last_checkpoint: int | None
    run_dir: str

    @property
    def exit_code(self) -> int:
        return {JobStatus.SUCCEEDED: 0, JobStatus.STOPPED: p.EXIT_PREEMPTED}.get(self.status, 1)


@dataclasses.dataclass
class Budgets:
    """What the restarts so far have drawn on `cluster.max_failures` and `cluster.max_preemptions`."""

    max_failures: int
    max_preemptions: int
    failures: int = 0
    preemptions: int = 0
    cause: Ending | None = None  # the class of the last attempt that was not a reservation failure

    def charge(self, kind: Ending) -> str | None:
        """Draws an attempt that ended as `kind` on its budget; returns why the job fails if that is spent."""
        after_preemption = kind == Ending.RESERVATION and self.cause in PREEMPTION_CLASSES
        if kind != Ending.RESERVATION:
            self.cause = kind
        if kind in PREEMPTION_CLASSES or after_preemption:
            self.preemptions += 1
            if self.preemptions > self.max_preemptions:
                return f"{self.preemptions} preemptions, more than cluster.max_preemptions={self.max_preemptions}"
            return None
        self.failures += 1
        if self.failures > self.max_failures:
            return f"{self.failures} failures, more than cluster.max_failures={self.max_failures}"
        return None
