"""Llama 3 and Qwen3 decoders (Qwen3 is Llama 3 plus RMSNorm on q and k) on one stacked layer runner."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from podtrain.models.attention import backend_for, make_mask
from podtrain.models.config import ModelConfig
from podtrain.models.kv_cache import KVCache, write_tokens
from podtrain.models.layers import DecoderLayer, RMSNorm, dense, dtype_of, gathered, param
from podtrain.models.lora import LoRAConfig, adapter, model_rngs
from podtrain.models.runner import run_layers, stack_layers
from podtrain.sharding.mesh import current_platform
from podtrain.sharding.rules import axes_of, constrain, logical_to_spec


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


def embed_tokens(table_VD: jax.Array, ids_BT: jax.Array, dtype) -> jax.Array:
    """Rows `ids_BT` of the (vocab, hidden) table, in the compute `dtype`, sharded over the batch.

    The table is not gathered (that would move vocab x hidden per device and step): it stays sharded
    over its hidden dimension, each device takes from its shard the rows of all tokens of its group
    along those mesh axes, and one all-to-all hands every device its own tokens' whole rows. Pinning
    the rows to that layout after the cast keeps the all-to-all and its transpose in `dtype` (left to
    itself, XLA casts the cotangent to float32 before moving it) and the batch sharded over the other
    axes; the tp devices, which hold the same tokens, then need not sum the table's gradient. The
    gradient is summed in the table's dtype, as for a plain `take(table, ids).astype(dtype)`.
    """
    # Gathering rows from a vocab-sharded table would make XLA replicate it: unshard vocab first.
    table = constrain(table_VD, (None, "embed"))
    mesh = jax.sharding.get_abstract_mesh()
    hidden = None if mesh is None or mesh.empty else logical_to_spec(("embed",), dict(mesh.shape))[0]
    if hidden is not None:
        # Gather the ids only over the hidden dimension's mesh axes: the other batch axes keep theirs.
        batch_axes = [a for a in axes_of(logical_to_spec(("batch",), dict(mesh.shape))[0]) if a not in axes_of(hidden)]
        batch = tuple(batch_axes) or None
        ids_BT = jax.lax.with_sharding_constraint(ids_BT, PartitionSpec(batch, None))
    h = jnp.take(table, ids_BT, axis=0).astype(dtype)
    if hidden is not None:
        h = jax.lax.with_sharding_constraint(h, PartitionSpec(batch, None, hidden))
    return constrain(h, ("batch", "seq", "act_embed"))


class Llama(nnx.Module):
    """A decoder-only LM whose `num_layers` blocks are one stacked module run by `run_layers`.

    Subclasses with several stacks (DeepSeek-V3) override `_build_stacks` and `stacks`; the
    embedding, positions, masks, cache handling and head are shared.
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, lora: LoRAConfig | None = None):
        """`lora` adds LoRA adapters to the weights it targets (`models/lora.py`)."""
        config.validate()
        if lora is not None:
            lora.validate()
            if config.tie_word_embeddings and lora.wants("lm_head"):
                raise ValueError("lora.targets: lm_head is the embedding in a model with tied embeddings "
                                 "(model.tie_word_embeddings); target embed_tokens instead")
        self.config = config
        pdt = dtype_of(config.param_dtype)
        init = nnx.initializers.normal(config.initializer_range)
        self.embed = param(rngs, init, (config.vocab_size, config.hidden_size), ("vocab", "embed"), pdt)
        self._build_stacks(config, rngs, lora)
        self.final_norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, param_dtype=pdt, rngs=rngs)
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = param(rngs, init, (config.hidden_size, config.vocab_size), ("embed", "vocab"), pdt)
        adapter_rngs = model_rngs()
        self.embed_lora = adapter(lora, "embed_tokens", self.embed, 1, rngs=adapter_rngs, embedding=True)
        self.lm_head_lora = None if self.lm_head is None else adapter(lora, "lm_head", self.lm_head, 1,
                                                                       rngs=adapter_rngs)

    def _build_stacks(self, config: ModelConfig, rngs: nnx.Rngs, lora: LoRAConfig | None) -> None:
        self.layers = stack_layers(lambda r: DecoderLayer(config, rngs=r, lora=lora), config.num_layers, rngs)

    def stacks(self) -> list[nnx.Module]:
        """The layer stacks, in the order they run (and their cache pairs are kept)."""
        return [self.layers]

    def __call__(
        self,
        input_ids: jax.Array,
        positions: jax.Array | None = None,
        attention_mask: jax.Array | None = None,
        kv_cache: KVCache | None = None,
        *,
        segment_ids: jax.Array | None = None,
        scan: bool | None = None,
        return_hidden: bool = False,
        return_stats: bool = False,
        dropout_key: jax.Array | None = None,
    ):
        """Logits for `input_ids` (batch, seq).

        Args:
            input_ids: int token ids (B, T).
            positions: token positions (B, T); defaults to 0..T-1 (after the cache's filled slots).
            attention_mask: 1 for real tokens, 0 for padding (B, T); padding is never attended to.
            kv_cache: a stacked `KVCache`; the new keys and values are written at `kv_cache.index`.
            segment_ids: packed-document ids (B, T); tokens attend only within their segment.
            scan: False runs the layers in an unrolled Python loop (reference and benchmarks);
                None follows `config.scan_layers`.
            return_hidden: return the final-normed hidden state (B, T, hidden) instead of the
                logits (for a loss that applies `head()` chunk by chunk).
            return_stats: also return the layers' statistics (for MoE stacks: `expert_load`,
                tokens per expert per layer, and `dropped_tokens` per layer; empty otherwise).
            dropout_key: training's key of LoRA dropout (`lora.dropout`); None drops nothing.

        Returns:
            logits (B, T, vocab) in the compute dtype, or (logits, new_cache) with a cache;
            with `return_stats`, a (..., stats) tuple.
        """
        c = self.config
        dtype = dtype_of(c.dtype)
        scan = c.scan_layers if scan is None else scan
        b, t = input_ids.shape
        if positions is None:
            start = 0 if kv_cache is None else kv_cache.index
            positions = jnp.broadcast_to(start + jnp.arange(t, dtype=jnp.int32), (b, t))
        positions = positions.astype(jnp.int32)
        # A padding token gets position -1 as a key, so nothing attends to it.
        key_positions = positions if attention_mask is None else jnp.where(attention_mask > 0, positions, -1)
        h = embed_tokens(self.embed[...], input_ids, dtype)
        if self.embed_lora is not None:
            lora = self.embed_lora
            low = jnp.take(lora.a[...].astype(dtype), input_ids, axis=0)
            h = h + constrain(dense(low, lora.b[...].astype(dtype)) * jnp.asarray(lora.scale, dtype),
                              ("batch", "seq", "act_embed"))
        stacks = self.stacks()
        if kv_cache is None:
            backend = backend_for(c.attention, current_platform(), c.dtype, t)
            mask = make_mask(backend, positions, key_positions, segment_ids, padded=attention_mask is not None)
            pairs, remat, kwargs = [None] * len(stacks), c.remat, {"mask": mask}
        else:
            pairs, remat = kv_cache.split(), "none"
            kwargs = {"key_positions_BT": key_positions, "cache_positions_BS": kv_cache.positions,
                      "cache_used": kv_cache.index}
        stats, new_pairs = {}, []
        for i, (stack, pair) in enumerate(zip(stacks, pairs, strict=True)):
            key = None if dropout_key is None else jax.random.fold_in(dropout_key, i)
            h, outputs = run_layers(stack, h, remat=remat, scan=scan, kv=pair, dropout_key=key, positions_BT=positions,
                                    **kwargs)
            new_entries = outputs.pop("kv")
            if pair is not None:
                new_pairs.append(tuple(write_tokens(cache, new, kv_cache.index)
                                       for cache, new in zip(pair, new_entries, strict=True)))
            stats |= outputs
        if kv_cache is not None:
            slot_positions = jax.lax.dynamic_update_slice_in_dim(kv_cache.positions, key_positions, kv_cache.index,
                                                                 axis=1)
            new_cache = kv_cache.join(new_pairs, positions=slot_positions, index=kv_cache.index + t)
        h = self.final_norm(h)
        out = h if return_hidden else constrain(dense(h, self.head()), ("batch", "seq", "act_vocab"))
        result = (out,) if kv_cache is None else (out, new_cache)
        if return_stats:
            result += (stats,)
        return result[0] if len(result) == 1 else result

    def head(self, *, stored: bool = False) -> jax.Array:
        """The output projection (hidden, vocab) (the embedding when tied), logical axes ("embed",
        "vocab"): in the compute dtype, gathered here once (a caller looping over chunks would
        otherwise gather it in each); with `stored`, as stored (param dtype, own sharding), for
        `chunked_causal_lm_loss`, which gathers it a vocabulary slice at a time."""
        w, lora = (self.embed, self.embed_lora) if self.lm_head is None else (self.lm_head, self.lm_head_lora)
        names = tuple(w.get_metadata().get("out_sharding") or ())
        head = w[...] if lora is None else (w[...] + lora.delta().astype(w.dtype))  # the merged weight
        head, names = (head.T, names[::-1]) if self.lm_head is None else (head, names)
        return head if stored else gathered(head.astype(dtype_of(self.config.dtype)), names)

    def init_cache(self, batch: int, max_len: int, dtype=None) -> KVCache:
        """An empty cache of `max_len` slots per sequence, in the compute dtype unless `dtype` says."""
        c = self.config
        return KVCache.init(
            stack_layers=[c.num_layers], batch=batch, max_len=max_len, kv_heads=c.num_kv_heads,
            key_dim=c.head_dim, dtype=dtype or dtype_of(c.dtype),
        )

