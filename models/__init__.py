"""Model maths: layers, the stacking helper and layer runner, Llama 3 / Qwen3 / DeepSeek-V3, HF weights,
generation."""

from podtrain.models.config import MLAConfig, ModelConfig, MoEConfig, RopeConfig
from podtrain.models.deepseek import DeepseekV3
from podtrain.models.generate import Sampling, generate
from podtrain.models.hf import config_from_hf, config_to_hf, from_hf, to_hf
from podtrain.models.kv_cache import KVCache
from podtrain.models.llama import Llama
from podtrain.models.loss import causal_lm_loss

ARCHITECTURES = {"llama": Llama, "qwen3": Llama, "deepseek_v3": DeepseekV3}


__all__ = [
    "ARCHITECTURES", "DeepseekV3", "KVCache", "Llama", "MLAConfig", "ModelConfig", "MoEConfig", "RopeConfig",
    "Sampling", "causal_lm_loss", "generate",
    "config_from_hf", "config_to_hf", "from_hf", "to_hf",
]
