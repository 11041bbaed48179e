"""Per-step metrics: `metrics.jsonl`, TensorBoard events and console lines (process 0 writes)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from orchestrator.config import ConfigError

# Dense bf16 peak FLOP/s per device (chip or GPU), from the vendors' spec sheets.
PEAK_FLOPS = {
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,
    "TPU v5e": 197e12,
    "TPU v5p": 459e12,
    "TPU v5": 459e12,
    "TPU v6 lite": 918e12,
    "TPU v6e": 918e12,
    "NVIDIA A100-SXM4-40GB": 312e12,
    "NVIDIA A100-SXM4-80GB": 312e12,
    "NVIDIA H100 80GB HBM3": 989e12,
    "NVIDIA H100": 989e12,
    "NVIDIA H200": 989e12,
}


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
    """The peak used for MFU and where it came from: the config, the table, or a CPU measurement."""
    if configured > 0:
        return configured, "configured (train.peak_flops_per_device)"
    kind = jax.devices()[0].device_kind
    if kind in PEAK_FLOPS:
        return PEAK_FLOPS[kind], f"table ({kind})"
    if jax.devices()[0].platform == "cpu":
        return measure_matmul_flops() / jax.local_device_count(), "measured f32 matmul on this CPU, per device"
    raise ConfigError(
        f"train.peak_flops_per_device: no peak FLOP/s known for device kind {kind!r} (for MFU); set it in the config"
    )


def _summary_writer_class():
    """tensorboardX's SummaryWriter, imported without torch: tensorboardX imports torch whenever it is
    installed, only to accept torch tensors (about 4 s at every worker start); podtrain logs floats."""
    if "torch" in sys.modules:
        from tensorboardX import SummaryWriter

        return SummaryWriter
    sys.modules["torch"] = None  # `import torch` raises ImportError while this is set
    try:
        from tensorboardX import SummaryWriter
    finally:
        del sys.modules["torch"]
    return SummaryWriter


class MetricsWriter:
    """Appends one JSON object per step to `metrics.jsonl`, mirrors scalars to TensorBoard, prints."""

    def __init__(self, run_dir: Path, *, enabled: bool, total_steps: int):
        self.enabled = enabled
        self.total_steps = total_steps
        self.start = time.perf_counter()
        self.interactive = sys.stdout.isatty()
        self._jsonl = self._tb = None
        if enabled:
            run_dir.mkdir(parents=True, exist_ok=True)
            self._jsonl = (run_dir / "metrics.jsonl").open("a")
            self._tb = _summary_writer_class()(str(run_dir / "tensorboard"))

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        step = record["step"]
        for key, value in record.items():
            if key != "step" and isinstance(value, int | float):
                self._tb.add_scalar(key, value, step)
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
            self._jsonl.close()
            self._tb.close()


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
