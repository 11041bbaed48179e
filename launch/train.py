"""`podtrain train`: a run on its cluster (`cluster.kind`: local, tpu, gpu), or in this process (`none`)."""

from __future__ import annotations

import logging
import sys

from podtrain.orchestrator.checkpoint.rundir import RunLock, resolve_run_dir
from podtrain.orchestrator.common.protocol import EXIT_PREEMPTED
from podtrain.orchestrator.config.compose import load_config, resolve_preset
from podtrain.orchestrator.train.loop import run
from podtrain.orchestrator.train.preflight import check_inputs


def log_podtrain_messages() -> None:
    """podtrain's own messages at INFO on stderr (where the run starts, samples at evals); the
    libraries' stay at WARNING (importing JAX and Orbax gave the root logger absl's handler, so
    basicConfig would do nothing)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    ours = logging.getLogger("podtrain")
    ours.setLevel(logging.INFO)
    ours.addHandler(handler)
    ours.propagate = False


def run_command(args) -> int:
    log_podtrain_messages()
    config = load_config(args.config, args.overrides)
    run_dir = resolve_run_dir(config, resolve_preset(args.config).stem)
    if config.cluster.kind != "none":
        from podtrain.orchestrator.cluster.driver import run_job

        return run_job(config, run_dir).exit_code
    inputs = check_inputs(config, run_dir)  # before the lock creates the run directory
    with RunLock(run_dir, "podtrain train cluster=none"):
        result = run(config, run_dir, inputs=inputs)
    print("\n" + result.summary())
    return EXIT_PREEMPTED if result.preempted else 0
