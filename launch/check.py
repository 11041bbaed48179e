"""`podtrain check`: one sharded model, a few real train steps on random tokens, printed."""

from __future__ import annotations

import time

import jax

from podtrain.orchestrator.common.errors import ConfigError
from podtrain.orchestrator.config.compose import load_config
from podtrain.orchestrator.plan.report import format_plan, make_plan
from podtrain.orchestrator.train.build import build_training
from podtrain.orchestrator.train.synthetic import random_batch


def run_command(args) -> int:
    if args.steps < 1:
        raise ConfigError(f"--steps: expected a positive number of train steps, found {args.steps}")
    config = load_config(args.config, args.overrides)
    training = build_training(config)
    print(format_plan(make_plan(training)))
    state = training.init_state()
    batch = random_batch(training, seed=config.train.seed)
    print(f"\nrunning {args.steps} train steps (forward, loss, backward, {config.optimizer.name} update) "
          "on random tokens")
    for i in range(args.steps):
        start = time.perf_counter()
        state, metrics = training.step(state, batch)
        loss = float(metrics["loss"])
        seconds = time.perf_counter() - start
        print(f"step {int(state.step)}: loss {loss:.4f}  grad_norm {float(metrics['grad_norm']):.4f}  "
              f"{seconds:.2f} s" + (" (includes compilation)" if i == 0 else ""))
    jax.block_until_ready(state)
    return 0
