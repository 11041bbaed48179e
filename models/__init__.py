"""Model maths: layers, the stacking helper and layer runner, Llama 3 / Qwen3, HF weights."""

from models.config import ModelConfig, RopeConfig
from models.hf import config_from_hf, config_to_hf, from_hf, to_hf
from models.kv_cache import KVCache
from models.llama import Llama
from models.loss import causal_lm_loss

ARCHITECTURES = {"llama": Llama, "qwen3": Llama}


__all__ = [
    "ARCHITECTURES", "KVCache", "Llama", "ModelConfig", "RopeConfig", "causal_lm_loss",
    "config_from_hf", "config_to_hf", "from_hf", "to_hf",
]
