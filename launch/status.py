"""`podtrain status <run dir> [--json]`: how a job's attempts went, from its `job.json`.

The driver rewrites `job.json` after every attempt (status `running` while it restarts), so a
live run shows its attempts so far: how each ended, in which phase, how long the driver took to
notice, how long until the next attempt's first step, the steps trained again, and the TPU slices
it ran on (an elastic job's change with them).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

COLUMNS = (("attempt", 7), ("ended", 11), ("slices", 6), ("rank", 4), ("phase", 11), ("detect", 8), ("restart", 8),
           ("redone", 6))


def _seconds(value) -> str:
    return "-" if value is None else f"{value:.1f}s"


def format_status(job: dict) -> str:
    """The job's status line, then one row per attempt."""
    lines = [f"{job['run_dir']}: {job['status']} ({job['reason']}); last step {job['last_step']}, last checkpoint "
             f"{job['last_checkpoint']}, {job['attempts']} attempts",
             "  ".join(f"{name:<{width}}" for name, width in COLUMNS) + "  detail"]
    for a in job.get("history", []):
        cells = (a["attempt"], a["ended"] or "running", a.get("slices") or "-", "-" if a["rank"] is None else a["rank"],
                 a["phase"] or "-",
                 _seconds(a["detect_s"]), _seconds(a["restart_s"]),
                 "-" if a["steps_redone"] is None else a["steps_redone"])
        lines.append("  ".join(f"{str(c):<{w}}" for c, (_, w) in zip(cells, COLUMNS, strict=True)) + "  "
                     + (a["detail"] or ""))
    return "\n".join(lines)


def run_command(args: argparse.Namespace) -> int:
    if args.overrides:
        print(f"podtrain: error: status takes a run directory and --json, found {' '.join(args.overrides)}",
              file=sys.stderr)
        return 2
    path = Path(args.run_dir) / "job.json"
    try:
        job = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        print(f"podtrain: error: {path}: expected the job record a cluster run writes (cluster.kind local, tpu or "
              f"gpu), found {'none' if isinstance(error, OSError) else 'a file that is not JSON'}", file=sys.stderr)
        return 2
    print(json.dumps(job, indent=1) if args.json else format_status(job))
    return 0
