"""A hung gang, named: which rank is past its phase's timeout, which ranks have not arrived, and
which rank holds the others up (`blame`). Pure functions of the host actors' polls; the driver
acts on them; and how the processes that ended together ended (`classify`)."""

from __future__ import annotations

import re
import signal

from podtrain.orchestrator.cluster.outcomes import Ending, Outcome
from podtrain.orchestrator.common import protocol as p


def _main_thread(stacks: str, pid: int | None) -> str | None:
    """What py-spy says of a process's main thread ("active", "active+gil", "idle"), or None."""
    found = re.search(rf"^Thread {pid} \(([^)]*)\)", stacks, re.MULTILINE) if pid else None
    return found.group(1) if found else None


def is_stopped(poll: dict) -> bool:
    return poll.get("state") in ("T", "t")  # SIGSTOP or a debugger


def position(poll: dict) -> tuple[int, int]:
    """How far a rank has come: its last completed step, then its phase in `PHASES` order."""
    return (poll["heartbeat"] or (0, 0.0))[0], p.PHASES.index(poll["phase"]) if poll["phase"] in p.PHASES else 0


def where(poll: dict) -> str:
    """`at step 3` (between steps), or `in phase save after step 4`."""
    step = (poll["heartbeat"] or (0, 0.0))[0]
    if poll["phase"] == "step":
        return f"at step {step}"
    return f"in phase {poll['phase']}" + (f" after step {step}" if step else "")


def describe_rank(rank: int, poll: dict, info: dict | None) -> str:
    """`rank 1 (host h 10.0.0.2, node 1a2b3c4d, pid 123, in phase start)`: enough to find the process."""
    info = info or {}
    host = " ".join(x for x in (info.get("hostname"), info.get("ip")) if x) or "?"
    return (f"rank {rank} (host {host}, node {str(info.get('node_id') or '?')[:8]}, pid {poll.get('pid')}, "
            f"{where(poll)})")


def overdue(polls: list[dict], cluster) -> tuple[int, str, float, float] | None:
    """The first running rank that has been in its phase past the phase's timeout
    (`protocol.PHASE_TIMEOUTS`): (rank, phase, seconds in it, limit), or None."""
    for rank, poll in enumerate(polls):
        if poll["returncode"] is not None:
            continue
        phase = poll["phase"] if poll["phase"] in p.PHASE_TIMEOUTS else "step"
        idle, limit = poll["now"] - poll["phase_at"], getattr(cluster, p.PHASE_TIMEOUTS[phase])
        if idle > limit:
            return rank, phase, idle, limit
    return None


def hang_outcome(polls: list[dict], stacks: list[str], late: tuple[int, str, float, float], infos: list[dict],
                 cluster) -> Outcome:
    """The hang `overdue` found, named: its phase and timeout, the ranks waiting in it, the ranks that
    have not arrived (rank, host, Ray node, pid, where they are), and the rank blamed."""
    first, phase, idle, limit = late
    running = [r for r, poll in enumerate(polls) if poll["returncode"] is None]
    mark = position(polls[first])
    missing = [r for r in running if position(polls[r]) < mark]
    waiting = [r for r in running if position(polls[r]) >= mark]
    rank, why = blame(polls, stacks, first)

    def named(r: int) -> str:
        return describe_rank(r, polls[r], infos[r] if r < len(infos) else None)

    line = (f"phase {phase} ran past cluster.{p.PHASE_TIMEOUTS[phase]}={limit:g}s (rank {first} in it for "
            f"{idle:.0f}s); ")
    if missing:
        line += (f"waiting: ranks {waiting}; not arrived (has not {p.PHASE_NAMES[phase]}): "
                 + ", ".join(named(r) for r in missing))
    else:
        line += f"every rank is in it; blamed: {named(rank)}"
    return Outcome(Ending.HANG, rank, f"{why}; {line}", phase=phase, fault_at=polls[rank]["phase_at"])


def blame(polls: list[dict], stacks: list[str], first: int) -> tuple[int, str]:
    """The rank that holds the gang up, and why, once `first` (the first rank past its phase's
    timeout) was found idle. All ranks usually stop in the same place (each waits in a collective or
    a barrier for the one that stopped), so the heartbeats alone often cannot tell; the processes
    can: a stopped one (state T), one behind the others (an earlier step or phase), or the one
    whose main thread runs Python while the others' wait."""
    running = [r for r, poll in enumerate(polls) if poll["returncode"] is None]
    stopped = [r for r in running if is_stopped(polls[r])]
    if stopped:
        return stopped[0], f"rank {stopped[0]}'s process is stopped (state T: SIGSTOP or a debugger)"
    positions = {r: position(polls[r]) for r in running}
    if len(set(positions.values())) > 1:
        behind = min(positions, key=lambda r: (positions[r], r))
        others = next(polls[r] for r in running if positions[r] == max(positions.values()))
        return behind, f"rank {behind} is behind ({where(polls[behind])}, others {where(others)})"
    threads = {r: _main_thread(stacks[r] if r < len(stacks) else "", polls[r].get("pid")) for r in running}
    active = [r for r, state in threads.items() if state and state.startswith("active")]
    if active and len(active) < len([state for state in threads.values() if state]):
        return active[0], f"rank {active[0]}'s main thread is running while the other ranks wait"
    return first, "every rank waits"


def classify(ended: list[tuple[int, int]], polls: list[dict]) -> Outcome:
    """The cause among the processes that ended together: preemption, then crash, then exception,
    then abort. JAX aborts (SIGABRT) a process whose peer died, so an abort next to another
    ending is that ending's consequence, not its cause."""
    def kind(code) -> Ending | None:  # None: an abort, a peer's consequence unless alone
        return {p.EXIT_PREEMPTED: Ending.PREEMPTED, p.EXIT_COORDINATOR_PORT: Ending.PORT,
                p.EXIT_EXCEPTION: Ending.EXCEPTION, p.EXIT_CONFIG: Ending.CONFIG}.get(
            code, None if code in (-signal.SIGABRT, 128 + signal.SIGABRT) else Ending.CRASH)

    order = (Ending.PREEMPTED, Ending.PORT, Ending.CONFIG, Ending.CRASH, Ending.EXCEPTION, None)
    # Among exceptions the first one raised is the cause (the others are often its peers' collective errors).
    rank, code = min(ended, key=lambda rc: (order.index(kind(rc[1])), polls[rc[0]]["error_at"] or 0, rc[0]))
    k = kind(code)
    record = p.read_error(polls[rank]["error"]) or {}
    silent = _silent_peer(record, polls) if k in (Ending.EXCEPTION, None) else None
    if silent is not None:  # JAX's coordination service gave up on a peer and failed this rank's wait
        state = "stopped (state T: SIGSTOP or a debugger)" if is_stopped(polls[silent]) else "still running"
        return Outcome(Ending.HANG, silent, f"rank {silent} sent jax.distributed no heartbeat within "
                       f"cluster.heartbeat_timeout_s, {where(polls[silent])} (its process is {state}); rank {rank} "
                       f"failed waiting for it: {record.get('summary') or 'aborted'}",
                       phase=polls[silent]["phase"], fault_at=polls[silent].get("phase_at"))
    stopped = [r for r, poll in enumerate(polls) if poll.get("returncode") is None and is_stopped(poll)]
    if k is None and stopped:  # it gave up waiting for a peer that cannot answer
        return Outcome(Ending.HANG, stopped[0], f"rank {stopped[0]}'s process is stopped (state T: SIGSTOP or a "
                       f"debugger) in phase {polls[stopped[0]]['phase']}; rank {rank} aborted waiting for it",
                       phase=polls[stopped[0]]["phase"], fault_at=polls[stopped[0]].get("phase_at"))
    if k in (Ending.CRASH, None):
        how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"
        return Outcome(Ending.CRASH, rank, how)
    if k == Ending.CONFIG:
        return Outcome(k, rank, record.get("summary") or "configuration error (no message written)")
    if k == Ending.EXCEPTION:
        return Outcome(k, rank, record.get("summary") or "exit status 1", record.get("traceback") or None)
    return Outcome(k, rank, f"exit status {code}")


# How JAX's coordination service names a process that stopped sending it heartbeats (its task
# number is the process index, our rank), in the error it raises on the processes waiting for it.
_SILENT_TASK = re.compile(r"Task (\d+) heartbeat timeout")


def _silent_peer(record: dict, polls: list[dict]) -> int | None:
    """The still-running rank that a rank's error says stopped sending heartbeats to JAX's
    coordination service, or None. Only a running process can be the cause: one that ended is
    classed by its own exit."""
    text = "\n".join(record.get(key) or "" for key in ("summary", "traceback"))
    for found in _SILENT_TASK.finditer(text):
        rank = int(found.group(1))
        if rank < len(polls) and polls[rank].get("returncode") is None:
            return rank
    return None
