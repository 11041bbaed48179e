"""Context parallelism on the TPU target: Llama 3.1 8B split over 8 chips per sequence (`mesh.cp=8
mesh.fsdp=2`, 16 v5p chips, batch 2, full remat), compiled by `podtrain plan --target v5p-32`
at several sequence lengths; per chip: peak, temporaries, parameters and optimizer state, model
FLOPs, and the collectives' result bytes times their executions (MaxText's measure), split into
the keys' and values' gathers, their gradients' reduce-scatters and the rest (weights, head).

    PYTHONPATH=. .venv/bin/python bench/context.py [--seq 32768 65536 131072]

Needs the `aot` extra (libtpu); each compile runs in its own `podtrain plan --json` process.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections import defaultdict

GiB = 2**30


def plan(seq_len: int) -> dict:
    command = [sys.executable, "-m", "podtrain.launch.cli", "plan", "-c", "llama3-8b", "--target", "v5p-32", "--json",
               "mesh.cp=8", "mesh.fsdp=2", f"train.seq_len={seq_len}", "train.batch_size=2"]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"JAX_PLATFORMS": "cpu"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=True)
    return json.loads(done.stdout.splitlines()[-1])["target"]


def row(seq_len: int, t: dict) -> dict:
    moved: dict[str, float] = defaultdict(float)
    for c in t["communication"]["collectives"]:
        part = "kv" if "attention.py" in c["source"] else "rest"
        moved[f"{part} {c['kind']}"] += c["bytes"] * c["executions"]
    total = sum(moved.values())
    tokens = 2 * seq_len
    return {"seq_len": seq_len, "fits": t["fits"], "peak_gib": t["peak_bytes"] / GiB, "temp_gib": t["temp_bytes"] / GiB,
            "params_and_optimizer_gib": (t["params_bytes"] + t["optimizer_bytes"]) / GiB,
            "model_flops_per_chip": t["estimate"]["model_flops_per_step"] / t["devices"],
            "collective_gb": total / 1e9, "collective_kb_per_token": total / tokens / 1e3,
            "by_part_gb": {k: v / 1e9 for k, v in sorted(moved.items())}, "compile_s": t["compile_s"]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[32768, 65536, 131072])
    args = parser.parse_args(argv)
    rows = [row(seq_len, plan(seq_len)) for seq_len in args.seq]
    for r in rows:
        print(json.dumps(r), flush=True)
    print("\n| seq | peak GiB | temporaries GiB | params + AdamW GiB | model TFLOPs per chip | collective GB "
          "| of which K/V gathers | K/V gradient reduce-scatters | KB per token |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        parts = r["by_part_gb"]
        print(f"| {r['seq_len']} | {r['peak_gib']:.2f} | {r['temp_gib']:.2f} | {r['params_and_optimizer_gib']:.2f} "
              f"| {r['model_flops_per_chip'] / 1e12:.0f} | {r['collective_gb']:.1f} "
              f"| {parts.get('kv all-gather', 0):.1f} | {parts.get('kv reduce-scatter', 0):.2f} "
              f"| {r['collective_kb_per_token']:.0f} |")


if __name__ == "__main__":
    main()
