"""FLOPs per token: each architecture's count against the weights its model actually has."""

from __future__ import annotations

import dataclasses
import math

import pytest
from flax import nnx

from podtrain.models import ARCHITECTURES, ModelConfig, flops_per_token
from podtrain.orchestrator.config.compose import load_config

SEQ_LEN = 2048
EXPERT_WEIGHTS = ("w_gate", "w_up", "w_down")


def _variants() -> dict[str, ModelConfig]:
    llama, qwen, deepseek = (load_config(p).model for p in ("llama3-tiny", "qwen3-tiny", "deepseek-v3-tiny"))
    return {
        "llama": llama,
        "llama_tied_bias": llama.replace(tie_word_embeddings=True, attention_bias=True, mlp_bias=True),
        "qwen3": qwen,
        "deepseek_v3": deepseek,
        "deepseek_v3_direct_queries": deepseek.replace(mla=dataclasses.replace(deepseek.mla, q_lora_rank=0)),
    }


def _matmul_weights_per_token(config: ModelConfig) -> float:
    """The weights a token multiplies by, read off the model's parameters: all but the embedding
    lookup, norm scales and biases; of the routed experts the `num_experts_per_tok` it visits."""
    model = nnx.eval_shape(lambda: ARCHITECTURES[config.model_type].model_class(config, rngs=nnx.Rngs(0)))
    moe = config.moe
    total = config.hidden_size * config.vocab_size if config.tie_word_embeddings else 0
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        name = path[-1]
        if name in ("embed", "scale", "router_bias") or name.startswith("b"):
            continue
        size = math.prod(var.shape)
        if path[0] == "moe_layers" and path[-2] == "mlp" and name in EXPERT_WEIGHTS:
            size = size * moe.num_experts_per_tok // moe.num_experts
        total += size
    return total


@pytest.mark.parametrize("variant", list(_variants()))
def test_flops_per_token_is_six_per_weight_a_token_visits_plus_causal_attention(variant):
    config = _variants()[variant]
    assert flops_per_token(config, 0) == 6.0 * _matmul_weights_per_token(config)
    if config.model_type == "deepseek_v3":
        qk, v = config.mla.qk_head_dim, config.mla.v_head_dim
    else:
        qk, v = config.head_dim, config.head_dim
    attention = 3 * SEQ_LEN * config.num_heads * (qk + v) * config.num_layers
    assert flops_per_token(config, SEQ_LEN) == flops_per_token(config, 0) + attention
    assert flops_per_token(config, SEQ_LEN) == ARCHITECTURES[config.model_type].flops_per_token(config, SEQ_LEN)
