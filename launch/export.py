"""`podtrain export -c <preset> checkpoint=<dir> out=<dir> [step=N]`: a checkpoint's weights as HF safetensors.

`checkpoint=` may name a run directory (its `checkpoints/` is used), a checkpoint directory, or
one step folder inside it. The newest committed step is exported unless `step=` names one. Only
the parameters are read (never the optimizer state), each straight into its sharding on the
mesh of `-c` and the overrides, then `models.to_hf` writes them. The model section of the config
must equal the one the checkpoint was trained with (apart from compute dtype, remat and the
like); any difference is an error that names it.
"""

from __future__ import annotations

import os
from pathlib import Path

from models import to_hf
from orchestrator.config import ConfigError, load_config
from orchestrator.load import resolve_checkpoint, restore_model

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
