"""`podtrain train`: one training run on this process's devices (the local default)."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from orchestrator.config import load_config, resolve_preset
from orchestrator.train import EXIT_PREEMPTED, run


def run_command(args) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    config = load_config(args.config, args.overrides)
    run_dir = Path(config.run.dir) / (config.run.name or resolve_preset(args.config).stem)
    result = run(config, run_dir)
    if result.first_loss is None:
        print(f"\nnothing to do: the run is already at step {result.end_step} of train.steps")
    else:
        print(f"\nsteps {result.start_step} -> {result.end_step}; loss first {result.first_loss:.4f}, "
              f"last {result.last_loss:.4f}; {result.tokens_per_s:,.0f} tokens/s")
    print(f"run directory {result.run_dir}: config.yaml, metrics.jsonl, tensorboard/, "
          f"checkpoints/ (last committed step {result.last_checkpoint})")
    if result.preempted:
        print(f"stopped on a preemption notice after checkpointing step {result.last_checkpoint}")
        return EXIT_PREEMPTED
    return 0
