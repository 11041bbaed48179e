"""Tiny random transformers models, built from configs offline, for HF parity and round-trip tests."""

from __future__ import annotations

import torch
from transformers import (
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

# These models are tiny: with more than one thread, torch spends ~100x longer starting threads
# than multiplying (and competes with JAX's threads in the same process).
torch.set_num_threads(1)

SHAPES = dict(
    vocab_size=128, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=128, rms_norm_eps=1e-6,
)
LLAMA3_ROPE = dict(
    rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
    original_max_position_embeddings=32,
)

YARN_ROPE = dict(
    rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=32, beta_fast=32.0,
    beta_slow=1.0, mscale=1.0, mscale_all_dim=0.707,
)
# DeepSeek-V3 in miniature: 1 dense + 2 MoE layers, 8 experts in 4 groups (top-2 groups, top-2
# experts), a shared expert, low-rank queries, YaRN with both mscales, interleaved rotary pairs.
DEEPSEEK = dict(
    num_hidden_layers=3, num_key_value_heads=4, first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2,
    n_group=4, topk_group=2, moe_intermediate_size=32, n_shared_experts=1, routed_scaling_factor=2.5,
    norm_topk_prob=True, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
    rope_parameters=YARN_ROPE, rope_interleave=True, num_nextn_predict_layers=0, tie_word_embeddings=False,
)

# kind -> (model class, config class, config fields). Together they cover llama3 RoPE scaling,
# head_dim != hidden / heads, tied and untied embeddings, attention and MLP biases, Qwen3's q/k norms
# and YaRN,
# and DeepSeek-V3 (MLA, YaRN, MoE with group-limited routing, two layer stacks).
KINDS = {
    "llama": (LlamaForCausalLM, LlamaConfig, dict(
        num_hidden_layers=2, head_dim=32, rope_parameters=LLAMA3_ROPE, tie_word_embeddings=False,
    )),
    "llama_tied_bias": (LlamaForCausalLM, LlamaConfig, dict(
        num_hidden_layers=3, tie_word_embeddings=True, attention_bias=True, mlp_bias=True,
    )),
    # Qwen3 with YaRN, as its long-context configs set it.
    "qwen3": (Qwen3ForCausalLM, Qwen3Config, dict(
        num_hidden_layers=2, head_dim=32, attention_bias=True, tie_word_embeddings=False,
        rope_parameters=dict(rope_type="yarn", rope_theta=1e6, factor=4.0, original_max_position_embeddings=32),
    )),
    "deepseek_v3": (DeepseekV3ForCausalLM, DeepseekV3Config, DEEPSEEK),
    # No query compression, plain RoPE in rotate-half layout, all layers MoE, two shared experts,
    # an rms_norm_eps that the latent norm (always 1e-6) does not take.
    "deepseek_v3_plain": (DeepseekV3ForCausalLM, DeepseekV3Config, {
        **DEEPSEEK, "rms_norm_eps": 0.05, "first_k_dense_replace": 0, "n_shared_experts": 2, "q_lora_rank": None,
        "n_group": 1, "topk_group": 1, "num_hidden_layers": 2,
        "rope_parameters": dict(rope_type="default", rope_theta=10000.0), "rope_interleave": False,
        "norm_topk_prob": False, "routed_scaling_factor": 1.0,
    }),
}


def make_hf_model(kind: str, *, dtype: torch.dtype = torch.float32, seed: int = 0):
    """A random `kind` model in eval mode.

    Every tensor is random (norm scales near 1, biases non-zero), so a wrong name or layout cannot
    hide behind an all-ones or all-zeros init.
    """
    model_cls, config_cls, fields = KINDS[kind]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**{**SHAPES, **fields}))
    model.set_attn_implementation("eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            base = 1.0 if "norm" in name else 0.0
            p.copy_(base + 0.1 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # a buffer, but a weight of the checkpoint
                b.copy_(0.1 * torch.randn_like(b))
    model = model.to(dtype)
    # As from_pretrained does: transformers keeps these float32 whatever the dtype (DeepSeek-V3's
    # router weight and correction bias), so its bfloat16 checkpoints hold them in float32.
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if any(kept in name for kept in model._keep_in_fp32_modules_strict or ()):
            t.data = t.data.float()
    return model.eval()


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
