"""Per-step metrics: console lines, and the trackers of `metrics.trackers` (`metrics.jsonl`, TensorBoard
events, W&B, MLflow); process 0 writes."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from podtrain.orchestrator.common.chips import chip_of_device_kind
from podtrain.orchestrator.common.errors import ConfigError
from podtrain.orchestrator.common.files import write_atomic
from podtrain.orchestrator.config.trackers import MetricsConfig
from podtrain.orchestrator.train.trackers import remote_trackers


def measure_matmul_flops(size: int = 1024, repeats: int = 5) -> float:
    """This device's practical float32 matmul FLOP/s: best of `repeats` jitted square matmuls."""
    x = jnp.ones((size, size), jnp.float32)
    matmul = jax.jit(lambda a: a @ a)
    matmul(x).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        matmul(x).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def peak_flops_per_device(configured: float = 0.0) -> tuple[float, str]:
    """The peak used for MFU and where it came from: the config, the chip table (`common.chips`), or a
    CPU measurement."""
    if configured > 0:
        return configured, "configured (train.peak_flops_per_device)"
    kind = jax.devices()[0].device_kind
    chip = chip_of_device_kind(kind)
    if chip is not None:
        return chip.peak_flops, f"table ({kind})"
    if jax.devices()[0].platform == "cpu":
        return measure_matmul_flops() / jax.local_device_count(), "measured f32 matmul on this CPU, per device"
    raise ConfigError(
        f"train.peak_flops_per_device: no peak FLOP/s known for device kind {kind!r} (for MFU); set it in the config"
    )


def _tensorboardx():
    """tensorboardX's synchronous event-file writer and protos, imported without torch: tensorboardX
    imports torch whenever it is installed, only to accept torch tensors (seconds at every worker
    start); podtrain logs floats."""
    hidden = "torch" not in sys.modules
    if hidden:
        sys.modules["torch"] = None  # `import torch` raises ImportError while this is set
    try:
        from tensorboardX.event_file_writer import EventsWriter
        from tensorboardX.proto.event_pb2 import Event, SessionLog
        from tensorboardX.summary import scalar
    finally:
        if hidden:
            del sys.modules["torch"]
    return EventsWriter, Event, SessionLog, scalar


class _TensorBoard:
    """Scalars to a TensorBoard event file, written in this thread (tensorboardX's SummaryWriter
    queues events for a thread, and its flush does not wait for the queue: a kill lost events that
    were logged before a checkpoint). `purge_step` makes TensorBoard drop the events an earlier
    writer logged at that step and later."""

    def __init__(self, logdir: Path, *, purge_step: int):
        events_writer, self._event, session_log, self._scalar = _tensorboardx()
        logdir.mkdir(parents=True, exist_ok=True)
        self._writer = events_writer(str(logdir / "events"))
        self._writer.write_event(self._event(wall_time=time.time(), step=purge_step,
                                             session_log=session_log(status=session_log.START)))

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self._writer.write_event(self._event(wall_time=time.time(), step=step, summary=self._scalar(tag, value)))

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class MetricsWriter:
    """Prints each step's record and sends it to the trackers of `metrics.trackers`: one JSON object
    per step appended to `metrics.jsonl`, scalars to TensorBoard, W&B and MLflow (which also get the
    resolved config, `run_config`).

    A run that resumes at `start_step` first drops what an earlier attempt wrote after that step
    (records of steps it trained but never checkpointed, which this run trains again), from
    metrics.jsonl and (a purge event) from TensorBoard: one record per step.
    """

    def __init__(self, run_dir: Path, *, enabled: bool, total_steps: int, start_step: int = 0,
                 metrics: MetricsConfig | None = None, run_config: dict | None = None):
        metrics = metrics or MetricsConfig()
        self.enabled = enabled
        self.total_steps = total_steps
        self.start = time.perf_counter()
        self.interactive = sys.stdout.isatty()
        self._jsonl = self._tb = None
        self._remote = []
        if enabled:
            run_dir.mkdir(parents=True, exist_ok=True)
            if "jsonl" in metrics.trackers:
                _drop_records_after(run_dir / "metrics.jsonl", start_step)
                self._jsonl = (run_dir / "metrics.jsonl").open("a")
            if "tensorboard" in metrics.trackers:
                self._tb = _TensorBoard(run_dir / "tensorboard", purge_step=start_step + 1)
            self._remote = remote_trackers(metrics.trackers, metrics.wandb, metrics.mlflow, run_dir, run_config or {},
                                           start_step=start_step)

    def flush(self) -> None:
        """Puts every record written so far on disk."""
        if self._jsonl is not None:
            self._jsonl.flush()
        if self._tb is not None:
            self._tb.flush()

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(record) + "\n")
            self._jsonl.flush()
        step = record["step"]
        if self._tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, int | float):
                    self._tb.add_scalar(key, value, step)
        for tracker in self._remote:
            tracker.log(record)
        print(self._line(record), end="\r" if self.interactive else "\n", flush=True)

    def _line(self, r: dict) -> str:
        done = r["step"] / self.total_steps
        elapsed = time.perf_counter() - self.start
        eta = elapsed / max(done, 1e-9) * (1 - done) if done else 0.0
        parts = [f"step {r['step']}/{self.total_steps}"]
        parts += [f"{k} {r[k]:.4g}" for k in ("loss", "eval_loss", "grad_norm", "lr", "tokens_per_s", "mfu") if k in r]
        parts.append(f"eta {eta:.0f}s")
        return "  ".join(parts)

    def close(self) -> None:
        if self.enabled:
            if self.interactive:
                print()
            for closable in (self._jsonl, self._tb):
                if closable is not None:
                    closable.close()
            for tracker in self._remote:
                tracker.close()


def _drop_records_after(path: Path, step: int) -> None:
    """Rewrites metrics.jsonl without the records of steps after `step` (and a line cut off by a
    kill), through a temporary file renamed over it, so a crash here loses nothing."""
    if not path.is_file():
        return
    lines = path.read_text().splitlines(keepends=True)
    kept = []
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and record.get("step", 0) <= step:
            kept.append(line if line.endswith("\n") else line + "\n")
    if kept != lines:
        write_atomic(path, "".join(kept))


def expert_metrics(load_LE: np.ndarray, dropped: float) -> dict:
    """Per-step MoE metrics: tokens per expert per MoE layer, the most and least loaded expert
    relative to the mean, and the token-expert assignments dropped over capacity."""
    mean = load_LE.mean(-1, keepdims=True)
    return {
        "expert_load": load_LE.astype(np.int64).tolist(),
        "expert_load_max": float((load_LE / mean).max()),
        "expert_load_min": float((load_LE / mean).min()),
        "dropped_tokens": dropped,
    }
