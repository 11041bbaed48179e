"""Building blocks of the decoder: RMSNorm, rotary embeddings, GQA attention and the SwiGLU MLP.

Every parameter names its logical axes through `nnx.with_partitioning`; `sharding/` decides the
mesh axes. Activations are constrained by logical names only.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec

from podtrain.models.attention import NEG_INF, attention
from podtrain.models.config import ModelConfig, RopeConfig
from podtrain.models.lora import Adapter, LoRAConfig, adapter
from podtrain.sharding.rules import axes_of, constrain, logical_to_spec


def dtype_of(name: str):
    return {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}[name]


def dense(x: jax.Array, w: jax.Array, n_in: int = 1) -> jax.Array:
    """`x (..., *in) @ w (*in, *out)` as one 2-D (tokens, features) matmul: the weight gradient of
    a 3-D einsum would make XLA copy the (tokens, features) cotangent into a transposed layout."""
    in_size = math.prod(w.shape[:n_in])
    y = x.reshape(-1, in_size) @ w.reshape(in_size, -1)
    return y.reshape(*x.shape[: x.ndim - n_in], *w.shape[n_in:])


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _gathered(w, whole: PartitionSpec, sharded: PartitionSpec):
    """`w` itself; differentiated, `w` pinned to `whole` and its cotangent to `sharded` (see `weight`)."""
    return w


def _gathered_fwd(w, whole, sharded):
    return jax.lax.with_sharding_constraint(w, whole), None


def _gathered_bwd(whole, sharded, _, d_w):
    return (jax.lax.with_sharding_constraint(d_w, sharded),)


_gathered.defvjp(_gathered_fwd, _gathered_bwd)


def weight(w: nnx.Variable, dtype) -> jax.Array:
    """The weight `w` cast to `dtype`; when differentiated, gathered once for all the matmuls that read it.

    GSPMD gathers a weight sharded over the batch axes (FSDP) at each matmul that reads it, so under
    remat the recomputed forward matmul and the backward one would each gather it again. Pinning the
    cast weight to its layout without the batch axes makes it one value that both read; the
    cotangent is pinned to the weight's own layout, so the gradient is reduce-scattered (a plain
    sharding constraint would transpose to a replicated, all-reduced gradient).
    """
    return gathered(w[...].astype(dtype), w.get_metadata().get("out_sharding"))


def gathered(w: jax.Array, names) -> jax.Array:
    """`weight` for an array `w` whose dimensions have the logical `names` (a leading "layers" name
    beyond `w`'s dimensions is that of the stack `w` is one layer of).

    Undifferentiated (inference), without a mesh or for expert weights (kept sharded over their
    expert axis: `sharding.experts` gathers what it needs) `w` is returned as it is.
    """
    specs = gather_specs(names, w.ndim)
    return w if specs is None else _gathered(w, *specs)


def gather_specs(names, ndim: int) -> tuple[PartitionSpec, PartitionSpec] | None:
    """(whole, sharded): the layout of an `ndim`-dimensional weight with logical `names` once
    gathered over the batch axes, and its own; None when there is nothing to gather."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty or not names or "experts" in names:
        return None
    sizes = dict(mesh.shape)
    spec = list(logical_to_spec(names, sizes))[len(names) - ndim:]
    batch = set(axes_of(logical_to_spec(("batch",), sizes)[0]))
    kept = [tuple(a for a in axes_of(entry) if a not in batch) for entry in spec]
    whole = PartitionSpec(*(None if not axes else axes[0] if len(axes) == 1 else axes for axes in kept))
    sharded = PartitionSpec(*spec)
    return None if whole == sharded else (whole, sharded)


def cached_attention(queries, new_keys, new_values, key_caches, value_cache, *, layer, positions_BT,
                     key_positions_BT, cache_positions_BS, cache_used, block: int = 128) -> jax.Array:
    """Attention of T new tokens to themselves and to the filled slots of one layer of a stacked cache.

    Args:
        queries: per key part, the scaled queries (B, T, H, Dp). GQA has one part; MLA two (its
            absorbed latent queries and its rotary queries). Scores are summed over the parts.
        new_keys: per part, the new tokens' keys (B, T, K, Dp); `new_values` (B, T, K, E).
        key_caches: per part, the stacked cache (L, B, S, K, Dp); `value_cache` (L, B, S, K, E).
            Only read, never written: the caller writes the new tokens after all layers ran.
        layer: the layer (traced or static) whose slots are read.
        positions_BT: the new tokens' positions; `key_positions_BT` the same with -1 at padding.
        cache_positions_BS: the position held in each slot (-1: empty or padding).
        cache_used: slots filled before these tokens (a traced scalar).
        block: slots per step of the running softmax.

    The new tokens are attended first (causally, by position); then the cache's slots below
    `cache_used`, `block` at a time, straight from the stacked cache with a running softmax: a
    token's cost grows with the filled length, not with `max_len`, prefill and decode alike.
    Every product is batched over (batch, kv head): with the kv heads sharded (tensor
    parallelism) each device reads only its own heads' slots and nothing crosses devices.
    Returns (B, T, H, E) in the values' dtype.
    """
    b, t, heads, _ = queries[0].shape
    length, kv_heads, e = value_cache.shape[2], value_cache.shape[3], value_cache.shape[4]
    block = min(block, length)
    layer = jnp.asarray(layer, jnp.int32)
    group = heads // kv_heads
    dtype = new_values.dtype
    queries = [q.reshape(b, t, kv_heads, group, q.shape[-1]) for q in queries]

    def scores_of(keys, valid_BTS):
        scores = sum(jnp.einsum("btkgd,bskd->bkgts", q, k.astype(q.dtype), preferred_element_type=jnp.float32)
                     for q, k in zip(queries, keys, strict=True))
        valid = valid_BTS[:, None, None]
        return jnp.where(valid, scores, NEG_INF), valid

    def accumulate(carry, scores, valid, values):
        row_max, row_sum, acc = carry
        new_max = jnp.maximum(row_max, jnp.max(scores, axis=-1, keepdims=True))
        probs = jnp.where(valid, jnp.exp(scores - new_max), 0.0)
        correction = jnp.exp(row_max - new_max)
        weighted = jnp.einsum("bkgts,bske->bkgte", probs.astype(dtype), values.astype(dtype),
                              preferred_element_type=jnp.float32)
        return new_max, row_sum * correction + jnp.sum(probs, axis=-1, keepdims=True), acc * correction + weighted

    def step(j, carry):
        start = jnp.minimum(j * block, length - block)
        valid = _block_valid(j, start, block, cache_positions_BS, positions_BT, cache_used)
        scores, valid = scores_of([_read_block(k, layer, start, block) for k in key_caches], valid)
        return accumulate(carry, scores, valid, _read_block(value_cache, layer, start, block))

    init = (
        jnp.full((b, kv_heads, group, t, 1), NEG_INF, jnp.float32),
        jnp.zeros((b, kv_heads, group, t, 1), jnp.float32),
        jnp.zeros((b, kv_heads, group, t, e), jnp.float32),
    )
    scores, valid = scores_of(new_keys, make_attention_mask(positions_BT, key_positions_BT))
    carry = accumulate(init, scores, valid, new_values)
    filled_blocks = (cache_used + block - 1) // block
    _, row_sum, acc = jax.lax.fori_loop(0, filled_blocks, step, carry)
    out = acc / jnp.maximum(row_sum, jnp.finfo(jnp.float32).tiny)
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, heads, e).astype(dtype)


def _read_block(cache, layer, start, block):
    """Slots `start`..`start + block` of layer `layer` of a stacked cache (L, B, S, ...): (B, block, ...)."""
    zero = jnp.zeros((), jnp.int32)
    size = (1, cache.shape[1], block, *cache.shape[3:])
    return jax.lax.dynamic_slice(cache, (layer, zero, start) + (zero,) * (cache.ndim - 3), size)[0]


def _block_valid(j, start, block, cache_positions_BS, positions_BT, cache_used):
    """(B, T, block): which slots of the block at `start` (loop step `j`) each new token attends to.

    The last block may overlap the one before it (`start` is clamped to fit the cache): its slots
    below `j * block` were already read.
    """
    slot_pos = jax.lax.dynamic_slice_in_dim(cache_positions_BS, start, block, axis=1)
    slot = start + jnp.arange(block)
    return ((slot_pos[:, None, :] >= 0) & (slot_pos[:, None, :] <= positions_BT[:, :, None])
            & (slot >= j * block) & (slot < cache_used))


def with_adapter(lora: Adapter | None, x: jax.Array, dtype, dropout_key: jax.Array | None = None):
    """The LoRA update `scale * (x @ A) @ B` of a weight's output for input `x`, in `dtype` (0
    without an adapter); the weight's own matmul is untouched, so a frozen base gets no gradient.
    With a `dropout_key` (training) the adapter's input is dropped first (`Adapter.dropped`)."""
    if lora is None:
        return 0
    low = dense(lora.dropped(x, dropout_key), weight(lora.a, dtype), lora.n_in)
    return dense(low, weight(lora.b, dtype)) * jnp.asarray(lora.scale, dtype)


def param(rngs: nnx.Rngs, init, shape, names, dtype) -> nnx.Param:
    """A parameter created by `init` and annotated with logical axis `names`."""
    # Sharding is applied by `sharding/` from the logical names, never eagerly at creation.
    return nnx.Param(nnx.with_partitioning(init, tuple(names), eager_sharding=False)(rngs.params(), shape, dtype))


class RMSNorm(nnx.Module):
    """Root-mean-square norm over the last axis, computed in float32 (as HF does)."""

    def __init__(self, dim: int, *, eps: float, param_dtype, rngs: nnx.Rngs):
        self.eps = eps
        self.scale = param(rngs, nnx.initializers.ones, (dim,), ("norm",), param_dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.scale[...].astype(x.dtype) * x32.astype(x.dtype)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_inv_freq(inv_freq: np.ndarray, head_dim: int, rope: RopeConfig) -> np.ndarray:
    """YaRN: interpolate low frequencies by `factor`, keep high ones, ramp linearly in between."""

    def correction_dim(rotations):
        old_len = rope.original_max_position_embeddings
        return head_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low = max(math.floor(correction_dim(rope.beta_fast)), 0)
    high = min(math.ceil(correction_dim(rope.beta_slow)), head_dim - 1)
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float32) - low) / max(high - low, 0.001), 0, 1)
    keep = 1 - ramp
    return (inv_freq / rope.factor) * (1 - keep) + inv_freq * keep


def rope_attention_factor(rope: RopeConfig) -> float:
    """The factor YaRN applies to cos and sin (1 for the other rope types)."""
    if rope.rope_type != "yarn":
        return 1.0
    if rope.mscale and rope.mscale_all_dim:
        return _yarn_mscale(rope.factor, rope.mscale) / _yarn_mscale(rope.factor, rope.mscale_all_dim)
    return _yarn_mscale(rope.factor)


def softmax_scale(head_dim: int, rope: RopeConfig) -> float:
    """head_dim ** -0.5, times YaRN's mscale(factor, mscale_all_dim) squared when that is set."""
    scale = head_dim**-0.5
    if rope.rope_type == "yarn" and rope.mscale_all_dim:
        scale *= _yarn_mscale(rope.factor, rope.mscale_all_dim) ** 2
    return scale


def rope_inv_freq(head_dim: int, rope: RopeConfig) -> np.ndarray:
    """Inverse frequencies (head_dim // 2,), scaled as `rope.rope_type` says (llama3, yarn)."""
    inv_freq = 1.0 / (rope.theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    if rope.rope_type == "yarn":
        return _yarn_inv_freq(inv_freq, head_dim, rope).astype(np.float32)
    if rope.rope_type == "llama3":
        old_len = rope.original_max_position_embeddings
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = np.where(medium, smoothed, scaled)
    return inv_freq.astype(np.float32)


def apply_rope(x_BTHD: jax.Array, positions_BT: jax.Array, inv_freq: np.ndarray, scale: float = 1.0) -> jax.Array:
    """Rotates pairs (i, i + D/2) of the last axis by position * frequency (HF's rotate-half layout).

    `scale` multiplies cos and sin (YaRN's attention factor).
    """
    angles = positions_BT.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # (B, T, D/2)
    cos = jnp.cos(angles)[:, :, None, :] * scale
    sin = jnp.sin(angles)[:, :, None, :] * scale
    x1, x2 = jnp.split(x_BTHD.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BTHD.dtype)


def make_attention_mask(
    q_positions_BT: jax.Array,
    kv_positions_BS: jax.Array,
    q_segments_BT: jax.Array | None = None,
    kv_segments_BS: jax.Array | None = None,
) -> jax.Array:
    """Boolean (B, T, S) mask: causal by position, no empty slot (position < 0), same segment."""
    mask = (kv_positions_BS[:, None, :] <= q_positions_BT[:, :, None]) & (kv_positions_BS[:, None, :] >= 0)
    if q_segments_BT is not None:
        mask &= q_segments_BT[:, :, None] == kv_segments_BS[:, None, :]
    return mask


class Attention(nnx.Module):
    """Grouped-query attention with RoPE, optional q/k RMSNorm (Qwen3) and optional biases."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, lora: LoRAConfig | None = None):
        c = config
        pdt = dtype_of(c.param_dtype)
        self.dtype = dtype_of(c.dtype)
        self.head_dim = c.head_dim
        self.inv_freq = tuple(float(f) for f in rope_inv_freq(c.head_dim, c.rope))
        self.rope_scale = rope_attention_factor(c.rope)
        init = nnx.initializers.normal(c.initializer_range)
        d, h, kvh, hd = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
        self.wq = param(rngs, init, (d, h, hd), ("embed", "heads", "head_dim"), pdt)
        self.wk = param(rngs, init, (d, kvh, hd), ("embed", "kv_heads", "head_dim"), pdt)
        self.wv = param(rngs, init, (d, kvh, hd), ("embed", "kv_heads", "head_dim"), pdt)
        self.wo = param(rngs, init, (h, hd, d), ("heads", "head_dim", "embed"), pdt)
        self.wq_lora = adapter(lora, "q_proj", self.wq, 1, rngs=rngs)
        self.wk_lora = adapter(lora, "k_proj", self.wk, 1, rngs=rngs)
        self.wv_lora = adapter(lora, "v_proj", self.wv, 1, rngs=rngs)
        self.wo_lora = adapter(lora, "o_proj", self.wo, 2, rngs=rngs)
        if c.attention_bias:
            zeros = nnx.initializers.zeros
            self.bq = param(rngs, zeros, (h, hd), ("heads", "head_dim"), pdt)
            self.bk = param(rngs, zeros, (kvh, hd), ("kv_heads", "head_dim"), pdt)
            self.bv = param(rngs, zeros, (kvh, hd), ("kv_heads", "head_dim"), pdt)
            self.bo = param(rngs, zeros, (d,), ("norm",), pdt)
        else:
            self.bq = self.bk = self.bv = self.bo = None
        if c.qk_norm:
            self.q_norm = RMSNorm(hd, eps=c.rms_norm_eps, param_dtype=pdt, rngs=rngs)
            self.k_norm = RMSNorm(hd, eps=c.rms_norm_eps, param_dtype=pdt, rngs=rngs)
        else:
            self.q_norm = self.k_norm = None

    def _project(self, x, w, b, name, lora, dropout_key):
        y = dense(x, weight(w, self.dtype)) + with_adapter(lora, x, self.dtype, dropout_key)
        if b is not None:
            y = y + b[...].astype(self.dtype)
        return checkpoint_name(y, name)

    def __call__(self, x_BTD, *, positions_BT, mask=None, kv=None, layer=None, dropout_key=None, **cache_kwargs):
        """Attends `x` to itself (under `mask`, a `models.attention.Mask`), or to itself and a stacked cache.

        With a cache, `kv = (k, v)` are the whole stacks (L, B, S, K, D), read only; this is layer
        `layer`, and `cache_kwargs` are `cached_attention`'s `key_positions_BT`,
        `cache_positions_BS` and `cache_used`. `dropout_key` drops the adapters' inputs (training).

        Returns:
            (out_BTD, new_kv): new_kv is the new tokens' (k, v), each (B, T, K, D), to be written
            into the cache at its next slots; None without a cache.
        """
        inv_freq = np.asarray(self.inv_freq, np.float32)
        q = self._project(x_BTD, self.wq, self.bq, "query", self.wq_lora, dropout_key)
        k = self._project(x_BTD, self.wk, self.bk, "key", self.wk_lora, dropout_key)
        v = self._project(x_BTD, self.wv, self.bv, "value", self.wv_lora, dropout_key)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = constrain(apply_rope(q, positions_BT, inv_freq, self.rope_scale), ("batch", "seq", "act_heads", None))
        k = apply_rope(k, positions_BT, inv_freq, self.rope_scale)
        scale = self.head_dim**-0.5
        if kv is None:
            out = attention(q, k, v, mask, scale=scale)
        else:
            out = cached_attention([q * scale], [k], v, kv[:1], kv[1], layer=layer, positions_BT=positions_BT,
                                   **cache_kwargs)
        new_kv = None if kv is None else (k, v)
        out = dense(out, weight(self.wo, self.dtype), n_in=2) + with_adapter(self.wo_lora, out, self.dtype,
                                                                             dropout_key)
        if self.bo is not None:
            out = out + self.bo[...].astype(self.dtype)
        return checkpoint_name(out, "attn_out"), new_kv


class MLP(nnx.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)), `intermediate_size` wide unless given."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, intermediate_size: int | None = None,
                 lora: LoRAConfig | None = None):
        c = config
        pdt = dtype_of(c.param_dtype)
        self.dtype = dtype_of(c.dtype)
        init = nnx.initializers.normal(c.initializer_range)
        d, f = c.hidden_size, intermediate_size or c.intermediate_size
        self.w_gate = param(rngs, init, (d, f), ("embed", "mlp"), pdt)
        self.w_up = param(rngs, init, (d, f), ("embed", "mlp"), pdt)
        self.w_down = param(rngs, init, (f, d), ("mlp", "embed"), pdt)
        self.w_gate_lora = adapter(lora, "gate_proj", self.w_gate, 1, rngs=rngs)
        self.w_up_lora = adapter(lora, "up_proj", self.w_up, 1, rngs=rngs)
        self.w_down_lora = adapter(lora, "down_proj", self.w_down, 1, rngs=rngs)
        if c.mlp_bias:
            zeros = nnx.initializers.zeros
            self.b_gate = param(rngs, zeros, (f,), ("mlp",), pdt)
            self.b_up = param(rngs, zeros, (f,), ("mlp",), pdt)
            self.b_down = param(rngs, zeros, (d,), ("norm",), pdt)
        else:
            self.b_gate = self.b_up = self.b_down = None

    def _dense(self, x, w, b, lora, dropout_key):
        y = dense(x, weight(w, self.dtype)) + with_adapter(lora, x, self.dtype, dropout_key)
        return y if b is None else y + b[...].astype(self.dtype)

    def __call__(self, x_BTD, *, dropout_key=None):
        """`dropout_key` drops the adapters' inputs (training)."""
        gate = self._dense(x_BTD, self.w_gate, self.b_gate, self.w_gate_lora, dropout_key)
        up = self._dense(x_BTD, self.w_up, self.b_up, self.w_up_lora, dropout_key)
        return self._dense(jax.nn.silu(gate) * up, self.w_down, self.b_down, self.w_down_lora, dropout_key)


class DecoderLayer(nnx.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x)).

    `attention` and `mlp` default to GQA `Attention` and the SwiGLU `MLP`; DeepSeek-V3 passes
    latent attention and, in its MoE stack, the MoE block (whose call returns `(y, stats)`).
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, attention: nnx.Module | None = None,
                 mlp: nnx.Module | None = None, lora: LoRAConfig | None = None):
        pdt = dtype_of(config.param_dtype)
        self.input_norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, param_dtype=pdt, rngs=rngs)
        self.attn = Attention(config, rngs=rngs, lora=lora) if attention is None else attention
        self.post_attn_norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, param_dtype=pdt, rngs=rngs)
        self.mlp = MLP(config, rngs=rngs, lora=lora) if mlp is None else mlp

    def __call__(self, x_BTD, *, positions_BT, dropout_key=None, **attention_kwargs):
        """Returns (x, outputs): `outputs["kv"]` is the updated stacked cache pair (None without a
        cache), plus the MoE block's statistics when the layer has one. `attention_kwargs` (the mask
        or the cache arguments) go to the attention block; `dropout_key` (training) to both blocks'
        adapters, each of which folds in its own target."""
        attn, new_kv = self.attn(self.input_norm(x_BTD), positions_BT=positions_BT, dropout_key=dropout_key,
                                 **attention_kwargs)
        x_BTD = x_BTD + attn
        mlp_out = self.mlp(self.post_attn_norm(x_BTD), dropout_key=dropout_key)
        stats = {}
        if isinstance(mlp_out, tuple):
            mlp_out, stats = mlp_out
        x_BTD = x_BTD + mlp_out
        return constrain(x_BTD, ("batch", "seq", "act_embed")), {"kv": new_kv, **stats}
