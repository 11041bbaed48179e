"""What the model tests share: a tiny Llama 3 config, its Qwen3 variant, random token ids."""

import jax.numpy as jnp
import numpy as np

from podtrain.models import ModelConfig, RopeConfig

TINY = ModelConfig(
    vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=24,
    rope=RopeConfig(rope_type="llama3", theta=500000.0, factor=8.0, original_max_position_embeddings=64),
)
QWEN = TINY.replace(model_type="qwen3", qk_norm=True, attention_bias=True, mlp_bias=True, tie_word_embeddings=True)


def tokens(batch=2, seq=12, seed=0, vocab=97):
    return jnp.asarray(np.random.default_rng(seed).integers(0, vocab, (batch, seq)), jnp.int32)
