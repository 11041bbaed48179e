"""One JAX process of a multi-process test: trains a few steps and prints the losses as JSON."""

import json
import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={os.environ['DEVICES_PER_PROCESS']}"

import jax  # noqa: E402

from orchestrator.build import build_training  # noqa: E402
from orchestrator.config import load_config  # noqa: E402

if __name__ == "__main__":
    num_processes = int(os.environ["NUM_PROCESSES"])
    if num_processes > 1:
        jax.distributed.initialize(
            os.environ["COORDINATOR"], num_processes=num_processes, process_id=int(os.environ["PROCESS_ID"]),
            initialization_timeout=60, heartbeat_timeout_seconds=30,
        )
    training = build_training(load_config("qwen3-tiny", sys.argv[1:]))
    state = training.init_state()
    losses = []
    for step in range(3):
        state, metrics = training.step(state, training.random_batch(seed=step))
        losses.append(float(metrics["loss"]))
    print(json.dumps({"process": jax.process_index(), "devices": jax.device_count(), "losses": losses}), flush=True)
    if num_processes > 1:
        jax.distributed.shutdown()
