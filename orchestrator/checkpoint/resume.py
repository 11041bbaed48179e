"""Where a run resumes, read without Orbax: a checkpoint directory's committed steps, the step
`checkpoint.resume` names, and whether that step fits the config (model keys, batch size).

The driver and the pre-flight checks use these before anything starts, so they read plain files:
a committed step is a folder named by a bare integer (Orbax builds a step in
`<step>.orbax-checkpoint-tmp/` and renames it once every process has finished), and its JSON items
(`meta`, `data_position`, `fingerprints`) are `<step>/<item>/metadata`.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

import yaml
from etils import epath

from podtrain.orchestrator.common.errors import ConfigError
from podtrain.orchestrator.config.compose import flatten_keys
from podtrain.orchestrator.config.schema import Config

# What a damaged JSON item raises: a missing file an OSError, broken JSON a ValueError.
_UNREADABLE = (OSError, ValueError)


def read_item(directory: str, step: int, item: str) -> dict:
    """A JSON item of a step (`meta`, `data_position`, `fingerprints`), as Orbax's JsonSave wrote it."""
    return dict(json.loads((epath.Path(directory) / str(step) / item / "metadata").read_text()))


def has_item(directory: str, step: int, item: str) -> bool:
    return (epath.Path(directory) / str(step) / item).exists()


# Model keys that change how the model runs, is initialised or is trained, not what its weights
# are: a run may resume with other values (DeepSeek-V3 stops its router-bias updates late in
# training), and export and generate take any.
RUNTIME_MODEL_KEYS = frozenset({"attention", "interpret_kernels", "dtype", "remat", "scan_layers",
                                "initializer_range", "moe.bias_update_rate", "moe.capacity_factor",
                                "moe.buffer_factor", "moe.grouped_matmul", "moe.exchange"})


def model_differences(meta: Mapping, model: Any, shown: int = 3) -> str:
    """How the model keys a step was saved with (its `meta["config_yaml"]`) differ from `model` (a
    `ModelConfig`), apart from `RUNTIME_MODEL_KEYS`: the first `shown`, then how many more; "" when
    they are equal (or the step records no config)."""
    saved = (yaml.safe_load(meta.get("config_yaml", "")) or {}).get("model")
    if saved is None:
        return ""
    return _differences(flatten_keys(saved), flatten_keys(dataclasses.asdict(model)), "checkpoint has", shown)


def lora_differences(meta: Mapping, lora: Any) -> str:
    """How the adapters a step was saved with (rank, then alpha and targets) differ from `lora`."""
    saved = (yaml.safe_load(meta.get("config_yaml", "")) or {}).get("lora") or {}
    found = {"rank": saved.get("rank", 0), "alpha": saved.get("alpha"), "targets": tuple(saved.get("targets") or ())}
    keys = ["rank"] if found["rank"] != lora.rank or not lora.rank else ["alpha", "targets"]
    return "; ".join(f"lora.{key}: checkpoint has {found[key]!r}, config has {getattr(lora, key)!r}"
                     for key in keys if found[key] != getattr(lora, key))


def model_key_differences(found: Any, wanted: Any, shown: int = 3) -> str:
    """How the `ModelConfig` `found` differs from the config's, `wanted`, as `model_differences` says it."""
    return _differences(flatten_keys(dataclasses.asdict(found)), flatten_keys(dataclasses.asdict(wanted)), "found",
                        shown)


def _differences(found: dict, wanted: dict, label: str, shown: int) -> str:
    differences = [f"model.{key}: {label} {found.get(key)!r}, config has {wanted.get(key)!r}"
                   for key in sorted((set(found) | set(wanted)) - RUNTIME_MODEL_KEYS)
                   if found.get(key) != wanted.get(key)]
    more = f"; and {len(differences) - shown} more" if len(differences) > shown else ""
    return "; ".join(differences[:shown]) + more


def committed_steps(directory: str) -> list[int]:
    """The committed steps in a checkpoint directory (folders named by a bare integer), oldest first;
    read without Orbax, so the driver can look before anything starts."""
    path = epath.Path(directory)
    if not path.is_dir():
        return []
    return sorted(int(p.name) for p in path.iterdir() if p.name.isdigit() and p.is_dir())


def resume_step(resume: str, directory: str, steps: list[int]) -> int | None:
    """The step `checkpoint.resume` starts from (for `auto`, the newest: older ones are fallbacks),
    or None for a fresh start.

    Raises:
        ConfigError: `none` but `steps` is not empty, or a step number that is not in `steps`.
    """
    if resume == "none":
        if steps:
            raise ConfigError(f"checkpoint.resume=none, but {directory} already holds steps {steps}: use "
                              "resume=auto to continue that run, or a new checkpoint.dir to start over")
        return None
    if resume == "auto":
        return steps[-1] if steps else None
    if int(resume) not in steps:
        raise ConfigError(f"checkpoint.resume={resume}: no such step in {directory} (steps: {steps})")
    return int(resume)


def check_resume_matches(directory: str, step: int, config: Config) -> None:
    """Raises ConfigError when `step` was saved with other model keys or another `train.batch_size`
    than `config`: restoring it would fail on every step, each reported as damaged. A step whose
    metadata cannot be read is left to the restore, which falls back past it."""
    try:
        meta = read_item(directory, step, "meta")
        differences = model_differences(meta, config.model) or lora_differences(meta, config.lora)
        positions = read_item(directory, step, "data_position") if has_item(directory, step, "data_position") else None
    except _UNREADABLE:
        return
    if differences:
        raise ConfigError(f"checkpoint step {step} in {directory} was trained with a different model: "
                          f"{differences}. Resume with the model it was trained with, or start a new run "
                          "(run.name or checkpoint.dir)")
    if positions is not None and len(positions) != config.train.batch_size:
        raise ConfigError(f"checkpoint step {step} in {directory}: the saved data position has {len(positions)} "
                          f"rows, but this run has train.batch_size={config.train.batch_size}: resume with the "
                          f"train.batch_size it was saved with ({len(positions)})")
