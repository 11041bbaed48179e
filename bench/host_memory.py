"""Host memory of a checkpoint save and restore, measured: the process's peak RSS above what it held
before, for a model of a few hundred MB, with podtrain's Checkpointer (Orbax), async and not.

On a CPU the train state itself lives in host memory, so what a save or restore adds beyond the
state is the staging (Orbax's device-to-host copies, tensorstore's buffers) and the fingerprint
program's temporaries. Cases: podtrain's Checkpointer, and Orbax alone; without a bound, async, and
with `checkpoint.host_gb=1`. Each runs in its own process (peak RSS is per process) and prints one
JSON line, with the plan's figure for the same increase (`plan.host_memory`) and their ratio.

    python bench/host_memory.py [--layers 4] [--hidden 1024]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS


def case(kind: str, directory: str, overrides: list[str], async_save: bool, host_gb: int) -> dict:
    import jax
    import numpy as np

    from podtrain.orchestrator.checkpoint.checkpointer import Checkpointer
    from podtrain.orchestrator.config.compose import load_config
    from podtrain.orchestrator.config.schema import CheckpointConfig
    from podtrain.orchestrator.plan.host_memory import host_memory, machine_ram_bytes
    from podtrain.orchestrator.train.build import build_training

    training = build_training(load_config("llama3-tiny", [*overrides, f"checkpoint.host_gb={host_gb}"]))
    abstract = training.abstract_state()
    state_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(abstract))
    checkpointer = Checkpointer(directory, CheckpointConfig(every_steps=1, keep=2, async_save=async_save,
                                                            host_gb=host_gb))
    if kind.startswith("orbax"):  # Orbax alone, without podtrain's fingerprints and metadata
        import orbax.checkpoint as ocp

        checkpointer.close()
        bound = host_gb or None
        handler = ocp.PyTreeCheckpointHandler(save_concurrent_gb=bound, save_device_host_concurrent_gb=bound)
        checkpointer = ocp.Checkpointer(handler)
        checkpointer.wait = lambda: None
        checkpointer.restore_state = lambda path, abstract: ocp.StandardCheckpointer().restore(path, abstract)
    if kind in ("save", "orbax-save"):
        rng = np.random.default_rng(0)

        def leaf(a):
            value = (0.02 * rng.standard_normal(a.shape)).astype(a.dtype) if a.size > 1 else np.zeros(a.shape, a.dtype)
            return jax.device_put(value, a.sharding)

        state = jax.tree.map(leaf, abstract)
        jax.block_until_ready(state)
        before = rss_bytes()
        reset_peak()
        start = time.perf_counter()
        if kind == "save":
            checkpointer.save(1, state, force=True)
        else:
            checkpointer.save(os.path.join(directory, "orbax"), args=ocp.args.PyTreeSave(state))
        blocking_s = time.perf_counter() - start
        checkpointer.wait()
        seconds = time.perf_counter() - start
        peak = peak_bytes()
        extra = peak - before
    else:
        before = rss_bytes()
        reset_peak()
        start = time.perf_counter()
        if kind == "restore":
            state, _, _ = checkpointer.restore(abstract, step=1)
        else:
            state = checkpointer.restore_state(os.path.join(directory, "orbax"), abstract)
        jax.block_until_ready(state)
        seconds = blocking_s = time.perf_counter() - start
        peak = peak_bytes()
        extra = peak - before - state_bytes  # the restored state itself is host memory on a CPU
    checkpointer.close()
    # The plan's figure for the same increase (computed after the measurement, which it would disturb):
    # podtrain's save and restore (fingerprints included), or Orbax's staging alone.
    host = host_memory(training, ram_bytes=machine_ram_bytes(), platform="cpu")
    plan = {"save": host["phases"]["checkpoint save"] - state_bytes,
            "restore": host["phases"]["checkpoint restore"] - state_bytes,
            "orbax-save": host["orbax"]["save_staging_bytes"], "orbax-restore": 0}[kind]
    return {"case": kind, "async_save": async_save, "host_gb": host_gb, "state_bytes": state_bytes,
            "rss_before": before, "peak_rss": peak, "staging_bytes": extra,
            "staging_over_state": round(extra / state_bytes, 3), "plan_bytes": plan,
            "plan_over_measured": round(plan / extra, 3) if extra > 0 else None, "seconds": round(seconds, 2),
            "blocking_s": round(blocking_s, 2)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--case", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--dir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--async-save", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--host-gb", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    overrides = [f"model.num_layers={args.layers}", f"model.hidden_size={args.hidden}",
                 f"model.intermediate_size={4 * args.hidden}", "model.vocab_size=32000", "model.head_dim=64",
                 f"model.num_heads={args.hidden // 64}", f"model.num_kv_heads={args.hidden // 128}",
                 "mesh.fsdp=1"]
    if args.case:
        print(json.dumps(case(args.case, args.dir, overrides, args.async_save, args.host_gb)), flush=True)
        return
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1")
    for async_save, bound in ((False, 0), (True, 0), (False, 1)):  # bound: checkpoint.host_gb
        with tempfile.TemporaryDirectory() as directory:
            # Orbax alone saves synchronously: its cases once per bound.
            for kind in ("save", "restore", *(() if async_save else ("orbax-save", "orbax-restore"))):
                command = [sys.executable, __file__, "--case", kind, "--dir", directory, f"--layers={args.layers}",
                           f"--hidden={args.hidden}", f"--host-gb={bound}",
                           *(["--async-save"] if async_save else [])]
                done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
                print(done.stdout.strip().splitlines()[-1], flush=True)


if __name__ == "__main__":
    main()
