"""DeepSeek-V3: latent attention everywhere, a dense-MLP stack then a mixture-of-experts stack."""

from __future__ import annotations

from flax import nnx

from podtrain.models.config import ModelConfig
from podtrain.models.kv_cache import KVCache
from podtrain.models.layers import DecoderLayer, dtype_of
from podtrain.models.llama import Llama
from podtrain.models.mla import MLAttention
from podtrain.models.moe import MoE, balance_router_bias
from podtrain.models.runner import stack_layers


class DeepseekV3(Llama):
    """The first `moe.first_k_dense_replace` layers are one stack with the dense MLP, the rest one
    stack with the MoE block; both are made by `stack_layers` and run by `run_layers`.

    Multi-token-prediction modules of the released checkpoints are not part of the model.
    """

    def _build_stacks(self, config: ModelConfig, rngs: nnx.Rngs) -> None:
        def dense_layer(r):
            return DecoderLayer(config, rngs=r, attention=MLAttention(config, rngs=r))

        def moe_layer(r):
            return DecoderLayer(config, rngs=r, attention=MLAttention(config, rngs=r), mlp=MoE(config, rngs=r))

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

    def init_cache(self, batch: int, max_len: int, dtype=None, reads: str = "filled") -> KVCache:
        """A cache of the MLA latent and rotary key per token (not per-head keys and values)."""
        c = self.config
        return KVCache.init(
            stack_layers=[n for n in (c.num_dense_layers, c.num_moe_layers) if n], batch=batch, max_len=max_len,
            kv_heads=1, key_dim=c.mla.kv_lora_rank, value_dim=c.mla.qk_rope_head_dim,
            dtype=dtype or dtype_of(c.dtype), reads=reads,
        )
