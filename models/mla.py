"""Multi-head latent attention (DeepSeek-V3): keys and values rebuilt per head from a small latent."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from podtrain.models.attention import cached_attention, latent_context_attention, self_attention
from podtrain.models.config import ModelConfig
from podtrain.models.context import context_shards
from podtrain.models.layers import RMSNorm
from podtrain.models.linear import dtype_of, linear
from podtrain.models.rope import apply_rope, rope_attention_factor, rope_inv_freq, softmax_scale
from podtrain.sharding.rules import constrain


def _deinterleave(x: jax.Array) -> jax.Array:
    """(x0, x1, x2, x3, ...) -> (x0, x2, ..., x1, x3, ...): interleaved rotary pairs to rotate-half layout.

    Queries and keys are permuted alike, so their dot products are those of the interleaved form.
    """
    return jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)


# The latent norms (after the q and kv down-projections) use 1e-6 whatever `rms_norm_eps` says, as
# DeepSeek's reference code and transformers build them.
LATENT_NORM_EPS = 1e-6

class MLAttention(nnx.Module):
    """DeepSeek-V3 attention: low-rank queries, a `kv_lora_rank` latent and one shared rotary key.

    The cache stores what MLA needs per token, the normed latent and the rotary key
    (`kv_lora_rank + qk_rope_head_dim` values), not per-head keys and values.
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        c, m = config, config.mla
        pdt = dtype_of(c.param_dtype)
        self.dtype = dtype_of(c.dtype)
        self.nope, self.rope_dim, self.rank = m.qk_nope_head_dim, m.qk_rope_head_dim, m.kv_lora_rank
        self.interleave = m.rope_interleave
        self.inv_freq = tuple(float(f) for f in rope_inv_freq(m.qk_rope_head_dim, c.rope))
        self.rope_scale = rope_attention_factor(c.rope)
        self.scale = softmax_scale(m.qk_head_dim, c.rope)
        init = nnx.initializers.normal(c.initializer_range)
        d, h = c.hidden_size, c.num_heads
        if m.q_lora_rank:
            self.wq_a = linear(rngs, init, (d,), (m.q_lora_rank,), ("embed", "q_lora"), pdt)
            self.q_norm = RMSNorm(m.q_lora_rank, eps=LATENT_NORM_EPS, param_dtype=pdt, rngs=rngs)
            self.wq_b = linear(rngs, init, (m.q_lora_rank,), (h, m.qk_head_dim), ("q_lora", "heads", "head_dim"),
                               pdt)
            self.wq = None
        else:
            self.wq_a = self.q_norm = self.wq_b = None
            self.wq = linear(rngs, init, (d,), (h, m.qk_head_dim), ("embed", "heads", "head_dim"), pdt)
        self.wkv_a = linear(rngs, init, (d,), (m.kv_lora_rank + m.qk_rope_head_dim,), ("embed", "kv_lora"), pdt)
        self.kv_norm = RMSNorm(m.kv_lora_rank, eps=LATENT_NORM_EPS, param_dtype=pdt, rngs=rngs)
        self.wkv_b = linear(rngs, init, (m.kv_lora_rank,), (h, m.qk_nope_head_dim + m.v_head_dim),
                            ("kv_lora", "heads", "head_dim"), pdt)
        self.wo = linear(rngs, init, (h, m.v_head_dim), (d,), ("heads", "head_dim", "embed"), pdt)

    def _rope(self, x, positions_BT):
        if self.interleave:
            x = _deinterleave(x)
        return apply_rope(x, positions_BT, np.asarray(self.inv_freq, np.float32), self.rope_scale)

    def __call__(self, x_BTD, *, positions_BT, mask=None, kv=None, layer=None, **cache_kwargs):
        """Attends `x` to itself, or to itself and a stacked cache `kv = (latent, rope_key)`.

        The cache holds (L, B, S, 1, kv_lora_rank) normed latents and (L, B, S, 1, qk_rope_head_dim)
        rotary keys. With a cache the key and value up-projections are absorbed into the queries
        and the output (scores = (q_nope W_uk) . latent + q_rope . rope_key; out = (p . latent) W_uv),
        so no per-head key or value is ever built for the cached entries. Other arguments as in
        `models.attention.Attention`.

        Returns:
            (out_BTD, new_kv): new_kv is the new tokens' (latent, rotary key), None without a cache.
        """
        q = self.wq_b(self.q_norm(self.wq_a(x_BTD))) if self.wq is None else self.wq(x_BTD)
        q = checkpoint_name(q, "query")
        q_nope, q_rope = q[..., : self.nope], self._rope(q[..., self.nope:], positions_BT)
        compressed = self.wkv_a(x_BTD)
        latent = self.kv_norm(compressed[..., : self.rank])[:, :, None, :]
        rope_key = self._rope(compressed[..., None, self.rank:], positions_BT)
        if kv is None:
            new_kv = None
            q = constrain(jnp.concatenate([q_nope, q_rope], axis=-1), ("batch", "seq", "act_heads", None))
            seq_axes, shards = context_shards()
            if shards > 1 and self.wkv_b.is_one_matrix():
                # A split sequence gathers the latent and rotary key, not the keys and values built from them.
                latent, rope_key = (checkpoint_name(x[:, :, 0], "key") for x in (latent, rope_key))
                out = latent_context_attention(q * self.scale, latent, rope_key, self.wkv_b.matrix(self.dtype), mask,
                                               nope=self.nope, seq_axes=seq_axes, shards=shards)
                return checkpoint_name(self.wo(out), "attn_out"), None
            kv_heads = checkpoint_name(self.wkv_b(latent[:, :, 0]), "key")
            k_nope, v = kv_heads[..., : self.nope], kv_heads[..., self.nope:]
            k = jnp.concatenate([k_nope, jnp.broadcast_to(rope_key, (*k_nope.shape[:-1], self.rope_dim))], axis=-1)
            out = self_attention(q, k, v, mask, scale=self.scale)
        else:
            new_kv = (latent, rope_key)
            # wkv_b (R, H, nope + v) is absorbed into the queries and the output.
            q_latent = self.wkv_b.contract("bthn,rhn->bthr", q_nope, self.dtype, slice(None, self.nope))
            latent_out = cached_attention(
                [q_latent * self.scale, q_rope * self.scale], [latent, rope_key], latent, kv, kv[0],
                layer=layer, positions_BT=positions_BT, **cache_kwargs,
            )
            out = self.wkv_b.contract("bthr,rhv->bthv", latent_out.astype(self.dtype), self.dtype,
                                      slice(self.nope, None))
        return checkpoint_name(self.wo(out), "attn_out"), new_kv
