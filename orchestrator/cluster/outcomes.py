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
    RESIZED = "resized"  # an elastic job saved to grow back to all its slices


class JobStatus(enum.StrEnum):
    """How a job ended."""

    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"
    RUNNING = "running"  # job.json between attempts


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
    fault_at: float | None = None  # when the fault began, as near as the driver can tell


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
    history: list[dict] = dataclasses.field(default_factory=list)  # `Attempt.record()` of each attempt
    quarantined: list[dict] = dataclasses.field(default_factory=list)  # `Quarantine.record()`

    @property
    def exit_code(self) -> int:
        return {JobStatus.SUCCEEDED: 0, JobStatus.STOPPED: p.EXIT_PREEMPTED}.get(self.status, 1)


@dataclasses.dataclass
class Attempt:
    """One attempt of a job and what its ending cost: job.json's `history`, `podtrain status`.

    `detect_s` runs from the fault (a stalled rank's last progress, a process's exit, the last
    answer of a lost host) to the driver's report; `restart_s` from that report to the next
    attempt's first step (a service: its engine ready); `steps_redone` are the steps this attempt
    trained past the checkpoint the next one resumed from."""

    attempt: int
    started_at: float
    start_step: int | None  # the checkpoint it resumed from (None: the run's start)
    first_step_at: float | None = None
    last_step: int | None = None
    ended: str | None = None
    rank: int | None = None
    phase: str | None = None
    detail: str = ""
    detected_at: float | None = None
    detect_s: float | None = None
    restart_s: float | None = None
    steps_redone: int | None = None
    slices: int | None = None  # the TPU slices it ran on (an elastic job's change)

    def end(self, outcome: Outcome, now: float) -> None:
        self.ended, self.rank, self.phase, self.detail = str(outcome.kind), outcome.rank, outcome.phase, outcome.detail
        self.detected_at = now
        if outcome.fault_at is not None:
            self.detect_s = round(max(0.0, now - outcome.fault_at), 3)

    def recovered_by(self, after: Attempt) -> None:
        """`after`, the next attempt, took its first step."""
        self.restart_s = round(after.first_step_at - self.detected_at, 3)
        if self.last_step is not None:
            self.steps_redone = max(0, self.last_step - (after.start_step or 0))

    def record(self) -> dict:
        return dataclasses.asdict(self)


# The endings a host is blamed for (when the ending names its rank).
BLAMED_CLASSES = (Ending.CRASH, Ending.EXCEPTION, Ending.HANG, Ending.NODE_LOST)


@dataclasses.dataclass
class Quarantine:
    """Hosts (Ray nodes) blamed for failures: one blamed `STRIKES` times within `window_s` is left
    out of reservations for `duration_s` (0: never)."""

    window_s: float
    duration_s: float
    blamed: dict[str, list[float]] = dataclasses.field(default_factory=dict)  # node -> when
    until: dict[str, float] = dataclasses.field(default_factory=dict)  # quarantined node -> when it comes back
    why: dict[str, str] = dataclasses.field(default_factory=dict)
    hosts: dict[str, str] = dataclasses.field(default_factory=dict)  # node -> "hostname ip"
    spares: bool = True  # whether another node can take a quarantined one's place (not on an embedded Ray)

    STRIKES = 2

    def blame(self, node: str, host: str, why: str, now: float) -> str | None:
        """Counts a failure against `node`; a line saying so when that quarantines it."""
        if not self.duration_s or not node:
            return None
        self.hosts[node] = host
        times = [t for t in self.blamed.get(node, []) if now - t <= self.window_s] + [now]
        self.blamed[node] = times
        if len(times) < self.STRIKES or node in self.until:
            return None
        blamed = (f"blamed for {len(times)} failures within cluster.quarantine_window_s={self.window_s:g}s, "
                  f"the last: {why}")
        if not self.spares:
            self.blamed[node] = []
            return f"host {host} (node {node[:8]}) is {blamed}; it stays in use: an embedded Ray has no other host"
        self.until[node] = now + self.duration_s
        self.why[node] = blamed
        return (f"host {host} (node {node[:8]}) is left out of the next reservations for cluster.quarantine_s="
                f"{self.duration_s:g}s: {self.why[node]}")

    def lift(self) -> None:
        """Ends every quarantine now (no spare came: the quarantined hosts are used again)."""
        self.until.clear()
        self.blamed.clear()

    def excluded(self, now: float) -> frozenset[str]:
        """The nodes quarantined at `now` (those whose time is up come back)."""
        for node in [n for n, t in self.until.items() if t <= now]:
            del self.until[node]
            self.blamed.pop(node, None)
        return frozenset(self.until)

    def record(self) -> list[dict]:
        return [{"node": node, "host": self.hosts.get(node, ""), "until": until, "why": self.why[node]}
                for node, until in self.until.items()]


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
