"""One JAX process of a gang, started fresh for every attempt by a host actor (`orchestrator/cluster/`).

    python -m podtrain.orchestrator.cluster.worker    (everything else comes from PODTRAIN_* variables)

The host actor sets the environment (JAX platform and device flags, TPU and MEGASCALE variables,
the PODTRAIN_* names in `orchestrator.common.protocol`) before this module runs, so it is in
place before JAX is imported. The worker then joins the JAX world with
`jax.distributed.initialize`, trains with `orchestrator.train.loop.run`, reports every completed step
through its heartbeat file, and leaves with a status the driver classifies (see `protocol`).
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

from podtrain.orchestrator.cluster.host import port_is_free
from podtrain.orchestrator.common import protocol as p

# What `jax.distributed.initialize` says when the coordinator's port is taken (jax 0.10: "UNKNOWN: Failed to
# start RPC server", with gRPC's "Failed to add port to server" on stderr).
_PORT_TAKEN = ("failed to start rpc server", "address already in use", "failed to bind")


def _exit_with_parent(parent_pid: int) -> None:
    """Kills this process group once the host actor that started it is gone (no orphaned trainers)."""

    def watch():
        while True:
            if os.getppid() != parent_pid:
                os.killpg(os.getpgrp(), signal.SIGKILL)
            time.sleep(1.0)

    threading.Thread(target=watch, name="podtrain-parent-watch", daemon=True).start()


def port_taken(error: Exception) -> bool:
    """Whether `jax.distributed.initialize` failed because the coordinator could not bind its port."""
    return any(needle in str(error).lower() for needle in _PORT_TAKEN)


def _leave_if_coordinator_port_taken(env) -> None:
    """Process 0 checks its coordinator port first: on a taken port JAX raises an unhelpful error, or dies
    of SIGSEGV before any handler runs (seen with jax 0.10.2), so the driver could not retry another port."""
    port = int(env[p.ENV_COORDINATOR].rpartition(":")[2])
    if int(env[p.ENV_PROCESS_ID]) == 0 and not port_is_free(port):
        print(f"podtrain worker: coordinator port {port} is taken on this host", file=sys.stderr, flush=True)
        sys.exit(p.EXIT_COORDINATOR_PORT)


# JAX's own deadline for `jax.distributed.initialize`, beyond `cluster.init_timeout_s`: the driver,
# which watches every rank's phase, names the rank that did not join before a waiting rank gives up
# with an error that blames nobody.
INIT_MARGIN_S = 60


def _initialize_distributed(env) -> None:
    import jax

    num_processes = int(env[p.ENV_NUM_PROCESSES])
    if num_processes == 1:
        return
    _leave_if_coordinator_port_taken(env)
    local_ids = env.get(p.ENV_LOCAL_DEVICE_IDS)
    # Simulated slices on CPU: a TPU learns its slice from the MEGASCALE variables; CPU devices get it here.
    slice_index = int(env["MEGASCALE_SLICE_ID"]) if "MEGASCALE_SLICE_ID" in env and env.get(
        "JAX_PLATFORMS") == "cpu" else None
    try:
        jax.distributed.initialize(
            env[p.ENV_COORDINATOR], num_processes=num_processes, process_id=int(env[p.ENV_PROCESS_ID]),
            local_device_ids=[int(i) for i in local_ids.split(",")] if local_ids else None,
            initialization_timeout=int(env[p.ENV_INIT_TIMEOUT]) + INIT_MARGIN_S,
            heartbeat_timeout_seconds=int(env[p.ENV_HEARTBEAT_TIMEOUT]),
            slice_index=slice_index,
        )
    except Exception as error:  # the coordinator's port was taken between choosing and binding it
        if port_taken(error):
            print(f"podtrain worker: coordinator port unavailable: {error}", file=sys.stderr, flush=True)
            sys.exit(p.EXIT_COORDINATOR_PORT)
        raise


def _describe_process(env) -> None:
    import jax

    slices = sorted({getattr(d, "slice_index", 0) for d in jax.devices()})
    megascale = " ".join(f"{k}={v}" for k, v in sorted(env.items()) if k.startswith("MEGASCALE_"))
    print(f"podtrain worker: process {jax.process_index()} of {jax.process_count()}, "
          f"{jax.local_device_count()} local of {jax.device_count()} {jax.devices()[0].platform} devices, "
          f"slices {slices}, coordinator {env.get(p.ENV_COORDINATOR, '-')} {megascale}".rstrip(), flush=True)


def main() -> int:
    env = os.environ
    if env.get(p.ENV_PARENT_PID):
        _exit_with_parent(int(env[p.ENV_PARENT_PID]))
    if env.get(p.ENV_STACKS_FILE):
        stacks = open(env[p.ENV_STACKS_FILE], "a")  # noqa: SIM115 (open for the life of the process)
        faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    from podtrain.orchestrator.common.errors import ConfigError
    from podtrain.orchestrator.common.platforms import start_jax
    from podtrain.orchestrator.config.compose import load_config

    start_jax()

    error_file = env.get(p.ENV_ERROR_FILE)
    heartbeat = p.Heartbeat(env.get(p.ENV_HEARTBEAT_FILE))
    try:
        serving = env.get(p.ENV_ROLE) == "serve"
        config, run_dir = load_config(env[p.ENV_CONFIG], serving=serving), Path(env[p.ENV_RUN_DIR])
        from podtrain.orchestrator.train.goodput import process_phase
        from podtrain.orchestrator.train.preflight import check_inputs

        # Before joining the JAX world: every rank finds the same mistake and leaves at once, and
        # none is left waiting in a collective for a peer that left.
        inputs = check_inputs(config, run_dir, data=not serving)
        joined = time.time()
        heartbeat.phase("distributed")
        _initialize_distributed(env)
        process_phase("distributed", joined, time.time())
        _describe_process(env)
        if serving:
            from podtrain.orchestrator.serve.gang import worker_main

            return worker_main(config, run_dir, env, heartbeat)
        from podtrain.orchestrator.train.loop import run

        result = run(config, run_dir, inputs=inputs, heartbeat=heartbeat)
    except SystemExit as stop:
        if stop.code == p.EXIT_COORDINATOR_PORT:
            return p.EXIT_COORDINATOR_PORT
        raise
    except ConfigError as error:
        if error_file:
            p.write_error(error_file, "config", str(error))
        print(f"podtrain: error: {error}", file=sys.stderr, flush=True)
        return p.EXIT_CONFIG
    except BaseException as error:
        text = traceback.format_exc()
        if error_file:
            p.write_error(error_file, "exception", p.describe_exception(error), text)
        print(text, file=sys.stderr, flush=True)
        return p.EXIT_EXCEPTION
    if int(env[p.ENV_PROCESS_ID]) == 0:
        print("\n" + result.summary(), flush=True)
    return p.EXIT_PREEMPTED if result.preempted else p.EXIT_OK


def _exit(code: int) -> None:
    """Leaves at once on failure: a normal exit would wait in JAX's shutdown barrier for ranks that never come."""
    sys.stdout.flush()
    sys.stderr.flush()
    if code in (p.EXIT_OK, p.EXIT_PREEMPTED):
        sys.exit(code)  # every rank ends together: shut the JAX world down cleanly
    os._exit(code)


if __name__ == "__main__":
    _exit(main())
