"""Where a run's wall-clock time went: a ledger in the run directory, and its goodput.

Every attempt appends to `<run dir>/goodput.jsonl`: the driver one line per gang it reserves and
starts, process 0 one line as its setup ends and one per step, each a wall-clock interval
`[t0, t1]` split into categories (`CATEGORIES`). A step's line measures its data wait, compile
(the first step's dispatch, which compiles), evals and samples, and the blocking part of a
checkpoint save; the rest of the interval is the step itself. Lines are written as they happen,
so a killed attempt keeps all but its last step.

`summarize` reads the ledger back: the steps an attempt trained past the checkpoint the next
attempt resumed from are moved from training to `lost`; the time between one attempt's last line
and the next one's first is `between`; time inside an attempt that no line covers is
`unaccounted`. Goodput is training time over wall-clock time.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

CATEGORIES = {
    "starting": "reserving the gang and starting processes",
    "distributed": "jax.distributed initialisation",
    "compiling": "compiling",
    "data": "waiting for data",
    "training": "training steps",
    "checkpointing": "checkpoint saves (blocking part)",
    "restoring": "restoring a checkpoint",
    "evaluating": "evals and samples",
    "lost": "steps lost and redone after a failure",
    "between": "waiting between attempts",
    "unaccounted": "not covered by the ledger",
}
LEDGER = "goodput.jsonl"
_PHASES: list[tuple[str, float, float]] = []  # what the process did before the run began (the worker's)


def process_phase(category: str, t0: float, t1: float) -> None:
    """Records a phase of this process before `Ledger` opens (e.g. `jax.distributed` initialisation)."""
    _PHASES.append((category, t0, t1))


def process_start_time() -> float:
    """When this process started (wall clock). On Linux from its start in clock ticks since boot and
    the uptime, to about 10 ms (psutil's create_time adds the boot time, which the kernel gives in
    whole seconds); elsewhere from psutil."""
    try:
        stat = Path("/proc/self/stat").read_text()
        started_s = int(stat.rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
        uptime_s = float(Path("/proc/uptime").read_text().split()[0])
        return time.time() - (uptime_s - started_s)
    except (OSError, ValueError, IndexError):
        import psutil

        return psutil.Process().create_time()


def _append(run_dir: Path, line: dict) -> None:
    with open(run_dir / LEDGER, "a") as fh:  # one short write per line: appends from two processes do not mix
        fh.write(json.dumps(line) + "\n")


def driver_line(run_dir: Path, attempt: int, t0: float, t1: float) -> None:
    """The driver's share of an attempt: reserving the gang and starting its processes."""
    _append(run_dir, {"source": "driver", "attempt": attempt, "t0": t0, "t1": t1, "seconds": {"starting": t1 - t0}})


def failure_line(run_dir: Path, attempt: int, record: dict) -> None:
    """What an attempt's ending cost (`cluster.outcomes.Attempt.record()`): written when the driver
    reports it, and again once the next attempt's first step completes its recovery. A line of no
    length: it moves no time between categories."""
    at = record.get("detected_at") or time.time()
    _append(run_dir, {"source": "driver", "attempt": attempt, "t0": at, "t1": at, "seconds": {}, "failure": record})


class Ledger:
    """Process 0's lines for one attempt; `enabled=False` (other processes) writes nothing."""

    def __init__(self, run_dir: Path, *, enabled: bool, attempt: int | None = None):
        self.run_dir, self.enabled = run_dir, enabled
        self.earlier = read_ledger(run_dir) if enabled else []
        self.attempt = attempt if attempt is not None else 1 + max((int(x["attempt"]) for x in self.earlier),
                                                                   default=0)
        self.mark = time.time()  # the end of the last line written
        self.pending: dict[str, float] = {}
        self.before = Breakdown()  # the run up to this attempt's setup
        self.training = 0.0  # this attempt's training seconds
        self._file = None

    def setup_done(self, start_step: int, restoring_s: float) -> None:
        """The attempt's first line: the process start, its phases before the run (`process_phase`),
        building the run and restoring its checkpoint."""
        now, started = time.time(), process_start_time()
        t = started
        seconds: dict[str, float] = {}
        for category, t0, t1 in _PHASES:
            seconds["starting"] = seconds.get("starting", 0.0) + max(0.0, t0 - t)
            seconds[category] = seconds.get(category, 0.0) + (t1 - t0)
            t = t1
        seconds["restoring"] = restoring_s
        seconds["starting"] = seconds.get("starting", 0.0) + max(0.0, now - t - restoring_s)
        line = self._write(started, now, seconds, step=start_step, start_step=start_step)
        self.before = summarize([*self.earlier, line]).total

    def add(self, category: str, seconds: float) -> None:
        """Time of `category` inside the current step's interval."""
        self.pending[category] = self.pending.get(category, 0.0) + seconds

    def step_done(self, step: int) -> None:
        """Closes the interval since the last line: what `add` measured, the rest training."""
        now = time.time()
        seconds = {**self.pending, "training": max(0.0, now - self.mark - sum(self.pending.values()))}
        self.pending = {}
        self.training += seconds["training"]
        self._write(self.mark, now, seconds, step=step)

    def goodput(self) -> float:
        """The run's goodput so far: training time (steps lost excepted) over its wall clock."""
        wall = time.time() - self.before.start
        return (self.before.seconds["training"] + self.training) / wall if wall > 0 else 0.0

    def _write(self, t0: float, t1: float, seconds: dict, **fields) -> dict:
        self.mark = t1
        line = {"source": "worker", "attempt": self.attempt, "t0": t0, "t1": t1, **fields,
                "seconds": {k: round(v, 6) for k, v in seconds.items() if v}}
        if self.enabled:
            if self._file is None:  # opened once: a line per step is one short append, line-buffered
                self._file = open(self.run_dir / LEDGER, "a", buffering=1)  # noqa: SIM115 (open for the attempt)
            self._file.write(json.dumps(line) + "\n")
        return line


def read_ledger(run_dir: Path) -> list[dict]:
    """The ledger's lines; a line cut off by a kill is skipped."""
    path = Path(run_dir) / LEDGER
    if not path.is_file():
        return []
    lines = []
    for text in path.read_text().splitlines():
        try:
            line = json.loads(text)
        except json.JSONDecodeError:
            continue
        if isinstance(line, dict) and {"attempt", "t0", "t1", "seconds"} <= line.keys():
            lines.append(line)
    return lines


@dataclasses.dataclass
class Breakdown:
    """Seconds per category over a span of wall-clock time."""

    start: float = 0.0
    wall: float = 0.0
    seconds: dict[str, float] = dataclasses.field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0.0))
    steps: tuple[int, int] | None = None  # (first step, last step) trained, for an attempt

    @property
    def goodput(self) -> float:
        return self.seconds["training"] / self.wall if self.wall else 0.0

    def as_dict(self) -> dict:
        return {"wall_s": self.wall, "goodput": self.goodput, "seconds": self.seconds,
                "badput": {k: v / self.wall if self.wall else 0.0 for k, v in self.seconds.items() if k != "training"},
                **({"steps": list(self.steps)} if self.steps else {})}


@dataclasses.dataclass
class Summary:
    """The run's breakdown in total and per attempt."""

    total: Breakdown
    attempts: dict[int, Breakdown]
    failures: dict[int, dict] = dataclasses.field(default_factory=dict)  # attempt -> how it ended, what it cost


def summarize(lines: list[dict]) -> Summary:
    """The breakdown of a ledger's lines (see the module doc)."""
    by_attempt: dict[int, list[dict]] = {}
    failures = {}
    for line in lines:
        by_attempt.setdefault(int(line["attempt"]), []).append(line)
        if isinstance(line.get("failure"), dict):
            failures[int(line["attempt"])] = line["failure"]  # the later line adds the recovery
    order = sorted(by_attempt, key=lambda a: min(line["t0"] for line in by_attempt[a]))
    resumed_at = {}  # attempt -> the step the next attempt started from
    for a, b in zip(order, order[1:], strict=False):
        starts = [line["start_step"] for line in by_attempt[b] if "start_step" in line]
        if starts:
            resumed_at[a] = starts[0]
    total, attempts, previous_end = Breakdown(), {}, None
    for a in order:
        breakdown = _attempt(sorted(by_attempt[a], key=lambda line: line["t0"]), resumed_at.get(a))
        attempts[a] = breakdown
        if previous_end is not None:
            total.seconds["between"] += max(0.0, breakdown.start - previous_end)
        for k, v in breakdown.seconds.items():
            total.seconds[k] += v
        end = breakdown.start + breakdown.wall
        previous_end = end if previous_end is None else max(previous_end, end)
    if order:
        total.start = attempts[order[0]].start
        total.wall = previous_end - total.start
    return Summary(total, attempts, failures)


def _attempt(lines: list[dict], resumed_at: int | None) -> Breakdown:
    """One attempt's lines, overlaps clipped (each line keeps the share of its interval no earlier
    line covers), steps past the next attempt's resume point counted as lost."""
    out = Breakdown(start=lines[0]["t0"])
    covered_to, steps = lines[0]["t0"], []
    for line in lines:
        t0, t1 = max(line["t0"], covered_to), line["t1"]
        share = (t1 - t0) / (line["t1"] - line["t0"]) if line["t1"] > line["t0"] else 0.0
        if t1 <= t0:
            continue
        lost = resumed_at is not None and line.get("step") is not None and "start_step" not in line \
            and line["step"] > resumed_at
        for k, v in line["seconds"].items():
            k = "lost" if lost and k in ("training", "data") else k
            out.seconds[k if k in CATEGORIES else "unaccounted"] += v * share
        out.seconds["unaccounted"] += max(0.0, t0 - covered_to)
        covered_to = t1
        if line.get("step") is not None and "start_step" not in line:
            steps.append(line["step"])
    out.wall = covered_to - out.start
    out.steps = (min(steps), max(steps)) if steps else None
    return out


def format_summary(summary: Summary) -> str:
    """The breakdown as a table: seconds and share of wall clock per category, per attempt and in total."""
    columns = [("total", summary.total)] + [(f"attempt {a}", b) for a, b in summary.attempts.items()]
    width = max(len(d) for d in CATEGORIES.values()) + 2
    rows = [f"{'':<{width}}" + "".join(f"{name:>20}" for name, _ in columns)]
    for key, description in CATEGORIES.items():
        if key == "between" and len(columns) == 2:
            continue
        rows.append(f"{description:<{width}}" + "".join(
            f"{b.seconds[key]:>10.1f}s {100 * b.seconds[key] / b.wall if b.wall else 0:>6.1f}%" for _, b in columns))
    rows.append(f"{'wall clock':<{width}}" + "".join(f"{b.wall:>10.1f}s {'':>7}" for _, b in columns))
    steps = "".join(f"{'' if b.steps is None else f'{b.steps[0]}-{b.steps[1]}':>20}" for _, b in columns)
    rows.append(f"{'steps trained':<{width}}" + steps)
    rows.append(f"goodput {100 * summary.total.goodput:.1f}% (training steps over wall clock; "
                f"badput: every other row)")
    rows.extend(describe_failure(f) for _, f in sorted(summary.failures.items()))
    return "\n".join(rows)


def describe_failure(f: dict) -> str:
    """`attempt 2 ended: hang (rank 1) in phase step: detected in 8.4s, first step after 31.0s, 2 steps redone`."""
    def seconds(value):
        return "?" if value is None else f"{value:.1f}s"

    where = f" in phase {f['phase']}" if f.get("phase") else ""
    line = (f"attempt {f['attempt']} ended: {f['ended']} (rank {f.get('rank')}){where}: "
            f"detected in {seconds(f.get('detect_s'))}")
    if f.get("restart_s") is not None:
        line += f", first step after {seconds(f['restart_s'])}"
    if f.get("steps_redone") is not None:
        line += f", {f['steps_redone']} steps redone"
    return line


def summary_json(summary: Summary) -> str:
    return json.dumps({"total": summary.total.as_dict(),
                       "attempts": {str(a): b.as_dict() for a, b in summary.attempts.items()},
                       "failures": {str(a): f for a, f in summary.failures.items()}}, indent=2)
