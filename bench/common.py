"""Shared pieces of the benchmarks: the CPU's matmul peak, timing of jitted calls, compiled-step stats."""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from orchestrator.build import Training, build_training, with_model
from orchestrator.config import Config, load_config
from orchestrator.plan import flops_per_token

PRESET = "llama3-tiny"
MIB = 2**20


def seconds_of(fn: Callable[[], object], repeats: int) -> list[float]:
    """Wall-clock seconds of `repeats` calls of `fn`, each waited for with `block_until_ready`."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return times


def matmul_peak_gflops(size: int = 2048, repeats: int = 10) -> float:
    """The practical float32 matmul peak: the best of `repeats` jitted (size x size) @ (size x size)."""
    a = jax.random.normal(jax.random.key(0), (size, size), jnp.float32)
    b = jax.random.normal(jax.random.key(1), (size, size), jnp.float32)
    matmul = jax.jit(jnp.matmul)
    jax.block_until_ready(matmul(a, b))
    return 2 * size**3 / min(seconds_of(lambda: matmul(a, b), repeats)) / 1e9


def bench_config(overrides: Sequence[str] = (), **model_changes) -> Config:
    """The benchmark preset with CLI-style `overrides`, then `model_changes` applied."""
    config = load_config(PRESET, list(overrides))
    return with_model(config, **model_changes) if model_changes else config


def build_on(config: Config, num_devices: int) -> Training:
    return build_training(config, jax.devices()[:num_devices])


@dataclasses.dataclass(frozen=True)
class StepTiming:
    """Steady-state timing of one train step configuration."""

    remat: str
    median_s: float
    min_s: float
    first_call_s: float
    tokens_per_step: int
    flops_per_step: float

    def row(self, peak_gflops: float) -> dict:
        return {
            "remat": self.remat,
            "step_ms_median": 1e3 * self.median_s,
            "step_ms_min": 1e3 * self.min_s,
            "tokens_per_s": self.tokens_per_step / self.median_s,
            "gflop_per_step": self.flops_per_step / 1e9,
            "gflops": self.flops_per_step / self.median_s / 1e9,
            "mfu": self.flops_per_step / self.median_s / 1e9 / peak_gflops,
            "mfu_best": self.flops_per_step / self.min_s / 1e9 / peak_gflops,
            "first_call_s": self.first_call_s,
        }


def time_train_step(config: Config, *, num_devices: int, warmup: int, steps: int) -> StepTiming:
    """Median and best of `steps` train steps after the compiling call and `warmup` more steps."""
    training = build_on(config, num_devices)
    state, batch = training.init_state(), training.random_batch()
    holder = {"state": state}

    def one_step():
        holder["state"], metrics = training.step(holder["state"], batch)
        return metrics

    first = seconds_of(one_step, 1)[0]
    seconds_of(one_step, warmup)
    times = seconds_of(one_step, steps)
    t = config.train
    tokens = t.batch_size * t.seq_len
    return StepTiming(
        remat=config.model.remat,
        median_s=statistics.median(times),
        min_s=min(times),
        first_call_s=first,
        tokens_per_step=tokens,
        flops_per_step=flops_per_token(config.model, t.seq_len) * tokens,
    )


def compile_stats(config: Config, *, num_devices: int) -> dict:
    """Trace (lower) and XLA compile seconds of one train step, and its compiled memory."""
    training = build_on(config, num_devices)
    start = time.perf_counter()
    lowered = training.step.lower(training.abstract_state(), training.abstract_batch())
    traced = time.perf_counter()
    compiled = lowered.compile()
    done = time.perf_counter()
    memory = compiled.memory_analysis()
    return {
        "trace_s": traced - start,
        "compile_s": done - traced,
        "total_s": done - start,
        "temp_mib": memory.temp_size_in_bytes / MIB,
        "argument_mib": memory.argument_size_in_bytes / MIB,
    }


def machine_description() -> dict:
    """What the numbers were measured on (the load average matters: the machine may be shared)."""
    return {
        "cpus": os.cpu_count(),
        "jax": jax.__version__,
        "devices": f"{jax.device_count()} x {jax.devices()[0].device_kind}",
        "load_average_1m": os.getloadavg()[0],
    }


def table_row(row: dict, columns: Sequence[tuple[str, str, str]]) -> str:
    """One Markdown table row; `columns` holds (key, header, format spec) triples."""
    return "| " + " | ".join(format(row[k], f) for k, _, f in columns) + " |"


def format_table(rows: list[dict], columns: Sequence[tuple[str, str, str]]) -> str:
    """A Markdown table: header, rule, then one line per row (just the header for no rows)."""
    header = "| " + " | ".join(h for _, h, _ in columns) + " |"
    rule = "|" + "|".join("-" * (len(h) + 2) for _, h, _ in columns) + "|"
    return "\n".join([header, rule, *(table_row(row, columns) for row in rows)])
