"""What a driver killed with SIGKILL leaves behind, ended by the next driver on its run directory.

A driver that dies at once cannot stop what it started: its embedded Ray (GCS, raylet, dashboard
and runtime-env agents), the host actors and their workers run on. So the driver records its
descendants (pid and kernel start time) in `<run_dir>/driver.json` once Ray is up and after each
attempt starts, and removes the record as it exits. A later driver on the same run directory, once
it holds the run's lock (the recorder is gone), ends every recorded process still alive with the
same start time (a reused pid is left alone) and says so in one line.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from pathlib import Path

from podtrain.orchestrator.common.files import write_atomic

RECORD = "driver.json"


def _stat(pid: int) -> tuple[int, int, str] | None:
    """(parent pid, start time in clock ticks since boot, command name) from /proc, or None."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    name = text[text.index("(") + 1:text.rindex(")")]
    fields = text[text.rindex(")") + 2:].split()
    return int(fields[1]), int(fields[19]), name


def descendants(pid: int) -> list[tuple[int, int, str]]:
    """Every living descendant of `pid`: (pid, start time, name)."""
    stats = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (stat := _stat(int(entry))) is not None:
            stats[int(entry)] = stat
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        for child, (ppid, started, name) in stats.items():
            if ppid == parent:
                found.append((child, started, name))
                frontier.append(child)
    return found


def record(run_dir: Path) -> None:
    """Records this driver's descendants (Linux; elsewhere nothing)."""
    if not Path("/proc/self/stat").exists():
        return
    processes = descendants(os.getpid())
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    write_atomic(Path(run_dir) / RECORD, json.dumps({"pid": os.getpid(), "processes": processes}) + "\n")


def clear(run_dir: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        (Path(run_dir) / RECORD).unlink()


def end_leftovers(run_dir: Path, wait_s: float = 10.0) -> str | None:
    """Ends what a killed driver of `run_dir` left running; a line saying what, or None if nothing."""
    path = Path(run_dir) / RECORD
    try:
        left = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    alive = [(pid, name) for pid, started, name in left.get("processes", [])
             if (stat := _stat(pid)) is not None and stat[1] == started]
    for pid, _ in alive:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)  # a stopped process must run to die promptly
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and any(_running(pid) for pid, _ in alive):
        time.sleep(0.1)
    path.unlink(missing_ok=True)
    if not alive:
        return None
    names = sorted({name for _, name in alive})
    return (f"ended {len(alive)} processes that the killed driver (pid {left.get('pid')}) of this run directory "
            f"left running: {', '.join(names)}")


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie waits for init to reap it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"
