"""`podtrain submit --address http://HEAD:8265 -c <preset> [key=value ...]`: `ray job submit` of `podtrain train`.

The config is loaded and validated here first (a mistake costs no cluster time), and a relative
`run.dir` is made absolute here (the job itself runs in Ray's temporary copy of the working
directory, where the run would be lost at the next Ray restart or code change). The job gets the
working directory (without virtualenvs, run outputs and caches), `RAY_JOB_STOP_WAIT_TIME_S` set
from `cluster.stop_grace_s` so that `ray job stop` leaves the workers time to checkpoint, and the
run name as its job id. With `--follow` (the default) the job's logs are streamed until it ends.
"""

from __future__ import annotations

import asyncio
import shlex
import time
from pathlib import Path

from podtrain.orchestrator.common.errors import ConfigError
from podtrain.orchestrator.config.compose import load_config, resolve_preset

EXCLUDES = [".venv", "venv", ".git", "runs", "__pycache__", "*.pyc", ".pytest_cache", ".ruff_cache", "*.egg-info"]
STOP_MARGIN_S = 30  # beyond cluster.stop_grace_s: the driver's own clean-up after the workers exit
AGENT_WAIT_S = 60.0  # a head just started has no job agent for a while; Ray says to try again later


def add_arguments(cmd) -> None:
    cmd.add_argument("--address", default=None, help="Ray dashboard address, e.g. http://HEAD:8265 "
                                                     "(default: $RAY_ADDRESS)")
    cmd.add_argument("--working-dir", default=".", help="directory shipped to the cluster as the job's working dir")
    cmd.add_argument("--no-follow", action="store_true", help="print the job id and return without streaming logs")


def entrypoint(preset: str, overrides: list[str], working_dir: Path) -> str:
    """The job's command line; a preset file inside the working dir is named relative to it."""
    path = Path(preset)
    if path.suffix in (".yaml", ".yml") and path.exists():
        try:
            preset = str(path.resolve().relative_to(working_dir.resolve()))
        except ValueError:
            raise ConfigError(f"-c {preset}: a config file must be inside --working-dir {working_dir} "
                              "to reach the cluster") from None
    return shlex.join(["podtrain", "train", "-c", preset, *overrides])


def absolute_run_dir(config, overrides: list[str]) -> list[str]:
    """`overrides` with `run.dir` made absolute here, where the user named it: the job runs in Ray's
    temporary copy of the working directory, where a relative one would put the run."""
    base = Path(config.run.dir).expanduser()
    if base.is_absolute():
        return list(overrides)
    kept = [item for item in overrides if item.partition("=")[0].strip() != "run.dir"]
    return [*kept, f"run.dir={base.absolute()}"]


def _first_line(error: Exception) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def submit_when_agent_is_up(client, address: str, wait_s: float = AGENT_WAIT_S, **job) -> None:
    """`client.submit_job(**job)`, tried again while the head has no job agent yet (a head just
    started), for up to `wait_s`."""
    deadline, told = time.monotonic() + wait_s, False
    while True:
        try:
            client.submit_job(**job)
            return
        except RuntimeError as e:
            if "No available agent" not in str(e):
                raise
            if time.monotonic() >= deadline:
                raise ConfigError(f"--address {address}: Ray's head has had no job agent for {wait_s:g}s "
                                  f"({_first_line(e)}); is its dashboard agent running?") from None
            if not told:
                print(f"Ray's head at {address} has no job agent yet; trying again for up to {wait_s:g}s", flush=True)
                told = True
            time.sleep(1.0)


def run_command(args) -> int:
    import os

    from ray.exceptions import RpcError
    from ray.job_submission import JobStatus, JobSubmissionClient

    config = load_config(args.config, args.overrides)
    if config.cluster.kind == "none":
        raise ConfigError("cluster.kind=none trains inside the submitting process; submit local, tpu or gpu")
    address = args.address or os.environ.get("RAY_ADDRESS")
    if not address:
        raise ConfigError("submit needs --address http://HEAD:8265 (or RAY_ADDRESS)")
    working_dir = Path(args.working_dir)
    job_id = config.run.name or resolve_preset(args.config).stem
    from podtrain.orchestrator.plan.launch_check import check_before_launch

    checked = check_before_launch(config)  # before Ray is asked anything
    try:
        client = JobSubmissionClient(address)
        jobs = client.list_jobs()
    except (OSError, RuntimeError, RpcError) as e:  # ConnectionError and requests' errors are OSErrors
        raise ConfigError(f"--address {address}: cannot reach Ray there ({_first_line(e)}); "
                          "give the head's dashboard address, e.g. http://HEAD:8265") from None
    if any(job.submission_id == job_id for job in jobs):
        raise ConfigError(f"a job with id {job_id!r} already exists on {address}; choose another run.name "
                          "(the run name is the job id)")
    env_vars = {"RAY_JOB_STOP_WAIT_TIME_S": str(int(config.cluster.stop_grace_s + STOP_MARGIN_S))}
    for name in ("RAY_AUTH_MODE",):
        if os.environ.get(name):
            env_vars[name] = os.environ[name]
    overrides = absolute_run_dir(config, args.overrides)
    if checked:  # the job need not compile it again
        overrides = [item for item in overrides if item.partition("=")[0].strip() != "plan.check_before_launch"]
        overrides.append("plan.check_before_launch=false")
    command = entrypoint(args.config, overrides, working_dir)
    runtime_env = {"working_dir": str(working_dir), "excludes": EXCLUDES, "env_vars": env_vars}
    submit_when_agent_is_up(client, address, entrypoint=command, submission_id=job_id, runtime_env=runtime_env)
    print(f"submitted job {job_id} to {address}: {command}")
    print(f"  run directory: {Path(config.run.dir).expanduser().absolute() / job_id}")
    print(f"  logs: ray job logs --address {address} -f {job_id}   stop: ray job stop --address {address} {job_id}")
    if args.no_follow:
        return 0

    async def follow():
        async for lines in client.tail_job_logs(job_id):
            print(lines, end="", flush=True)

    asyncio.run(follow())
    status = client.get_job_status(job_id)
    while not status.is_terminal():
        time.sleep(1.0)
        status = client.get_job_status(job_id)
    print(f"job {job_id}: {status.value}")
    return 0 if status == JobStatus.SUCCEEDED else 1
