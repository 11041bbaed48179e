"""Train-step benchmark of llama3-tiny on this CPU: step time and MFU, compile time and temp memory.

    PYTHONPATH=. .venv/bin/python bench/train_step.py [--quick] [--json] [--cpu-devices N]

1. The practical float32 matmul peak of this machine, measured in the same run (around every step
   timing; the highest is used, so MFU is never flattered by a slow peak measurement).
2. The full train step (forward, loss, backward, AdamW) of the preset for remat none / full / dots:
   median step time after warm-up, tokens/s, model FLOPs from `models.flops_per_token`,
   MFU = model FLOP/s / peak. On a shared machine the wall clock depends on the load, so the table
   also gives MFU (CPU time): model FLOPs per process CPU second over the matmul's FLOPs per CPU
   second, which depends much less on what else runs.
3. Trace + compile seconds and XLA temp memory of one train step at 2 / 8 / 32 layers, remat none
   vs full, scanned vs unrolled layers.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import jax

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (
    Peak,
    bench_config,
    compile_stats,
    format_table,
    machine_description,
    matmul_peak,
    table_row,
    time_train_step,
)

STEP_REMATS = ("none", "full", "dots")
COMPILE_REMATS = ("none", "full")
MFU_TARGET, MFU_AIM = 0.3, 0.5
TEMP_TARGET_MIB, TEMP_AIM_MIB = 300, 200
COMPILE_RATIO_TARGET = 1.3
TARGET_LAYERS, BASE_LAYERS = 32, 2

STEP_COLUMNS = [
    ("remat", "remat", "<6"), ("step_ms_median", "step ms (median)", ".0f"), ("step_ms_min", "step ms (min)", ".0f"),
    ("cpu_ms_median", "CPU ms (median)", ".0f"), ("tokens_per_s", "tokens/s", ".0f"),
    ("gflop_per_step", "GFLOP/step", ".1f"), ("gflops", "GFLOP/s", ".1f"), ("mfu", "MFU", ".3f"),
    ("mfu_best", "MFU (min step)", ".3f"), ("mfu_cpu", "MFU (CPU time)", ".3f"),
    ("first_call_s", "first call s", ".1f"),
]
COMPILE_COLUMNS = [
    ("layers", "layers", "d"), ("remat", "remat", "<5"), ("loop", "layers loop", "<8"), ("trace_s", "trace s", ".1f"),
    ("compile_s", "compile s", ".1f"), ("total_s", "total s", ".1f"), ("temp_mib", "temp MiB", ".1f"),
    ("argument_mib", "args MiB", ".1f"),
]
TARGET_COLUMNS = [("target", "target", "<48"), ("value", "measured", "<24"), ("status", "status", "<7")]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="3 timed steps; compile grid at 2 and 8 layers, scanned only (a few minutes)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    parser.add_argument("--cpu-devices", type=int, default=1,
                        help="simulated CPU devices for the step (default 1: the single-device benchmark)")
    args = parser.parse_args(argv)
    args.steps, args.warmup = (3, 1) if args.quick else (10, 2)
    args.layers = (2, 8) if args.quick else (2, 8, 32)
    args.loops = (True,) if args.quick else (True, False)
    args.compile_repeats = 1 if args.quick else 2
    return args


def run_step_timings(args: argparse.Namespace) -> tuple[list, list[Peak]]:
    """One StepTiming per remat policy, and matmul peaks measured before, between and after them.

    The machine may be shared: sampling the peak around every timing and keeping the highest
    keeps MFU from being flattered by a peak that happened to be measured while others ran.
    """
    timings, peaks = [], [matmul_peak()]
    for remat in STEP_REMATS:
        config = bench_config(remat=remat)
        timings.append(time_train_step(config, num_devices=args.cpu_devices, warmup=args.warmup, steps=args.steps))
        peaks.append(matmul_peak())
    return timings, peaks


def run_compile_grid(args: argparse.Namespace) -> list[dict]:
    """Compile statistics over layers x remat x loop; scanned rows keep the best of the repeats."""
    rows = []
    for scan in args.loops:
        for remat in COMPILE_REMATS:
            for layers in args.layers:
                config = bench_config(num_layers=layers, remat=remat, scan_layers=scan)
                repeats = args.compile_repeats if scan else 1
                runs = [compile_stats(config, num_devices=args.cpu_devices) for _ in range(repeats)]
                best = min(runs, key=lambda r: r["total_s"])
                rows.append({"layers": layers, "remat": remat, "loop": "scan" if scan else "unrolled", **best})
                if not args.json:
                    print(table_row(rows[-1], COMPILE_COLUMNS), flush=True)
    return rows


def _status(ok: bool) -> str:
    return "met" if ok else "NOT met"


def check_targets(step_rows: list[dict], compile_rows: list[dict]) -> list[dict]:
    """One row per target: what was measured and whether it is met."""
    best = max(step_rows, key=lambda r: r["mfu"])
    targets = [{
        "target": f"MFU >= {MFU_TARGET} (aim {MFU_AIM}), best remat",
        "value": f"{best['mfu']:.3f} ({best['remat']})",
        "status": _status(best["mfu"] >= MFU_TARGET),
    }]
    scan = {(r["layers"], r["remat"]): r for r in compile_rows if r["loop"] == "scan"}
    if (TARGET_LAYERS, "full") not in scan:
        return targets + [{"target": f"temp and compile time at {TARGET_LAYERS} layers", "value": "not measured",
                           "status": "n/a"}]
    temp = scan[(TARGET_LAYERS, "full")]["temp_mib"]
    targets.append({
        "target": f"temp at {TARGET_LAYERS} layers, full remat <= {TEMP_TARGET_MIB} MiB (aim {TEMP_AIM_MIB})",
        "value": f"{temp:.1f} MiB",
        "status": _status(temp <= TEMP_TARGET_MIB),
    })
    for remat in COMPILE_REMATS:
        ratio = scan[(TARGET_LAYERS, remat)]["total_s"] / scan[(BASE_LAYERS, remat)]["total_s"]
        targets.append({
            "target": f"compile {TARGET_LAYERS} / {BASE_LAYERS} layers <= {COMPILE_RATIO_TARGET} (scan, {remat})",
            "value": f"{ratio:.2f}",
            "status": _status(ratio <= COMPILE_RATIO_TARGET),
        })
    return targets


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.cpu_devices != 1:
        jax.config.update("jax_num_cpu_devices", args.cpu_devices)
    say = (lambda *_: None) if args.json else print
    say(f"# train step benchmark, {datetime.date.today()}, {machine_description()}")
    timings, peaks = run_step_timings(args)
    peak = Peak.best(peaks)
    step_rows = [t.row(peak) for t in timings]
    say(f"\nmatmul peak (f32 2048^3, best of 10), sampled around each timing: "
        f"{', '.join(f'{p.gflops:.0f}' for p in peaks)} GFLOP/s; MFU uses the highest, {peak.gflops:.1f} "
        f"({peak.gflop_per_cpu_s:.1f} GFLOP per CPU second for MFU (CPU time))\n")
    say(format_table(step_rows, STEP_COLUMNS))
    say("\n" + format_table([], COMPILE_COLUMNS))
    compile_rows = run_compile_grid(args)
    targets = check_targets(step_rows, compile_rows)
    say("\n" + format_table(targets, TARGET_COLUMNS))
    if args.json:
        results = {"machine": machine_description(), "peak": vars(peak), "peak_samples": [vars(p) for p in peaks]}
        print(json.dumps({**results, "steps": step_rows, "compile": compile_rows, "targets": targets}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
