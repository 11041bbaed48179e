"""Model maths: kernels, layers, the stacking helper and layer runner, Llama 3 / Qwen3 / DeepSeek-V3,
HF weights, adapters applied to a built model, generation."""

from podtrain.models.architectures import ARCHITECTURES, Architecture, flops_per_token
from podtrain.models.config import MLAConfig, ModelConfig, MoEConfig, RopeConfig
from podtrain.models.deepseek import DeepseekV3
from podtrain.models.generate import Sampling, generate
from podtrain.models.hf_config import config_from_hf, config_to_hf
from podtrain.models.hf_read import from_hf
from podtrain.models.hf_write import to_hf
from podtrain.models.kv_cache import KVCache
from podtrain.models.llama import Llama
from podtrain.models.loss import causal_lm_loss

__all__ = [
    "ARCHITECTURES", "Architecture", "DeepseekV3", "KVCache", "Llama", "MLAConfig", "ModelConfig", "MoEConfig",
    "RopeConfig", "Sampling", "causal_lm_loss", "flops_per_token", "generate",
    "config_from_hf", "config_to_hf", "from_hf", "to_hf",
]
