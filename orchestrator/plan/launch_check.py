"""The plan check before a launch: `podtrain train` and `podtrain submit` of TPU slices or GPU nodes
compile the train step for the reservation's target and refuse a step that does not fit, before
anything is reserved (`check_before_launch`).

The compile runs in a child process (`podtrain plan --target ... --json` on the resolved config):
this process never starts a JAX backend (on a TPU VM that would take the chips the workers need)
and the compiler's memory is returned when it ends.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile

from podtrain.orchestrator.common.errors import ConfigError
from podtrain.orchestrator.config.compose import to_yaml
from podtrain.orchestrator.config.schema import Config
from podtrain.orchestrator.plan.targets import AOT_INSTALL, cluster_target, verdict_line


def _has_compiler(platform: str) -> bool:
    name = "libtpu" if platform == "tpu" else "jax_plugins.xla_cuda12"
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def check_before_launch(config: Config, say=None) -> bool:
    """Compiles `config`'s step for its cluster's target; True when it was checked and fits.

    Raises:
        ConfigError: the step does not fit (with the figures and the change that fits, if one was
            found), or the config cannot be compiled for the target.
    """
    # Notices go where the driver's progress lines go (stdout): stderr is for the one-line errors.
    say = say or (lambda line: print(f"podtrain: {line}", flush=True))
    cluster = config.cluster
    if not config.plan.check_before_launch or cluster.kind not in ("tpu", "gpu"):
        return False
    if "JAX_PLATFORMS" in cluster.env:
        say(f"plan check skipped: cluster.env.JAX_PLATFORMS={cluster.env['JAX_PLATFORMS']} (not the target's devices)")
        return False
    target = cluster_target(cluster)
    if target is None:
        say("plan check skipped: set cluster.gpu_type (h100, h200, a100-80gb) to check the step fits the GPUs")
        return False
    if not _has_compiler(target.chip.platform):
        say(f"plan check skipped: compiling for {target.name} needs the aot extra ({AOT_INSTALL})")
        return False
    with tempfile.TemporaryDirectory(prefix="podtrain-plan-") as tmp:
        path = os.path.join(tmp, "config.yaml")
        with open(path, "w") as f:
            f.write(to_yaml(config))
        cmd = [sys.executable, "-m", "podtrain.launch.cli", "plan", "-c", path, "--target", target.name, "--json"]
        # The compiler flags the workers will get apply to this compile too.
        flags = {k: v for k, v in cluster.env.items() if k in ("XLA_FLAGS", "LIBTPU_INIT_ARGS")}
        done = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, JAX_PLATFORMS="cpu", **flags))
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines:
        errors = [line for line in done.stderr.splitlines() if line.startswith("podtrain: error:")]
        reason = errors[-1].removeprefix("podtrain: error: ") if errors else (
            done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
        raise ConfigError(f"plan check for {target.name}: {reason}")
    report = json.loads(lines[-1])["target"]
    if not report["fits"]:
        raise ConfigError(f"plan check: {verdict_line(report)}; nothing was reserved "
                          "(plan.check_before_launch=false launches anyway)")
    say(f"plan check: {verdict_line(report)}")
    return True
