"""What the tests that run `podtrain train` and `podtrain export` as real processes share: the tiny
model's overrides, the command line, its environment, and the losses a run wrote (to its metrics
file and to TensorBoard's event files)."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from xla_flags import xla_flags

ROOT = Path(__file__).parent.parent
TINY = ["model.num_layers=2", "model.hidden_size=64", "model.intermediate_size=128", "model.vocab_size=384",
        "model.head_dim=16", "train.batch_size=4", "train.seq_len=32", "checkpoint.async_save=false",
        "train.peak_flops_per_device=1e9"]


def command(run_dir: Path, steps: int, *extra: str, every: int = 2) -> list[str]:
    return [sys.executable, "-m", "podtrain.launch.cli", "train", "-c", "llama3-tiny", *TINY, "cluster=none",
            f"train.steps={steps}", f"checkpoint.every_steps={every}", f"run.dir={run_dir.parent}",
            f"run.name={run_dir.name}", *extra]


def env():
    return dict(os.environ, PYTHONPATH=str(ROOT), XLA_FLAGS=xla_flags(2))


def train(run_dir: Path, steps: int, *extra: str) -> subprocess.CompletedProcess:
    done = subprocess.run(command(run_dir, steps, *extra), cwd=ROOT, env=env(), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def losses(run_dir: Path) -> dict[int, float]:
    """Step -> loss; a step written twice (after a resume) keeps its last value."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records}


def wait_for_step(run_dir: Path, proc: subprocess.Popen, step: int) -> None:
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if (run_dir / "metrics.jsonl").exists() and max(losses(run_dir), default=0) >= step:
            return
        time.sleep(0.2)
    raise AssertionError(f"the run did not reach step {step}: {proc.poll()}")


def export(run_dir: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "podtrain.launch.cli", "export", "-c", "llama3-tiny", *TINY, f"checkpoint={run_dir}",
           f"out={out}", *extra]
    return subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)


def tensorboard_scalars(directory: Path) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value), ...] in the order TensorBoard shows them, from the TFRecord event
    files in `directory` (oldest file first); a session start with a step (tensorboardX's
    `purge_step`) drops the events at that step and later, as TensorBoard does."""
    from tensorboardX.proto.event_pb2 import Event, SessionLog

    scalars: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(directory.glob("events.out.tfevents.*"), key=lambda p: (int(p.name.split(".")[3]),
                                                                             p.stat().st_mtime)):
        data, offset = path.read_bytes(), 0
        while offset < len(data):  # record: u64 length, u32 crc, payload, u32 crc
            length = int.from_bytes(data[offset:offset + 8], "little")
            event = Event.FromString(data[offset + 12:offset + 12 + length])
            offset += 12 + length + 4
            if event.HasField("session_log") and event.session_log.status == SessionLog.START:
                scalars = {tag: [(s, v) for s, v in points if s < event.step] for tag, points in scalars.items()}
            for value in event.summary.value:
                scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return scalars
