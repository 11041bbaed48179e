"""Llama 3 and Qwen3 decoders (Qwen3 is Llama 3 plus RMSNorm on q and k) on one stacked layer runner."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from podtrain.models.attention import Attention, make_mask
from podtrain.models.config import ModelConfig
from podtrain.models.embedding import embedding
from podtrain.models.kv_cache import KVCache, write_tokens
from podtrain.models.layers import MLP, DecoderLayer, RMSNorm
from podtrain.models.linear import dense, dtype_of, gathered, linear
from podtrain.models.loss import sliced_target_logprobs
from podtrain.models.runner import run_layers, stack_layers
from podtrain.sharding.rules import constrain


def validate_config(config: ModelConfig, prefix: str = "model") -> None:
    """The fields every architecture reads; Llama 3 and Qwen3 have no routed experts (and read no
    `mla` section)."""
    config.validate(prefix)
    if config.moe.num_experts:
        raise ValueError(f"{prefix}.moe.num_experts: a {config.model_type} model has no routed experts; "
                         f"expected 0, found {config.moe.num_experts}")


def llama_from_hf(hf: dict, source: str) -> dict:
    """The ModelConfig fields of a LlamaForCausalLM config.json beyond the shared keys: none."""
    return {}


def llama_to_hf(config: ModelConfig, shared: dict) -> dict:
    """The config.json of a LlamaForCausalLM: the shared keys (it has no q/k norms)."""
    if config.qk_norm:
        raise ValueError("model: transformers' LlamaForCausalLM has no q/k norms; found qk_norm=True")
    return shared


def qwen3_from_hf(hf: dict, source: str) -> dict:
    """Qwen3 is Llama 3 with RMSNorm on the queries and keys."""
    return {"qk_norm": True}


def qwen3_to_hf(config: ModelConfig, shared: dict) -> dict:
    """The config.json of a Qwen3ForCausalLM: the shared keys (it has q/k norms and no mlp_bias)."""
    if not config.qk_norm or config.mlp_bias:
        raise ValueError("model: transformers' Qwen3ForCausalLM has q/k norms and no mlp_bias; found "
                         f"qk_norm={config.qk_norm}, mlp_bias={config.mlp_bias}")
    return shared


def flops_per_token(config: ModelConfig, seq_len: int) -> float:
    """Model FLOPs of one training token (forward + backward, no remat recompute).

    6 per matmul parameter (attention and MLP projections, the LM head; not the embedding lookup,
    norms or biases), plus causal attention: QK^T and AV cost 4 * seq * heads * head_dim per token
    and layer forward over the full square, half of that under the causal mask, times 3 for
    forward and backward.
    """
    c = config
    attention_params = c.hidden_size * c.head_dim * (2 * c.num_heads + 2 * c.num_kv_heads)
    layer_params = attention_params + 3 * c.hidden_size * c.intermediate_size
    matmul_params = c.num_layers * layer_params + c.hidden_size * c.vocab_size
    attention = 3 * seq_len * c.num_heads * 2 * c.head_dim * c.num_layers
    return 6.0 * matmul_params + attention


class Llama(nnx.Module):
    """A decoder-only LM whose `num_layers` blocks are one stacked module run by `run_layers`.

    Subclasses with several stacks (DeepSeek-V3) override `_build_stacks` and `stacks`; the
    embedding, positions, masks, cache handling and head are shared.
    """

    check_config = staticmethod(validate_config)  # ValueError naming the key of a config it cannot build

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.check_config(config)
        self.config = config
        pdt = dtype_of(config.param_dtype)
        init = nnx.initializers.normal(config.initializer_range)
        self.embed = embedding(rngs, init, config.vocab_size, config.hidden_size, pdt)
        self._build_stacks(config, rngs)
        self.final_norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, param_dtype=pdt, rngs=rngs)
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = linear(rngs, init, (config.hidden_size,), (config.vocab_size,), ("embed", "vocab"), pdt)

    def _build_stacks(self, config: ModelConfig, rngs: nnx.Rngs) -> None:
        def layer(r):
            return DecoderLayer(config, rngs=r, attention=lambda r: Attention(config, rngs=r),
                                mlp=lambda r: MLP(config, rngs=r))

        self.layers = stack_layers(layer, config.num_layers, rngs)

    def stacks(self) -> list[nnx.Module]:
        """The layer stacks, in the order they run (and their cache pairs are kept)."""
        return [self.layers]

    def __call__(self, input_ids: jax.Array, positions: jax.Array | None = None,
                 segment_ids: jax.Array | None = None, cache: KVCache | None = None,
                 attention_mask: jax.Array | None = None) -> tuple[jax.Array, KVCache | None, dict]:
        """(logits, cache, stats) for `input_ids` (batch, seq).

        Args:
            input_ids: int token ids (B, T).
            positions: token positions (B, T); defaults to 0..T-1 (after the cache's filled entries).
            segment_ids: packed-document ids (B, T); tokens attend only within their segment.
            cache: a stacked `KVCache`; the new keys and values are written at `cache.index`.
            attention_mask: 1 for real tokens, 0 for padding (B, T); padding is never attended to.

        Returns:
            logits (B, T, vocab) in the compute dtype; the updated cache (None without one); the
            layers' statistics (for MoE stacks `expert_load`, tokens per expert per layer, and
            `dropped_tokens` per layer; empty otherwise).
        """
        h, cache, stats = self.hidden_states(input_ids, positions, segment_ids, cache, attention_mask)
        return constrain(self.logits(h), ("batch", "seq", "act_vocab")), cache, stats

    def logits(self, h: jax.Array) -> jax.Array:
        """The logits (batch, ..., vocab) of final hidden states `h` (batch, ..., hidden)."""
        # A head whose adapter each batch row picks cannot be merged into one matrix.
        return self.lm_head(h) if getattr(self.lm_head, "per_row", False) else dense(h, self.head())

    def target_logprobs(self, h: jax.Array, targets: jax.Array, *, slices: int) -> jax.Array:
        """log p(target) (B, T) in float32 of final hidden states `h` (B, T, hidden), the head
        applied `slices` vocabulary slices at a time (`sliced_target_logprobs`), each row with its
        own head adapter where the head has slots. The head's weight is taken as frozen."""
        if getattr(self.lm_head, "per_row", False):
            low, b = self.lm_head.row_factors(h, h.dtype)
            head = self.lm_head.frozen()
            return sliced_target_logprobs(h, head, targets, slices=slices, low_BTR=low,
                                          b_BRV=b.reshape(*b.shape[:2], -1))
        return sliced_target_logprobs(h, self.head(stored=True), targets, slices=slices)

    def hidden_states(self, input_ids: jax.Array, positions: jax.Array | None = None,
                      segment_ids: jax.Array | None = None, cache: KVCache | None = None,
                      attention_mask: jax.Array | None = None) -> tuple[jax.Array, KVCache | None, dict]:
        """As the call, with the final-normed hidden state (B, T, hidden) in place of the logits
        (for a loss that applies the head a slice at a time, and for sampling the last token)."""
        c = self.config
        b, t = input_ids.shape
        if positions is None:
            start = 0 if cache is None else cache.index
            positions = jnp.broadcast_to(start + jnp.arange(t, dtype=jnp.int32), (b, t))
        positions = positions.astype(jnp.int32)
        # A padding token gets position -1 as a key, so nothing attends to it.
        key_positions = positions if attention_mask is None else jnp.where(attention_mask > 0, positions, -1)
        h = self.embed(input_ids, dtype_of(c.dtype))
        stacks = self.stacks()
        if cache is None:
            mask = make_mask(c.attention, positions, key_positions, segment_ids, padded=attention_mask is not None,
                             interpret=c.interpret_kernels)
            pairs, remat, kwargs = [None] * len(stacks), c.remat, {"mask": mask}
        else:
            pairs, remat = cache.split(), "none"
            kwargs = {"key_positions_BT": key_positions, "cache_positions_BS": cache.positions,
                      "cache_used": cache.index}
        stats, new_pairs = {}, []
        for stack, pair in zip(stacks, pairs, strict=True):
            h, outputs = run_layers(stack, h, remat=remat, scan=c.scan_layers, kv=pair, positions_BT=positions,
                                    **kwargs)
            new_entries = outputs.pop("kv")
            if pair is not None:
                new_pairs.append(tuple(write_tokens(stacked, new, cache.index)
                                       for stacked, new in zip(pair, new_entries, strict=True)))
            stats |= outputs
        if cache is not None:
            entry_positions = jax.lax.dynamic_update_slice_in_dim(cache.positions, key_positions, cache.index, axis=1)
            cache = cache.join(new_pairs, positions=entry_positions, index=cache.index + t)
        return self.final_norm(h), cache, stats

    def head(self, *, stored: bool = False) -> jax.Array:
        """The output projection (hidden, vocab) (the embedding when tied), logical axes ("embed",
        "vocab"): in the compute dtype, gathered here once (a caller looping over chunks would
        otherwise gather it in each); with `stored`, as stored (param dtype, own sharding), for
        `chunked_causal_lm_loss`, which gathers it a vocabulary slice at a time."""
        w = self.embed if self.lm_head is None else self.lm_head
        names = w.axes()
        head, names = (w.merged().T, names[::-1]) if self.lm_head is None else (w.merged(), names)
        return head if stored else gathered(head.astype(dtype_of(self.config.dtype)), names)

    def init_cache(self, batch: int, max_len: int, dtype=None) -> KVCache:
        """An empty cache of `max_len` entries per sequence, in the compute dtype unless `dtype` says."""
        c = self.config
        return KVCache.init(
            stack_layers=[c.num_layers], batch=batch, max_len=max_len, kv_heads=c.num_kv_heads,
            key_dim=c.head_dim, dtype=dtype or dtype_of(c.dtype),
        )

