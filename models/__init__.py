"""Model maths: layers, the stacking helper and layer runner, Llama 3 / Qwen3 / DeepSeek-V3, HF weights,
generation."""

from models.config import MLAConfig, ModelConfig, MoEConfig, RopeConfig
from models.deepseek import DeepseekV3
from models.generate import Sampling, generate
from models.hf import config_from_hf, config_to_hf, from_hf, to_hf
from models.kv_cache import KVCache
from models.llama import Llama
from models.loss import causal_lm_loss

ARCHITECTURES = {"llama": Llama, "qwen3": Llama, "deepseek_v3": DeepseekV3}


__all__ = [
    "ARCHITECTURES", "DeepseekV3", "KVCache", "Llama", "MLAConfig", "ModelConfig", "MoEConfig", "RopeConfig",
    "Sampling", "causal_lm_loss", "generate",
    "config_from_hf", "config_to_hf", "from_hf", "to_hf",
]
