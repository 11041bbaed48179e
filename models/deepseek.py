"""DeepSeek-V3: latent attention everywhere, a dense-MLP stack then a mixture-of-experts stack."""

from __future__ import annotations

from flax import nnx

from podtrain.models.config import ModelConfig
from podtrain.models.kv_cache import KVCache
from podtrain.models.layers import DecoderLayer, dtype_of
from podtrain.models.llama import Llama
from podtrain.models.lora import LoRAConfig
from podtrain.models.mla import MLAttention
from podtrain.models.moe import MoE, balance_router_bias
from podtrain.models.runner import stack_layers


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

    def _build_stacks(self, config: ModelConfig, rngs: nnx.Rngs, lora: LoRAConfig | None) -> None:
        def dense_layer(r):
            return DecoderLayer(config, rngs=r, attention=MLAttention(config, rngs=r, lora=lora), lora=lora)

        def moe_layer(r):
            return DecoderLayer(config, rngs=r, attention=MLAttention(config, rngs=r, lora=lora),
                                mlp=MoE(config, rngs=r, lora=lora))

        n_dense, n_moe = config.num_dense_layers, config.num_moe_layers
        self.dense_layers = stack_layers(dense_layer, n_dense, rngs) if n_dense else None
        self.moe_layers = stack_layers(moe_layer, n_moe, rngs) if n_moe else None

    def stacks(self) -> list[nnx.Module]:
        return [s for s in (self.dense_layers, self.moe_layers) if s is not None]

    def balance_experts(self, load_LE, rate: float) -> None:
        """Auxiliary-loss-free balancing: moves each MoE layer's router bias by `rate` towards the
        experts that got fewer than the mean of `load_LE` tokens (tokens per expert per layer)."""
        bias = self.moe_layers.mlp.router_bias
        bias.set_value(balance_router_bias(bias[...], load_LE, rate))

    def init_cache(self, batch: int, max_len: int, dtype=None) -> KVCache:
        """A cache of the MLA latent and rotary key per token (not per-head keys and values)."""
        c = self.config
        return KVCache.init(
            stack_layers=[n for n in (c.num_dense_layers, c.num_moe_layers) if n], batch=batch, max_len=max_len,
            kv_heads=1, key_dim=c.mla.kv_lora_rank, value_dim=c.mla.qk_rope_head_dim,
            dtype=dtype or dtype_of(c.dtype),
        )
