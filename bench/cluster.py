"""Orchestrator latency on the local cluster: submit -> first step, and killed process -> first resumed step.

    PYTHONPATH=. .venv/bin/python bench/cluster.py [--hosts 2] [--devices-per-host 2] [--preset llama3-tiny]

Runs `podtrain train` (the driver, an embedded Ray on loopback, one worker process per simulated
host) as a subprocess and watches its `metrics.jsonl`:

1. submit -> first step: from starting the command to the first completed step, split into the
   time before the step began and the first step itself (its `step_s`, mostly compilation, minus
   the median of the later steps).
2. recovery: SIGKILL of rank 1's worker after a checkpoint, to the first step completed by the
   restarted gang (reserve again, start processes, initialise JAX, restore, compile, one step).

Run it as root inside a private network namespace (`bash tests/netns.sh ...`) on a shared machine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import BENCH_SHAPE, format_table, machine_description  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def wait_for(predicate, proc: subprocess.Popen, timeout: float):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        if proc.poll() is not None:
            raise RuntimeError(f"podtrain exited with {proc.returncode}: {proc.stdout.read()[-3000:]}")
        time.sleep(0.05)
    raise TimeoutError(f"nothing after {timeout:g}s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="llama3-tiny")
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument("--devices-per-host", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--kill-after", type=int, default=12, help="kill rank 1 once this step is done")
    args = parser.parse_args(argv)
    print(f"# cluster benchmark, {datetime.date.today()}, {machine_description()}")
    with tempfile.TemporaryDirectory(prefix="pt", dir="/tmp") as tmp:
        run_dir = Path(tmp) / "run"
        env = dict(os.environ, PYTHONPATH=str(ROOT), RAY_TMPDIR=tmp, RAY_AUTH_MODE="disabled")
        command = [sys.executable, "-m", "podtrain.launch.cli", "train", "-c", args.preset, *BENCH_SHAPE,
                   "cluster=local",
                   f"cluster.num_hosts={args.hosts}", f"cluster.devices_per_host={args.devices_per_host}",
                   f"train.steps={args.steps}", "train.eval_every=0", "checkpoint.every_steps=5",
                   f"run.dir={tmp}", "run.name=run"]
        started = time.time()
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
        first = wait_for(lambda: records(run_dir)[:1], proc, 900)[0]
        to_first_step = time.time() - started
        done = wait_for(lambda: [r for r in records(run_dir) if r["step"] >= args.kill_after], proc, 900)
        steady = statistics.median(r["step_s"] for r in records(run_dir)[2:])
        pid = int((run_dir / "logs" / "attempt-1" / "rank1.pid").read_text())
        before = len(records(run_dir))
        killed_at = time.time()
        os.kill(pid, signal.SIGKILL)
        resumed = wait_for(lambda: records(run_dir)[before:before + 1], proc, 900)[0]
        to_resumed_step = time.time() - killed_at
        out, _ = proc.communicate(timeout=900)
        if proc.returncode != 0:
            print(out[-3000:])
            return 1
    del done
    rows = [{
        "what": "submit -> first step", "total_s": to_first_step, "first_step_s": first["step_s"],
        "compile_s": first["step_s"] - steady, "before_s": to_first_step - first["step_s"],
    }, {
        "what": f"kill -9 rank 1 -> first resumed step ({resumed['step']})", "total_s": to_resumed_step,
        "first_step_s": resumed["step_s"], "compile_s": resumed["step_s"] - steady,
        "before_s": to_resumed_step - resumed["step_s"],
    }]
    print(f"\n{args.preset}, local cluster {args.hosts} hosts x {args.devices_per_host} CPU devices, "
          f"steady step {steady:.2f}s (median)\n")
    print(format_table(rows, [
        ("what", "from -> to", "<42"), ("total_s", "total s", ".1f"),
        ("before_s", "until the step starts s", ".1f"), ("first_step_s", "first step s", ".1f"),
        ("compile_s", "of which compile s", ".1f"),
    ]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
