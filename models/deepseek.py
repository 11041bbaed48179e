"""DeepSeek-V3: latent attention everywhere, a dense-MLP stack then a mixture-of-experts stack."""

from __future__ import annotations

from flax import nnx

from podtrain.models.config import MLAConfig, ModelConfig, MoEConfig
from podtrain.models.kv_cache import KVCache
from podtrain.models.layers import MLP, DecoderLayer
from podtrain.models.linear import dtype_of
from podtrain.models.llama import Llama
from podtrain.models.mla import MLAttention
from podtrain.models.moe import MoE, balance_router_bias
from podtrain.models.runner import stack_layers

# DeepSeek-V3 config.json keys -> (section, field) of ModelConfig.
DEEPSEEK_KEYS = {
    "q_lora_rank": ("mla", "q_lora_rank"), "kv_lora_rank": ("mla", "kv_lora_rank"),
    "qk_nope_head_dim": ("mla", "qk_nope_head_dim"), "qk_rope_head_dim": ("mla", "qk_rope_head_dim"),
    "v_head_dim": ("mla", "v_head_dim"), "rope_interleave": ("mla", "rope_interleave"),
    "n_routed_experts": ("moe", "num_experts"), "num_experts_per_tok": ("moe", "num_experts_per_tok"),
    "moe_intermediate_size": ("moe", "moe_intermediate_size"), "n_shared_experts": ("moe", "num_shared_experts"),
    "n_group": ("moe", "n_group"), "topk_group": ("moe", "topk_group"), "norm_topk_prob": ("moe", "norm_topk_prob"),
    "routed_scaling_factor": ("moe", "routed_scaling_factor"),
    "first_k_dense_replace": ("moe", "first_k_dense_replace"),
}
# What transformers' DeepseekV3Config takes for a key config.json leaves out (the DeepSeek-V3 release's
# values), so that a hand-written config routes and scales as transformers would read it.
DEEPSEEK_HF_DEFAULTS = {
    "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "rope_interleave": True, "n_routed_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 2048,
    "n_shared_experts": 1, "n_group": 8, "topk_group": 4, "norm_topk_prob": True, "routed_scaling_factor": 2.5,
    "first_k_dense_replace": 3,
}


def validate_config(config: ModelConfig, prefix: str = "model") -> None:
    """The fields every architecture reads, and DeepSeek-V3's `mla` and `moe` sections."""
    config.validate(prefix)
    config.mla.validate(f"{prefix}.mla", config.num_heads, config.num_kv_heads)
    config.moe.validate(f"{prefix}.moe", config.num_layers)


def deepseek_from_hf(hf: dict, source: str) -> dict:
    """The ModelConfig fields of a DeepseekV3ForCausalLM config.json: its MLA and MoE sections."""
    for key, expected in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
        if hf.get(key, expected) != expected:
            raise ValueError(f"{source}: {key}: expected {expected!r}, found {hf[key]!r}")
    if hf.get("attention_bias"):
        raise ValueError(f"{source}: attention_bias: expected false for deepseek_v3 (MLA biases are not supported)")
    sections = {"mla": {}, "moe": {}}
    for key, (section, field) in DEEPSEEK_KEYS.items():
        sections[section][field] = hf.get(key, DEEPSEEK_HF_DEFAULTS[key])
    sections["mla"]["q_lora_rank"] = sections["mla"]["q_lora_rank"] or 0  # null: no query compression
    return {
        "num_kv_heads": hf["num_attention_heads"], "head_dim": sections["mla"].get("qk_rope_head_dim", 64),
        "mla": MLAConfig(**sections["mla"]), "moe": MoEConfig(**sections["moe"]),
    }


def deepseek_to_hf(config: ModelConfig, shared: dict) -> dict:
    """The config.json of a DeepseekV3ForCausalLM: the shared keys but mlp_bias and head_dim, its
    MLA and MoE keys, and no multi-token-prediction layers."""
    out = {key: value for key, value in shared.items() if key not in ("mlp_bias", "head_dim")}
    out |= {key: getattr(getattr(config, section), field) for key, (section, field) in DEEPSEEK_KEYS.items()}
    out["q_lora_rank"] = out["q_lora_rank"] or None
    out["num_nextn_predict_layers"] = 0
    return out


def _latent_attention_params(config: ModelConfig) -> int:
    """Matmul parameters of one MLA block: query (low-rank or direct), latent, key/value up-projection, output."""
    m, d, h = config.mla, config.hidden_size, config.num_heads
    query = d * m.q_lora_rank + m.q_lora_rank * h * m.qk_head_dim if m.q_lora_rank else d * h * m.qk_head_dim
    latent = d * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank * h * (m.qk_nope_head_dim + m.v_head_dim)
    return query + latent + h * m.v_head_dim * d


def flops_per_token(config: ModelConfig, seq_len: int) -> float:
    """Model FLOPs of one training token (forward + backward, no remat recompute).

    6 per matmul parameter a token passes through: latent attention in every layer, the dense MLP
    in the dense layers and, in the MoE layers, the router, the shared experts and the
    `num_experts_per_tok` routed experts it visits; the LM head. Plus causal attention over
    `qk_head_dim` queries and keys and `v_head_dim` values, as for Llama.
    """
    c, moe, d = config, config.moe, config.hidden_size
    attention_params = _latent_attention_params(c)
    dense_layer = attention_params + 3 * d * c.intermediate_size
    experts = 3 * d * moe.moe_intermediate_size * (moe.num_experts_per_tok + moe.num_shared_experts)
    moe_layer = attention_params + d * moe.num_experts + experts
    matmul_params = c.num_dense_layers * dense_layer + c.num_moe_layers * moe_layer + d * c.vocab_size
    attention = 3 * seq_len * c.num_heads * (c.mla.qk_head_dim + c.mla.v_head_dim) * c.num_layers
    return 6.0 * matmul_params + attention


class DeepseekV3(Llama):
    """The first `moe.first_k_dense_replace` layers are one stack with the dense MLP, the rest one
    stack with the MoE block; both are made by `stack_layers` and run by `run_layers`.

    Multi-token-prediction modules of the released checkpoints are not part of the model.
    """

    check_config = staticmethod(validate_config)

    def _build_stacks(self, config: ModelConfig, rngs: nnx.Rngs) -> None:
        def attention(r):
            return MLAttention(config, rngs=r)

        def dense_layer(r):
            return DecoderLayer(config, rngs=r, attention=attention, mlp=lambda r: MLP(config, rngs=r))

        def moe_layer(r):
            return DecoderLayer(config, rngs=r, attention=attention, mlp=lambda r: MoE(config, rngs=r))

        n_dense, n_moe = config.num_dense_layers, config.num_moe_layers
        self.dense_layers = stack_layers(dense_layer, n_dense, rngs) if n_dense else None
        self.moe_layers = stack_layers(moe_layer, n_moe, rngs) if n_moe else None

    def stacks(self) -> list[nnx.Module]:
        return [s for s in (self.dense_layers, self.moe_layers) if s is not None]

    def balance_experts(self, load_LE, rate: float) -> None:
        """Auxiliary-loss-free balancing: moves each MoE layer's router bias by `rate` towards the
        experts that got fewer than the mean of `load_LE` tokens (tokens per expert per layer)."""
        (moe,) = [m for _, m in nnx.iter_modules(self.moe_layers) if isinstance(m, MoE)]
        moe.router_bias.set_value(balance_router_bias(moe.router_bias[...], load_LE, rate))

    def init_cache(self, batch: int, max_len: int, dtype=None) -> KVCache:
        """A cache of the MLA latent and rotary key per token (not per-head keys and values)."""
        c = self.config
        return KVCache.init(
            stack_layers=[n for n in (c.num_dense_layers, c.num_moe_layers) if n], batch=batch, max_len=max_len,
            kv_heads=1, key_dim=c.mla.kv_lora_rank, value_dim=c.mla.qk_rope_head_dim,
            dtype=dtype or dtype_of(c.dtype),
        )
