"""The architectures podtrain builds, by `ModelConfig.model_type`: each one's pieces in one spec."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from podtrain.models import deepseek, llama
from podtrain.models.config import ModelConfig
from podtrain.models.hf_mapping import DEEPSEEK_V3, LLAMA3, QWEN3, HFMapping


@dataclass(frozen=True)
class Architecture:
    """An architecture's module class, its training FLOPs per token and its HF checkpoint layout."""

    model_class: type[llama.Llama]
    flops_per_token: Callable[[ModelConfig, int], float]
    hf_mapping: HFMapping


ARCHITECTURES = {
    "llama": Architecture(llama.Llama, llama.flops_per_token, LLAMA3),
    "qwen3": Architecture(llama.Llama, llama.flops_per_token, QWEN3),
    "deepseek_v3": Architecture(deepseek.DeepseekV3, deepseek.flops_per_token, DEEPSEEK_V3),
}


def flops_per_token(config: ModelConfig, seq_len: int) -> float:
    """Model FLOPs of one training token of `config` at `seq_len` (forward + backward, no remat
    recompute), as its architecture counts them."""
    return ARCHITECTURES[config.model_type].flops_per_token(config, seq_len)
