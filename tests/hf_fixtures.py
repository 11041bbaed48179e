"""Tiny random transformers models, built from configs offline, for HF parity and round-trip tests."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

SHAPES = dict(
    vocab_size=128, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=128, rms_norm_eps=1e-6,
)
LLAMA3_ROPE = dict(
    rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
    original_max_position_embeddings=32,
)

# kind -> (model class, config class, config fields). Together they cover llama3 RoPE scaling,
# head_dim != hidden / heads, tied and untied embeddings, attention and MLP biases, Qwen3's q/k norms.
KINDS = {
    "llama": (LlamaForCausalLM, LlamaConfig, dict(
        num_hidden_layers=2, head_dim=32, rope_parameters=LLAMA3_ROPE, tie_word_embeddings=False,
    )),
    "llama_tied_bias": (LlamaForCausalLM, LlamaConfig, dict(
        num_hidden_layers=3, tie_word_embeddings=True, attention_bias=True, mlp_bias=True,
    )),
    "qwen3": (Qwen3ForCausalLM, Qwen3Config, dict(
        num_hidden_layers=2, head_dim=32, attention_bias=True, tie_word_embeddings=False,
    )),
}


def make_hf_model(kind: str, *, dtype: torch.dtype = torch.float32, seed: int = 0):
    """A random `kind` model in eval mode.

    Every tensor is random (norm scales near 1, biases non-zero), so a wrong name or layout cannot
    hide behind an all-ones or all-zeros init.
    """
    model_cls, config_cls, fields = KINDS[kind]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**SHAPES, **fields))
    model.set_attn_implementation("eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            base = 1.0 if "norm" in name else 0.0
            p.copy_(base + 0.1 * torch.randn_like(p))
    return model.to(dtype).eval()


def save_hf_model(kind: str, path, *, dtype: torch.dtype = torch.float32, max_shard_size: str | None = None):
    """Saves a random `kind` model to `path` (several shards and an index with `max_shard_size`)."""
    model = make_hf_model(kind, dtype=dtype)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, **kwargs)
    return model


def hf_logits(model, input_ids, attention_mask=None):
    """float32 numpy logits of a transformers model."""
    with torch.no_grad():
        mask = None if attention_mask is None else torch.as_tensor(attention_mask)
        out = model(input_ids=torch.as_tensor(input_ids), attention_mask=mask)
    return out.logits.float().numpy()
