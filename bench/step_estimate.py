"""`podtrain plan --target`'s step estimate beside MaxText's published, measured MFU for the same
recipes: the model, chip count, sequence length and per-device batch of MaxText's recipe pages,
compiled by podtrain (its own sharding, kernels and the presets' full remat; MaxText's recipes
use lighter remat policies and host offload of layer inputs). One formula for all rows
(`docs/plan.md`); the error is the estimate over the measurement, whatever it is.

    PYTHONPATH=. .venv/bin/python bench/step_estimate.py [--only 8b] [--out estimates.jsonl]

Needs the `aot` extra (libtpu); each compile runs in its own `podtrain plan --json` process.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

GiB = 2**30
FSDP = ["mesh.fsdp=-1", "mesh.tp=1"]
LLAMA2_70B = ["model.vocab_size=32000", "model.rope.rope_type=default", "model.rope.theta=10000.0"]
# (name, preset, target, overrides, MaxText's measured MFU and tokens/s per chip, its recipe page)
RECIPES = (
    ("Llama 3.1 8B", "llama3-8b", "v6e-256", ["train.batch_size=1024", "train.seq_len=8192", *FSDP], 0.4546, 7207),
    ("Llama 3.1 70B", "llama3-70b", "v6e-256", ["train.batch_size=512", "train.seq_len=8192", *FSDP], 0.5033, 960),
    ("Llama 2 70B", "llama3-70b", "v5p-1024", ["train.batch_size=2048", "train.seq_len=4096", *FSDP, *LLAMA2_70B],
     0.654, 692),
    ("DeepSeek-V3 671B", "deepseek-v3-671b", "v5p-1024", ["train.batch_size=512", "train.seq_len=4096",
                                                          "mesh.fsdp=-1", "mesh.ep=64"], 0.332, 542),
)


def plan(preset: str, target: str, overrides: list[str], timeout: float) -> tuple[dict | None, str]:
    command = [sys.executable, "-m", "podtrain.launch.cli", "plan", "-c", preset, "--target", target, "--json",
               "plan.max_fit_compiles=0", *overrides]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"JAX_PLATFORMS": "cpu"}
    try:
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout:.0f} s"
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines:
        return None, (done.stderr.strip().splitlines() or ["no output"])[-1][:200]
    return json.loads(lines[-1])["target"], ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="")
    parser.add_argument("--out", default="")
    parser.add_argument("--timeout", type=float, default=3600)
    args = parser.parse_args(argv)
    print("| recipe | target | batch x seq | peak GiB | compile s | step s | compute s | HBM s "
          "| collectives s (not overlapped) | bound by | tokens/s/chip | MFU estimate | MaxText MFU "
          "| estimate / measured |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, preset, target, overrides, mfu, tokens in RECIPES:
        if args.only and args.only.lower() not in name.lower():
            continue
        start = time.perf_counter()
        t, error = plan(preset, target, overrides, args.timeout)
        settings = dict(o.split("=", 1) for o in overrides)
        shape = f"{settings['train.batch_size']} x {settings['train.seq_len']}"
        if t is None or "estimate" not in t:
            why = error or f"does not fit: {t['peak_bytes'] / GiB:.1f} GiB needed"
            print(f"| {name} | {target} | {shape} | {why} | | | | | | | | | {mfu:.1%} | |", flush=True)
            continue
        e = t["estimate"]
        print(f"| {name} | {target} | {shape} | {t['peak_bytes'] / GiB:.1f} | {t['compile_s']:.0f} "
              f"| {e['step_s']:.2f} | {e['compute_s']:.2f} | {e['hbm_s']:.2f} "
              f"| {e['comm_s']:.2f} ({e['exposed_s']:.2f}) "
              f"| {e['bound_by']} | {e['tokens_per_s_per_chip']:,.0f} (MaxText {tokens:,}) | {e['mfu']:.1%} "
              f"| {mfu:.1%} | {e['mfu'] / mfu:.2f} |", flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps({"recipe": name, "preset": preset, "target": target, "overrides": overrides,
                                    "maxtext_mfu": mfu, "estimate": e, "peak_bytes": t["peak_bytes"],
                                    "wall_s": time.perf_counter() - start}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
