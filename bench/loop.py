"""Loop-overhead and checkpoint benchmark of llama3-tiny: the full training loop vs the bare jitted step.

    PYTHONPATH=. .venv/bin/python bench/loop.py [--steps N] [--json]

1. Bare step: the jitted train step called back to back on one batch (the same batch every
   time), timed per call with `block_until_ready`.
2. Full loop: `orchestrator.train.loop.run` on the embedded default corpus (grain pipeline, byte
   tokenizer), metrics to `metrics.jsonl` and TensorBoard, an async Orbax checkpoint every 10
   steps; its step times are read back from `metrics.jsonl` (the first step, which compiles, is
   left out). Overhead = loop median / bare median - 1.
3. Checkpoints of the train state (params + AdamW state): how long `save()` blocks the caller
   with `async_save`, the total time until the save is committed, the same for a synchronous save,
   and the time to restore the latest step onto the mesh.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import BENCH_SHAPE, MIB, format_table, machine_description, time_calls
from podtrain.orchestrator.checkpoint.checkpointer import Checkpointer
from podtrain.orchestrator.config.compose import load_config
from podtrain.orchestrator.data.pipeline import make_dataset, to_global_batch
from podtrain.orchestrator.data.tokenizers import load_tokenizer
from podtrain.orchestrator.train.build import build_training
from podtrain.orchestrator.train.loop import run

OVERHEAD_TARGET = 0.05
SAVE_EVERY = 10


def bench_config(steps: int):
    config = load_config("llama3-tiny", [*BENCH_SHAPE, f"train.steps={steps}", "train.eval_every=0",
                                         f"checkpoint.every_steps={SAVE_EVERY}", "checkpoint.async_save=true"])
    return config


def first_batch(config, training):
    tokenizer = load_tokenizer(config.data.tokenizer, eos_token=config.data.eos_token,
                               bos_token=config.data.bos_token)
    dataset = make_dataset(config.data, tokenizer, seq_len=config.train.seq_len,
                           global_batch=config.train.batch_size)
    return to_global_batch(next(iter(dataset)), training.batch_sharding)


def bare_step_times(config, steps: int) -> list[float]:
    training = build_training(config)
    holder = {"state": training.init_state()}
    batch = first_batch(config, training)

    def one_step():
        holder["state"], metrics = training.step(holder["state"], batch)
        return metrics

    time_calls(one_step, 2)  # compile and warm up
    return time_calls(one_step, steps).wall


def loop_step_times(config, workdir: Path) -> tuple[list[float], list[float]]:
    result = run(config, workdir / "loop")
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step_s"] for r in records[1:]]
    saves = [r["save_block_s"] for r in records if "save_block_s" in r]
    return steps, saves


def checkpoint_times(config, workdir: Path, repeats: int = 3) -> dict:
    training = build_training(config)
    state = training.init_state()
    state_bytes = sum(x.nbytes for x in jax.tree.leaves(state))
    rows = {"state_mib": state_bytes / MIB}
    for mode in ("async", "sync"):
        ckpt_config = dataclasses.replace(config.checkpoint, async_save=mode == "async", keep=repeats + 1)
        blocked, total = [], []
        with Checkpointer(workdir / f"ckpt-{mode}", ckpt_config) as checkpointer:
            for step in range(1, repeats + 1):
                start = time.perf_counter()
                checkpointer.save(step, state, force=True)
                blocked.append(time.perf_counter() - start)
                checkpointer.wait()
                total.append(time.perf_counter() - start)
            if mode == "async":
                restore = []
                for _ in range(repeats):
                    start = time.perf_counter()
                    jax.block_until_ready(checkpointer.restore(training.abstract_state())[0])
                    restore.append(time.perf_counter() - start)
                rows["restore_s"] = statistics.median(restore)
        rows[f"{mode}_save_block_s"] = statistics.median(blocked)
        rows[f"{mode}_save_total_s"] = statistics.median(total)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="loop steps (and bare steps timed)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    args = parser.parse_args(argv)
    say = (lambda *_: None) if args.json else print
    say(f"# loop benchmark, {datetime.date.today()}, {machine_description()}")
    config = bench_config(args.steps)
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        bare = bare_step_times(config, args.steps)
        loop, saves = loop_step_times(config, workdir)
        ckpt = checkpoint_times(config, workdir)
    bare_ms, loop_ms = 1e3 * statistics.median(bare), 1e3 * statistics.median(loop)
    loop_mean_ms, bare_mean_ms = 1e3 * statistics.mean(loop), 1e3 * statistics.mean(bare)
    steps = {
        "bare_ms_median": bare_ms, "loop_ms_median": loop_ms, "overhead_median": loop_ms / bare_ms - 1,
        "bare_ms_mean": bare_mean_ms, "loop_ms_mean": loop_mean_ms, "overhead_mean": loop_mean_ms / bare_mean_ms - 1,
        "loop_save_block_ms_median": 1e3 * statistics.median(saves) if saves else float("nan"),
    }
    say(f"\n{args.steps} steps, llama3-tiny (batch {config.train.batch_size} x seq {config.train.seq_len}), "
        f"async checkpoint every {SAVE_EVERY} steps, 1 process, {jax.device_count()} device(s)\n")
    say(format_table([steps], [
        ("bare_ms_median", "bare step ms (median)", ".1f"), ("loop_ms_median", "loop step ms (median)", ".1f"),
        ("overhead_median", "overhead (median)", "+.1%"), ("bare_ms_mean", "bare ms (mean)", ".1f"),
        ("loop_ms_mean", "loop ms (mean)", ".1f"), ("overhead_mean", "overhead (mean)", "+.1%"),
        ("loop_save_block_ms_median", "save() blocks the loop, ms", ".1f"),
    ]))
    say(f"\ncheckpoint of the train state ({ckpt['state_mib']:.1f} MiB: params + AdamW moments), median of 3\n")
    say(format_table([ckpt], [
        ("async_save_block_s", "async save() blocks s", ".3f"), ("async_save_total_s", "async save total s", ".3f"),
        ("sync_save_total_s", "sync save s", ".3f"), ("restore_s", "restore s", ".3f"),
    ]))
    status = "met" if steps["overhead_median"] <= OVERHEAD_TARGET else "NOT met"
    say(f"\nloop overhead target <= {OVERHEAD_TARGET:.0%}: {steps['overhead_median']:+.1%} (median), {status}")
    if args.json:
        print(json.dumps({"machine": machine_description(), "steps": steps, "checkpoint": ckpt}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
