"""`podtrain export -c <preset> checkpoint=<dir> out=<dir> [step=N]`: a checkpoint's weights as HF safetensors.

`checkpoint=` may name a run directory (its `checkpoints/` is used), a checkpoint directory, or
one step folder inside it. The newest committed step is exported unless `step=` names one. Only
the parameters are read (never the optimizer state), each straight into its sharding on the
mesh of `-c` and the overrides, then `models.to_hf` writes them. The model section of the config
must equal the one the checkpoint was trained with (apart from compute dtype, remat and the
like); any difference is an error that names it.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import yaml
from flax import nnx

from models import to_hf
from orchestrator.build import Training, build_training
from orchestrator.checkpoint import Checkpointer
from orchestrator.config import Config, ConfigError, load_config

EXPORT_KEYS = ("checkpoint", "out", "step")


def split_export_args(overrides: list[str]) -> tuple[dict[str, str], list[str]]:
    """Takes `checkpoint=`, `out=` and `step=` out of the overrides; the rest are config overrides."""
    found, rest = {}, []
    for item in overrides:
        key, sep, value = item.partition("=")
        if sep and key in EXPORT_KEYS:
            if key in found:
                raise ConfigError(f"{key}= given twice ({found[key]!r} and {value!r})")
            found[key] = value
        else:
            rest.append(item)
    for key in ("checkpoint", "out"):
        if not found.get(key):
            raise ConfigError(f"export needs {key}=<dir> (usage: podtrain export -c <preset> checkpoint=<dir> "
                              "out=<dir> [step=N])")
    if "step" in found and not found["step"].isdigit():
        raise ConfigError(f"step= expects a non-negative integer, found {found['step']!r}")
    return found, rest


def resolve_checkpoint(path: str) -> tuple[Path, int | None]:
    """(checkpoint directory, step or None) for a run directory, a checkpoint directory or a step folder."""
    p = Path(path).expanduser().absolute()
    if not p.is_dir():
        raise ConfigError(f"checkpoint={path}: no such directory")
    if (p / "checkpoints").is_dir():
        p = p / "checkpoints"
    if p.name.isdigit() and (p / "state").is_dir():
        return p.parent, int(p.name)
    if not any(child.name.isdigit() for child in p.iterdir()):
        raise ConfigError(f"checkpoint={path}: expected a run directory, a checkpoint directory or a step folder; "
                          f"found no committed step folder in {p}")
    return p, None


# Model keys that change how the model runs or is initialised, not what its weights are.
RUNTIME_KEYS = {"dtype", "remat", "scan_layers", "initializer_range"}


def _model_differences(saved: dict, model) -> list[str]:
    current = dataclasses.asdict(model)
    return [
        f"model.{key}: checkpoint has {saved.get(key)!r}, config has {current.get(key)!r}"
        for key in sorted((set(saved) | set(current)) - RUNTIME_KEYS) if saved.get(key) != current.get(key)
    ]


def restore_model(config: Config, checkpoint: str, step: int | None = None) -> tuple[Training, nnx.Module, int]:
    """(training setup, model, step): the params of `checkpoint=` (a run, checkpoint or step
    directory) restored straight into their sharding on `config`'s mesh, the newest committed step
    unless `step` (or the step folder) names one. The checkpoint's model keys must equal `config`'s."""
    directory, found_step = resolve_checkpoint(checkpoint)
    step = found_step if step is None else step
    training = build_training(config)
    with Checkpointer(directory, dataclasses.replace(config.checkpoint, resume="auto")) as checkpointer:
        steps = checkpointer.all_steps()
        step = steps[-1] if step is None and steps else step
        if step not in steps:
            raise ConfigError(f"step={step}: not in {directory} (committed steps: {steps})")
        saved_model = (yaml.safe_load(checkpointer.meta(step).get("config_yaml", "")) or {}).get("model")
        differences = _model_differences(saved_model, config.model) if saved_model is not None else []
        if differences:
            raise ConfigError(f"checkpoint {directory / str(step)} was trained with a different model: "
                              + "; ".join(differences))
        params, _, step = checkpointer.restore_params(training.abstract_state(), step=step)
    return training, nnx.merge(training.graphdef, params), step


def run_command(args) -> int:
    export, overrides = split_export_args(args.overrides)
    config = load_config(args.config, overrides)
    directory, _ = resolve_checkpoint(export["checkpoint"])
    out = Path(export["out"]).expanduser()
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"out={export['out']}: directory exists and is not empty; choose a new path")
    _, model, step = restore_model(config, export["checkpoint"], int(export["step"]) if "step" in export else None)
    to_hf(model, config.model, out)
    files = sorted(out.iterdir())
    size = sum(f.stat().st_size for f in files)
    print(f"exported step {step} of {directory} to {out}: {len(files)} files, {size / 2**20:.1f} MiB "
          f"({', '.join(f.name for f in files)})")
    print(f"load it with transformers.AutoModelForCausalLM.from_pretrained({os.fspath(out)!r})")
    return 0
