"""A LoRA run's adapters started from a PEFT adapter directory (`lora.init`)."""

from __future__ import annotations

from pathlib import Path

from flax import nnx

from podtrain.models.lora import load_peft, read_peft_config
from podtrain.orchestrator.common.errors import ConfigError
from podtrain.orchestrator.train.build import Training


def init_adapters(training: Training, state, frozen):
    """`state` with its adapters read from the PEFT adapter directory `lora.init`, whose rank,
    alpha and targets must be the config's."""
    lora, path = training.config.lora, Path(training.config.lora.init).expanduser()
    try:
        found = read_peft_config(path)
    except ValueError as e:
        raise ConfigError(f"lora.init: {e}") from None
    differences = [f"lora.{key}: the adapter has {getattr(found, key)!r}, the config {getattr(lora, key)!r}"
                   for key in ("rank", "alpha") if getattr(found, key) != getattr(lora, key)]
    if set(found.targets) != set(lora.targets):
        differences.append(f"lora.targets: the adapter has {list(found.targets)}, the config {list(lora.targets)}")
    if differences:
        raise ConfigError(f"lora.init={lora.init}: {'; '.join(differences)}")
    model = training.model(state.params, frozen)
    try:
        load_peft(model, training.config.model, path)
    except ValueError as e:
        raise ConfigError(f"lora.init: {e}") from None
    return state.replace(params=nnx.state(model, training.trainable))
