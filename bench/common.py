"""Shared pieces of the benchmarks: the CPU's matmul peak, timing of jitted calls, compiled-step stats."""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from podtrain.models import flops_per_token
from podtrain.orchestrator.config.compose import load_config
from podtrain.orchestrator.config.schema import Config
from podtrain.orchestrator.train.build import Training, build_training
from podtrain.orchestrator.train.synthetic import random_batch

PRESET = "llama3-tiny"
# The benchmark shape: llama3-tiny's model with batch 8 x seq 256 (the preset trains on seq 128).
BENCH_SHAPE = ["train.batch_size=8", "train.seq_len=256"]
MIB = 2**20


@dataclasses.dataclass(frozen=True)
class Timings:
    """Wall-clock and process CPU seconds of repeated calls.

    On a shared machine the wall clock also counts time other processes held the cores; the
    CPU seconds this process used stay close to the work done, so ratios of FLOPs per CPU
    second are the contention-robust comparison.
    """

    wall: list[float]
    cpu: list[float]


def time_calls(fn: Callable[[], object], repeats: int) -> Timings:
    """Times `repeats` calls of `fn`, each waited for with `block_until_ready`."""
    wall, cpu = [], []
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        jax.block_until_ready(fn())
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return Timings(wall, cpu)


@dataclasses.dataclass(frozen=True)
class Peak:
    """The practical float32 matmul peak: best GFLOP per wall second and per process CPU second."""

    gflops: float
    gflop_per_cpu_s: float

    @staticmethod
    def best(samples: Sequence[Peak]) -> Peak:
        return Peak(max(p.gflops for p in samples), max(p.gflop_per_cpu_s for p in samples))


def matmul_peak(size: int = 2048, repeats: int = 10) -> Peak:
    """The best of `repeats` jitted (size x size) @ (size x size) float32 matmuls."""
    a = jax.random.normal(jax.random.key(0), (size, size), jnp.float32)
    b = jax.random.normal(jax.random.key(1), (size, size), jnp.float32)
    matmul = jax.jit(jnp.matmul)
    jax.block_until_ready(matmul(a, b))
    times = time_calls(lambda: matmul(a, b), repeats)
    gflop = 2 * size**3 / 1e9
    return Peak(gflop / min(times.wall), gflop / min(times.cpu))


def bench_config(**model_changes) -> Config:
    """The benchmark preset (llama3-tiny) with some model fields changed."""
    config = load_config(PRESET, BENCH_SHAPE)
    return dataclasses.replace(config, model=config.model.replace(**model_changes))


def build_on(config: Config, num_devices: int) -> Training:
    return build_training(config, jax.devices()[:num_devices])


@dataclasses.dataclass(frozen=True)
class StepTiming:
    """Steady-state timing of one train step configuration."""

    remat: str
    times: Timings
    first_call_s: float
    tokens_per_step: int
    flops_per_step: float

    def row(self, peak: Peak) -> dict:
        """Step time, throughput and MFU; `mfu_cpu` compares FLOPs per CPU second with the matmul's."""
        median_s, min_s = statistics.median(self.times.wall), min(self.times.wall)
        gflop = self.flops_per_step / 1e9
        return {
            "remat": self.remat,
            "step_ms_median": 1e3 * median_s,
            "step_ms_min": 1e3 * min_s,
            "cpu_ms_median": 1e3 * statistics.median(self.times.cpu),
            "tokens_per_s": self.tokens_per_step / median_s,
            "gflop_per_step": gflop,
            "gflops": gflop / median_s,
            "mfu": gflop / median_s / peak.gflops,
            "mfu_best": gflop / min_s / peak.gflops,
            "mfu_cpu": gflop / statistics.median(self.times.cpu) / peak.gflop_per_cpu_s,
            "first_call_s": self.first_call_s,
        }


def time_train_step(config: Config, *, num_devices: int, warmup: int, steps: int) -> StepTiming:
    """Times `steps` train steps after the compiling call and `warmup` more steps."""
    training = build_on(config, num_devices)
    holder = {"state": training.init_state()}
    batch = random_batch(training)

    def one_step():
        holder["state"], metrics = training.step(holder["state"], batch)
        return metrics

    first = time_calls(one_step, 1).wall[0]
    time_calls(one_step, warmup)
    t = config.train
    tokens = t.batch_size * t.seq_len
    return StepTiming(
        remat=config.model.remat,
        times=time_calls(one_step, steps),
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
