"""LoRA against full fine-tuning: what a run trains and keeps, per-chip memory on the target, and step speed.

    PYTHONPATH=. .venv/bin/python bench/lora.py sizes [--compile] [--only llama3-70b]   # needs podtrain[aot]
    PYTHONPATH=. .venv/bin/python bench/lora.py speed [--steps 20]

`sizes`: for `llama3-70b` on v5p-128 and `deepseek-v3-671b` on v5p-1024 (the batch and mesh of
`bench/plan_targets.py`), full fine-tuning and LoRA of ranks 8 and 64 on every attention and MLP
projection (DeepSeek-V3: its latent attention and dense and shared-expert MLPs, then the same and
its routed experts): the model's and the
trained parameters, the optimizer state and the checkpoint (the TrainState: step, trained params and
optimizer state) over the whole slice, from the abstract state built for the target's compile-only
devices; with `--compile`, the TPU compiler's peak per chip of the real train step (`plan --target`).

`speed`: `llama3-tiny` on this machine's CPU devices, a full step and a LoRA step (rank 8, the same
targets) in the same process, alternating, same batch; median seconds per step and tokens/s.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from bench.common import format_table, machine_description  # noqa: E402
from podtrain.orchestrator.config.compose import load_config  # noqa: E402
from podtrain.orchestrator.train.build import build_training  # noqa: E402

GiB = 2**30
DEEPSEEK_PROJECTIONS = "q_a_proj,q_b_proj,kv_a_proj_with_mqa,kv_b_proj,o_proj,gate_proj,up_proj,down_proj"
# preset: (target, overrides, the lora.targets of each LoRA run)
TARGETS = {
    "llama3-70b": ("v5p-128", ["train.batch_size=64", "mesh.fsdp=-1", "mesh.tp=1"],
                   ["[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]"]),
    "deepseek-v3-671b": ("v5p-1024", ["train.batch_size=512", "mesh.fsdp=-1", "mesh.ep=64"],
                         [f"[{DEEPSEEK_PROJECTIONS}]", f"[{DEEPSEEK_PROJECTIONS},experts]"]),
}


def _bytes(tree) -> int:
    return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def sizes(only: str, compile_step: bool, experts_only: bool = False) -> list[dict]:
    from podtrain.orchestrator.plan.on_target import plan_on_target
    from podtrain.orchestrator.plan.targets import compile_devices, parse_target

    rows = []
    for preset, (target_name, overrides, target_lists) in TARGETS.items():
        if only not in preset:
            continue
        target = parse_target(target_name)
        devices = compile_devices(target)
        runs = [(0, "")] + [(rank, targets) for targets in target_lists for rank in (8, 64)]
        for rank, targets in runs:
            experts = "experts" in targets
            if experts_only and not experts:
                continue
            lora = [f"lora.rank={rank}", f"lora.targets={targets}"] if rank else []
            config = load_config(preset, overrides + lora)
            training = build_training(config, devices)
            state = training.abstract_state()
            name = f"LoRA rank {rank}{' + experts' if experts else ''}" if rank else "full"
            row = {"preset": preset, "target": target_name, "run": name,
                   "params": sum(math.prod(v.shape) for v in jax.tree.leaves(training.abstract_params)),
                   "trained": sum(math.prod(v.shape) for v in jax.tree.leaves(state.params)),
                   "optimizer_gib": _bytes(state.opt_state) / GiB, "checkpoint_gib": _bytes(state) / GiB}
            if compile_step:
                started = time.perf_counter()
                report = plan_on_target(config, target, devices)
                row |= {"peak_gib": report.get("peak_bytes", 0) / GiB, "fits": report.get("fits"),
                        "compile_s": time.perf_counter() - started}
            rows.append(row)
            print(f"  {preset} {row['run']}: done", file=sys.stderr)
    return rows


def speed(steps: int) -> list[dict]:
    from podtrain.orchestrator.train.synthetic import random_batch

    runs = {}
    for name, extra in (("full", []), ("LoRA rank 8", ["lora.rank=8", "lora.targets=" + TARGETS["llama3-70b"][2][0]])):
        training = build_training(load_config("llama3-tiny", extra))
        state, frozen = training.init_state(), training.init_frozen()
        batch = random_batch(training, seed=0)
        state, metrics = training.step(state, batch, frozen)  # compile
        jax.block_until_ready(metrics)
        runs[name] = [training, state, frozen, batch, []]
    for _ in range(steps):
        for run in runs.values():
            training, state, frozen, batch, times = run
            started = time.perf_counter()
            state, metrics = training.step(state, batch, frozen)
            jax.block_until_ready((state, metrics))
            times.append(time.perf_counter() - started)
            run[1] = state
    rows = []
    for name, (training, state, _, _, times) in runs.items():
        t = training.config.train
        median = float(np.median(times))
        rows.append({"run": name, "trained": sum(math.prod(v.shape) for v in jax.tree.leaves(state.params)),
                     "step_s": median, "tokens_per_s": t.batch_size * t.seq_len / median})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=("sizes", "speed"))
    parser.add_argument("--compile", action="store_true", help="sizes: also compile the step for the target")
    parser.add_argument("--only", default="", help="sizes: the presets whose name contains this")
    parser.add_argument("--experts", action="store_true", help="sizes: only the runs that adapt the routed experts")
    parser.add_argument("--steps", type=int, default=20, help="speed: timed steps of each run")
    args = parser.parse_args(argv)
    print(f"# LoRA {args.what}; {machine_description()}\n")
    if args.what == "sizes":
        columns = [("preset", "preset", "<16"), ("target", "target", "<8"), ("run", "run", "<12"),
                   ("params", "params", ".4g"), ("trained", "trained params", ".4g"),
                   ("optimizer_gib", "optimizer GiB (slice)", ".2f"), ("checkpoint_gib", "checkpoint GiB", ".3f")]
        if args.compile:
            columns += [("peak_gib", "peak GiB / chip", ".1f"), ("fits", "fits", ""), ("compile_s", "compile s", ".0f")]
        print(format_table(sizes(args.only, args.compile, args.experts), tuple(columns)))
    else:
        columns = (("run", "run", "<12"), ("trained", "trained params", ",d"), ("step_s", "median step s", ".4f"),
                   ("tokens_per_s", "tokens/s", ".0f"))
        print(format_table(speed(args.steps), columns))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
