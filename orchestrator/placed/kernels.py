"""The one place a run's kernels are chosen for its devices."""

from __future__ import annotations

import dataclasses

from podtrain.models import ModelConfig
from podtrain.models.kernels.attention import check_backend, resolve_backend
from podtrain.models.kernels.exchange import resolve_exchange
from podtrain.models.kernels.grouped_matmul import resolve_grouped_matmul
from podtrain.orchestrator.common.errors import ConfigError


def resolve_kernels(model: ModelConfig, platform: str, seq_len: int, *, seq_key: str = "train.seq_len",
                    context: int = 1) -> ModelConfig:
    """`model` with its kernels resolved for devices of `platform` and sequences of `seq_len`
    tokens (the config key `seq_key`), each split over `context` devices: `attention`,
    `moe.grouped_matmul`, `moe.exchange`, and `interpret_kernels` (Pallas kernels interpreted on
    CPU devices). "auto" is decided here and nowhere else, and this is the only question asked of
    the platform. A ConfigError when the chosen attention cannot run there."""
    try:
        check_backend(model.attention, platform, model.dtype, seq_len, seq_key=seq_key, context=context)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    moe = dataclasses.replace(model.moe, grouped_matmul=resolve_grouped_matmul(model.moe.grouped_matmul, platform),
                              exchange=resolve_exchange(model.moe.exchange, platform))
    attention = resolve_backend(model.attention, platform, model.dtype, seq_len, context)
    return dataclasses.replace(model, attention=attention, moe=moe,
                               interpret_kernels=model.interpret_kernels or platform == "cpu")
