"""`podtrain plan --target` of the large presets on TPU and GPU targets: per-device memory, verdict,
compile time, traffic by kind and the step estimate, as one Markdown table.

Each plan runs in its own process (`podtrain plan --json`), one after the other; with `--only`
a substring of the preset or target picks rows. Needs the `aot` extra.
    python bench/plan_targets.py [--only llama3-8b] [--out plans.jsonl]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

GiB = 2**30
# (preset, target, overrides): batch and sequence as public recipes run these models.
ROWS = [
    ("llama3-8b", "v5p-32", ["train.batch_size=16", "mesh.fsdp=-1", "mesh.tp=1"]),
    ("llama3-8b", "v6e-16", ["train.batch_size=16", "mesh.fsdp=-1", "mesh.tp=1"]),
    ("llama3-8b", "h100x8", ["train.batch_size=8", "mesh.fsdp=-1", "mesh.tp=1"]),
    ("llama3-70b", "v5p-128", ["train.batch_size=64", "mesh.fsdp=-1", "mesh.tp=1"]),
    ("llama3-70b", "v5p-256", ["train.batch_size=128", "mesh.fsdp=-1", "mesh.tp=1"]),
    ("llama3-70b", "v6e-256", ["train.batch_size=256", "mesh.fsdp=-1", "mesh.tp=1"]),
    ("llama3-70b", "4xh100x8", ["train.batch_size=32", "mesh.fsdp=-1", "mesh.tp=1"]),
    ("qwen3-32b", "v5p-64", ["train.batch_size=32", "mesh.fsdp=-1", "mesh.tp=1"]),
    ("qwen3-32b", "v5p-128", ["train.batch_size=64", "mesh.fsdp=-1", "mesh.tp=1", "train.seq_len=8192"]),
    ("qwen3-32b", "v6e-64", ["train.batch_size=64", "mesh.fsdp=-1", "mesh.tp=1"]),
    ("qwen3-32b", "2xh100x8", ["train.batch_size=16", "mesh.fsdp=-1", "mesh.tp=1"]),
    ("deepseek-v3-671b", "v5p-1024", ["train.batch_size=512", "mesh.fsdp=-1", "mesh.ep=64"]),
    ("deepseek-v3-671b", "v6e-256", ["train.batch_size=256", "mesh.fsdp=-1", "mesh.ep=64"]),
    ("deepseek-v3-671b", "16xh200x8", ["train.batch_size=128", "mesh.fsdp=-1", "mesh.ep=8"]),  # ep inside a node
]


def _gib(n) -> str:
    return "-" if n is None else f"{n / GiB:.1f}"


def row(preset: str, target: str, plan: dict | None, error: str, seconds: float) -> str:
    if plan is None:
        return f"| {preset} | {target} | {error} | | | | | | | {seconds:.0f} | | |"
    t = plan["target"]
    comm = t.get("communication", {}).get("by_kind", {})
    traffic = ", ".join(f"{k} {v['traffic_bytes'] / 1e9:.1f}" for k, v in comm.items()) or "-"
    r = t.get("estimate")
    estimate = f"{r['step_s']:.2f} s, MFU {r['mfu']:.1%} ({r['bound_by']})" if r else "-"
    fit = "yes" if t["fits"] else "no"
    if not t["fits"] and t.get("suggestion"):
        fit += " (fits with " + " ".join(t["suggestion"]["overrides"]) + ")"
    batch = plan["config"]["train"]["batch_size"], plan["config"]["train"]["seq_len"]
    return (f"| {preset} | {target} | {batch[0]} x {batch[1]} | {_gib(t['params_bytes'])} "
            f"| {_gib(t['optimizer_bytes'])} | {_gib(t['temp_bytes'])} | {_gib(t['peak_bytes'])} "
            f"| {_gib(t['headroom_bytes'])} | {fit} "
            f"| {t['compile_s']:.0f} | {traffic} | {estimate} |")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--only", default="")
    p.add_argument("--out", default="")
    p.add_argument("--timeout", type=float, default=1800)
    args = p.parse_args()
    print("| preset | target | batch x seq | params GiB | optimizer GiB | temp GiB | peak GiB | headroom GiB | fits "
          "| compile s | traffic GB/device/step | estimate |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for preset, target, overrides in ROWS:
        if args.only and args.only not in preset and args.only not in target:
            continue
        cmd = [sys.executable, "-m", "podtrain.launch.cli", "plan", "-c", preset, "--target", target, "--json",
               "plan.max_fit_compiles=2", *overrides]
        start = time.perf_counter()
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout,
                                  env=dict(os.environ, JAX_PLATFORMS="cpu"))
            seconds = time.perf_counter() - start
            lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
            plan = json.loads(lines[-1]) if lines else None
            error = "" if plan else (done.stderr.strip().splitlines() or ["no output"])[-1][:160]
        except subprocess.TimeoutExpired:
            seconds, plan, error = time.perf_counter() - start, None, f"timed out after {args.timeout:.0f} s"
        print(row(preset, target, plan, error, seconds), flush=True)
        if args.out and plan:
            with open(args.out, "a") as f:
                f.write(json.dumps({"preset": preset, "target": target, "overrides": overrides,
                                    "target_plan": plan["target"], "wall_s": seconds}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
