"""HF import and export on two JAX processes: time and resident memory per process against the model's size.

    PYTHONPATH=. .venv/bin/python bench/hf_io.py [--moe-layers 14] [--experts 32] [--dir /tmp/podtrain-hf-io]

A random DeepSeek-V3 checkpoint in float32 (`deepseek-v3-tiny` with `--moe-layers` MoE layers of
`--experts` experts of 256 x 512) is written to `--dir`, then two JAX processes (two CPU devices
each, an fsdp 2 x ep 2 mesh) import it with `from_hf` and export it with `to_hf`, as
`tests/models/test_hf_streaming.py` does. Per process: the resident memory each phase added (`VmHWM`
reset before the phase, less the resident set before it; for the import, less the parameter
shards the process holds), the whole-run peak (`ru_maxrss`) and the seconds.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from test_hf_streaming import run_probe, write_source  # noqa: E402

from bench.common import machine_description  # noqa: E402
from podtrain.orchestrator.config.compose import load_config  # noqa: E402

MiB = 2**20


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--moe-layers", type=int, default=14)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--dir", default="/tmp/podtrain-hf-io")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    config = load_config("deepseek-v3-tiny", [
        f"model.num_layers={args.moe_layers + 1}", "model.hidden_size=256", f"model.moe.num_experts={args.experts}",
        "model.moe.n_group=4", "model.moe.moe_intermediate_size=512", "model.param_dtype=float32"]).model
    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    try:
        shapes = write_source(root / "source", config)
        size = sum(4 * math.prod(s) for s in shapes.values())
        rows = run_probe(root / "source", root / "exported", timeout=3600)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if args.json:
        print(json.dumps({"machine": machine_description(), "model_bytes": size, "processes": rows}))
        return 0
    print(f"# HF import/export, {machine_description()}\nmodel: {size / MiB:.0f} MiB in float32, "
          f"{args.moe_layers} MoE layers x {args.experts} experts")
    for i, r in enumerate(rows):
        print(f"process {i}: import {r['import_s']:.1f} s, +{(r['import_growth'] - r['shards']) / MiB:.0f} MiB "
              f"over its {r['shards'] / MiB:.0f} MiB of shards; export {r['export_s']:.1f} s, "
              f"+{r['export_growth'] / MiB:.0f} MiB; peak resident {r['maxrss'] / MiB:.0f} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
