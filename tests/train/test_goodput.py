"""The goodput ledger: a kill after a checkpoint counts the redone steps as lost, the categories add up to
the wall clock, `podtrain goodput` prints it, and the trackers see the running goodput."""

import json
import os
import signal
import subprocess
import sys

import pytest
from train_fixtures import ROOT, command, env, losses, wait_for_step

from podtrain.orchestrator.train.goodput import CATEGORIES, format_summary, read_ledger, summarize


def goodput(run_dir, *args):
    return subprocess.run([sys.executable, "-m", "podtrain.launch.cli", "goodput", str(run_dir), *args], cwd=ROOT,
                          env=env(), capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_a_kill_after_a_checkpoint_counts_the_redone_steps_as_lost_and_the_time_adds_up(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(command(run_dir, 1000, every=4), cwd=ROOT, env=env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    wait_for_step(run_dir, proc, 7)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    committed = max(int(p) for p in os.listdir(run_dir / "checkpoints") if p.isdigit())
    done = subprocess.run(command(run_dir, committed + 4, every=4), cwd=ROOT, env=env(), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]

    lines = read_ledger(run_dir)
    first = [line for line in lines if line["attempt"] == 1]
    redone = [line for line in first if "start_step" not in line and line["step"] > committed]
    assert redone  # the killed attempt trained past its last checkpoint
    expected_lost = sum(line["seconds"].get("training", 0) + line["seconds"].get("data", 0) for line in redone)

    report = json.loads(goodput(run_dir, "--json").stdout)
    total, attempts = report["total"], report["attempts"]
    assert sorted(attempts) == ["1", "2"]
    assert attempts["1"]["seconds"]["lost"] == pytest.approx(expected_lost, rel=1e-6)
    assert attempts["2"]["seconds"]["lost"] == 0 and attempts["2"]["steps"] == [committed + 1, committed + 4]
    for category in ("starting", "compiling", "training", "checkpointing", "data", "between"):
        assert total["seconds"][category] > 0, category
    measured = sum(v for k, v in total["seconds"].items() if k != "unaccounted")
    assert measured == pytest.approx(total["wall_s"], rel=0.02)
    assert total["goodput"] == pytest.approx(total["seconds"]["training"] / total["wall_s"])

    text = goodput(run_dir)
    assert text.returncode == 0 and "steps lost and redone after a failure" in text.stdout
    assert "goodput " in text.stdout.splitlines()[-1]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert sorted(losses(run_dir)) == list(range(1, committed + 5))
    assert all(0 <= r["goodput"] <= 1 for r in records) and records[-1]["goodput"] > 0  # what every tracker gets


def test_summarize_clips_overlaps_and_moves_steps_past_the_resume_point_to_lost():
    lines = [
        {"source": "driver", "attempt": 1, "t0": 0.0, "t1": 10.0, "seconds": {"starting": 10.0}},
        {"source": "worker", "attempt": 1, "t0": 8.0, "t1": 20.0, "step": 0, "start_step": 0,
         "seconds": {"starting": 12.0}},  # the process started before the driver's line ended
        {"source": "worker", "attempt": 1, "t0": 20.0, "t1": 30.0, "step": 1,
         "seconds": {"compiling": 8.0, "training": 2.0}},
        {"source": "worker", "attempt": 1, "t0": 30.0, "t1": 32.0, "step": 2, "seconds": {"training": 2.0}},
        {"source": "worker", "attempt": 1, "t0": 32.0, "t1": 35.0, "step": 3,
         "seconds": {"training": 2.0, "data": 1.0}},
        {"source": "worker", "attempt": 2, "t0": 40.0, "t1": 45.0, "step": 2, "start_step": 2,
         "seconds": {"starting": 4.0, "restoring": 1.0}},
        {"source": "worker", "attempt": 2, "t0": 45.0, "t1": 47.0, "step": 3, "seconds": {"training": 2.0}},
    ]
    summary = summarize(lines)
    first = summary.attempts[1].seconds
    assert first["starting"] == pytest.approx(10.0 + 12.0 * 10 / 12)  # the overlap counted once
    assert first["lost"] == pytest.approx(3.0) and first["training"] == pytest.approx(4.0)
    total = summary.total
    assert total.wall == 47.0 and total.seconds["between"] == 5.0
    assert sum(total.seconds.values()) == pytest.approx(total.wall)
    assert total.goodput == pytest.approx(6.0 / 47.0)
    assert set(total.seconds) == set(CATEGORIES)

    # The driver's record of how attempt 1 ended, then of its recovery: no time moves.
    failure = {"attempt": 1, "ended": "hang", "rank": 1, "phase": "save", "detect_s": 4.5, "restart_s": None,
               "steps_redone": None}
    recovered = dict(failure, restart_s=12.0, steps_redone=1)
    marked = summarize([*lines, {"source": "driver", "attempt": 1, "t0": 36.0, "t1": 36.0, "seconds": {},
                                 "failure": failure},
                        {"source": "driver", "attempt": 1, "t0": 46.0, "t1": 46.0, "seconds": {},
                         "failure": recovered}])
    assert marked.total == summary.total and marked.attempts == summary.attempts
    assert marked.failures == {1: recovered}
    assert format_summary(marked).splitlines()[-1] == ("attempt 1 ended: hang (rank 1) in phase save: detected in "
                                                       "4.5s, first step after 12.0s, 1 steps redone")


def test_goodput_of_a_directory_without_a_ledger_is_one_line(tmp_path):
    done = goodput(tmp_path)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "goodput.jsonl" in done.stderr
