"""Attention: the mask, self-attention by backend, attention to a stacked KV cache, and the GQA block."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from podtrain.models.config import ModelConfig
from podtrain.models.context import balanced_order, context_shards, to_natural
from podtrain.models.kernels.attention import (
    NEG_INF,
    cudnn_attention,
    flash_multiple,
    run_splash,
    sharded,
    splash_attention,
    splash_kernel,
    xla_attention,
)
from podtrain.models.layers import RMSNorm
from podtrain.models.linear import dense, dtype_of, linear, param
from podtrain.models.rope import apply_rope, rope_attention_factor, rope_inv_freq
from podtrain.sharding.rules import axes_of, constrain, logical_to_spec


def causal_mask(q_positions_BT, kv_positions_BS, q_segments_BT=None, kv_segments_BS=None) -> jax.Array:
    """Boolean (B, T, S) mask: causal by position, no empty entry or padding (position < 0), same segment."""
    mask = (kv_positions_BS[:, None, :] <= q_positions_BT[:, :, None]) & (kv_positions_BS[:, None, :] >= 0)
    if q_segments_BT is not None:
        mask &= q_segments_BT[:, :, None] == kv_segments_BS[:, None, :]
    return mask


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Mask:
    """What each query of a self-attention may attend to, in the form its backend reads.

    `dense_BTS` (xla): a boolean (B, T, S) mask. `segments_BT` (flash kernels): causal by index
    within equal segment ids, or within the whole row when None. `interpret` runs a Pallas kernel
    in interpret mode.
    """

    dense_BTS: jax.Array | None = None
    segments_BT: jax.Array | None = None
    backend: str = dataclasses.field(default="xla", metadata={"static": True})
    interpret: bool = dataclasses.field(default=False, metadata={"static": True})


def make_mask(backend: str, q_positions_BT, kv_positions_BS, segment_ids_BT=None, *, padded: bool = False,
              interpret: bool = False) -> Mask:
    """The mask of a self-attention under `backend` (a resolved name: xla, splash or cudnn;
    `model.attention`). The flash kernels mask by index within segments, which equals the
    causal-by-position mask when positions count up from each segment's start (as the data
    pipeline makes them); `padded` (keys' positions mark padding with -1) and sequences that are
    not a multiple of the kernels' tile on each device take the xla path."""
    if backend == "auto" or backend == "xla" or padded or q_positions_BT.shape[1] % flash_multiple(context_shards()[1]):
        dense = causal_mask(q_positions_BT, kv_positions_BS, segment_ids_BT, segment_ids_BT)
        return Mask(dense_BTS=constrain(dense, ("batch", "seq", None)))
    if segment_ids_BT is not None:  # whole on every device: each layer's keys take them in full (`context_attention`)
        segment_ids_BT = constrain(segment_ids_BT, ("batch", None))
    return Mask(segments_BT=segment_ids_BT, backend=backend, interpret=interpret)


def _kernel_axes(heads: int, kv_heads: int) -> tuple[tuple[str, ...], tuple[str, ...], int]:
    """(mesh axes that split a flash kernel's batch rows, those that split its heads, the number of
    row shards) under the active mesh."""
    mesh = jax.sharding.get_abstract_mesh()
    sizes = {} if mesh is None or mesh.empty else dict(mesh.shape)
    if not any(size > 1 for size in sizes.values()):
        return (), (), 1
    batch_axes = axes_of(logical_to_spec(("batch",), sizes)[0])
    head_axes = tuple(a for a in axes_of(logical_to_spec(("act_heads",), sizes)[0]) if a not in batch_axes)
    split = math.prod(sizes[a] for a in head_axes)
    # Each head shard must hold its own kv heads (mesh.tp divides both counts unless the rules differ).
    head_axes = head_axes if heads % split == 0 and kv_heads % split == 0 else ()
    return batch_axes, head_axes, math.prod(sizes[a] for a in batch_axes)


def self_attention(q_BTHD, k_BSKD, v_BSKE, mask: Mask, *, scale: float) -> jax.Array:
    """Grouped-query self-attention, `scale` applied to q: (B, T, H, D) queries against (B, S, K, D)
    keys and (B, S, K, E) values (H a multiple of K) -> (B, T, H, E), by `mask.backend`."""
    q_BTHD = q_BTHD * scale
    seq_axes, shards = context_shards()
    if shards > 1:
        return context_attention(q_BTHD, k_BSKD, v_BSKE, mask, seq_axes=seq_axes, shards=shards)
    if mask.backend == "xla":
        return xla_attention(q_BTHD, k_BSKD, v_BSKE, mask.dense_BTS)
    dtype = q_BTHD.dtype
    k_BSKD, v_BSKE = k_BSKD.astype(dtype), v_BSKE.astype(dtype)
    if mask.backend == "splash":
        local = lambda q, k, v, s: splash_attention(q, k, v, s, interpret=mask.interpret)  # noqa: E731
    else:
        local = cudnn_attention
    batch_axes, head_axes, row_shards = _kernel_axes(q_BTHD.shape[2], k_BSKD.shape[2])
    # The kernel runs on each device's rows (the partitioner cannot split it): rows the batch axes
    # do not divide (a serve step's few rows on a large mesh) get padding rows, cut off after.
    b = q_BTHD.shape[0]
    pad = -b % row_shards
    args = (q_BTHD, k_BSKD, v_BSKE, mask.segments_BT)
    if pad:
        args = tuple(None if x is None else jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1)) for x in args)
    out = sharded(local, *args, batch_axes=batch_axes, head_axes=head_axes)
    return out[:b].astype(dtype)


def _entry(axes: tuple[str, ...]):
    """A PartitionSpec entry for mesh axes: None, one name, or a tuple."""
    return None if not axes else axes[0] if len(axes) == 1 else axes


def context_attention(q_BTHD, k_BSKD, v_BSKE, mask: Mask, *, seq_axes: tuple[str, ...], shards: int) -> jax.Array:
    """Self-attention of sequences split over `seq_axes` (`shards` devices) in the balanced order
    (`models.context`), q already scaled.

    Each device gathers the keys and values of the whole sequence once per pass (the gather's
    gradient is a reduce-scatter of theirs) and attends its own queries to them: the xla path by
    the dense mask of positions (its rows for these queries), splash with the kernel's mask rows
    for these queries, evaluated at their natural indices, so fully masked blocks are skipped.
    """
    return _split_attention(q_BTHD, (k_BSKD, v_BSKE), mask, seq_axes=seq_axes, shards=shards)


def latent_context_attention(q_BTHD, latent_BSR, rope_key_BSD, w_RHE, mask: Mask, *, nope: int,
                             seq_axes: tuple[str, ...], shards: int) -> jax.Array:
    """MLA's self-attention of a split sequence (as `context_attention`): each device gathers what
    its keys and values are made from, every token's latent (R values) and rotary key (D), and
    up-projects them itself with `w_RHE` (R, H, nope + value dims), its heads' part of it. Per
    token that gathers R + D values where the keys and values are H x (nope + D + value dims), for
    the up-projection of the whole sequence on each device. The weight's gradient is each device's
    own, summed over the devices by the partitioner as any weight's is.
    """
    def keys_and_values(w, latent, rope_key):
        kv = dense(latent, w)
        k_nope, v = kv[..., :nope], kv[..., nope:]
        rope = jnp.broadcast_to(rope_key[:, :, None, :], (*k_nope.shape[:-1], rope_key.shape[-1]))
        return jnp.concatenate([k_nope, rope], axis=-1), v

    return _split_attention(q_BTHD, (latent_BSR, rope_key_BSD), mask, seq_axes=seq_axes, shards=shards,
                            up=(keys_and_values, w_RHE))


def _split_attention(q_BTHD, parts, mask: Mask, *, seq_axes, shards, up=None) -> jax.Array:
    """`context_attention` of the keys and values `up[0](w, *parts)` makes from `parts` gathered
    whole (`parts` themselves without `up`), `w = up[1]` (R, H, E) split over the heads as the
    queries are."""
    dtype = q_BTHD.dtype
    heads = q_BTHD.shape[2]
    batch_axes, head_axes, row_shards = _kernel_axes(heads, heads if up else parts[0].shape[2])
    b, t = q_BTHD.shape[:2]
    pad = -b % row_shards
    # Rows the batch axes do not divide get padding rows, cut off after (as `self_attention`).
    rows = lambda x: x if x is None or not pad else jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))  # noqa: E731
    q_BTHD, parts = rows(q_BTHD), tuple(rows(x) for x in parts)
    gather = lambda x: jax.lax.all_gather(x, seq_axes, axis=1, tiled=True)  # noqa: E731
    batch, seq, head = _entry(batch_axes), _entry(seq_axes), _entry(head_axes)
    x_spec = P(batch, seq, head, None)
    if up is None:
        make, weights, specs = (lambda *kv: kv), (), (x_spec,) * len(parts)
    else:
        # One copy of the weight per device that holds other tokens, so that the devices' gradients
        # of it leave the shard_map apart and are summed where the weight's layout asks, not all-reduced
        # inside it.
        make_kv, w = up
        sizes = dict(jax.sharding.get_abstract_mesh().shape)
        tokens = (*batch_axes, *seq_axes)
        copies = jnp.broadcast_to(w[None], (math.prod(sizes[a] for a in tokens), *w.shape))
        make = lambda copy, *gathered: make_kv(copy[0], *gathered)  # noqa: E731
        weights, specs = (copies,), (P(_entry(tokens), None, head, None),) + tuple(
            P(batch, seq, *[None] * (x.ndim - 2)) for x in parts)
    if mask.backend == "xla":
        def local(q, *args):
            *held, dense_BTS = args
            k, v = make(*held[:len(weights)], *(gather(x) for x in held[len(weights):]))
            return xla_attention(q, k, v, dense_BTS)

        args = (q_BTHD, *weights, *parts, rows(mask.dense_BTS))
        specs = (x_spec, *specs, P(batch, seq, None))
    elif mask.backend == "splash":
        parts = tuple(x.astype(dtype) for x in parts)
        weights = tuple(w.astype(dtype) for w in weights)
        mesh = jax.sharding.get_abstract_mesh()
        head_split = math.prod(dict(mesh.shape)[a] for a in head_axes)
        kernel = splash_kernel(heads // head_split, t, t, shards=shards, q_sequence=balanced_order(t, shards),
                               interpret=mask.interpret)
        kernel_spec = kernel.manual_sharding_spec(NamedSharding(mesh, P(None, seq)))
        n = len(weights) + len(parts)

        def local(kernel, q, *args):
            held, segments = args[:n], (args[n:] or (None,))[0]
            k, v = make(*held[:len(weights)], *(to_natural(gather(x), shards) for x in held[len(weights):]))
            if segments is None:
                return run_splash(kernel, q, k, v)
            # Every device holds the whole rows' segment ids (`make_mask`): its queries' are a slice.
            mine = jax.lax.dynamic_slice_in_dim(segments, jax.lax.axis_index(seq_axes) * q.shape[1], q.shape[1], 1)
            return run_splash(kernel, q, k, v, mine, to_natural(segments, shards))

        segments = rows(mask.segments_BT)
        args = (kernel, q_BTHD, *weights, *parts) + (() if segments is None else (segments,))
        specs = (kernel_spec, x_spec, *specs) + (() if segments is None else (P(batch, None),))
    else:
        raise ValueError(f"model.attention={mask.backend} cannot attend over a sequence split over {list(seq_axes)}; "
                         "use splash (TPU) or xla")
    out = jax.shard_map(local, in_specs=specs, out_specs=x_spec, check_vma=False)(*args)
    return out[:b].astype(dtype)


def cached_attention(queries, new_keys, new_values, key_caches, value_cache, *, layer, positions_BT,
                     key_positions_BT, cache_positions_BS, cache_used, block: int = 128) -> jax.Array:
    """Attention of T new tokens to themselves and to the filled entries of one layer of a stacked cache.

    Args:
        queries: per key part, the scaled queries (B, T, H, Dp). GQA has one part; MLA two (its
            absorbed latent queries and its rotary queries). Scores are summed over the parts.
        new_keys: per part, the new tokens' keys (B, T, K, Dp); `new_values` (B, T, K, E).
        key_caches: per part, the stacked cache (L, B, S, K, Dp); `value_cache` (L, B, S, K, E).
            Only read, never written: the caller writes the new tokens after all layers ran.
        layer: the layer (traced or static) whose entries are read.
        positions_BT: the new tokens' positions; `key_positions_BT` the same with -1 at padding.
        cache_positions_BS: the position held in each entry (-1: empty or padding).
        cache_used: entries filled before these tokens (a traced scalar).
        block: entries per step of the running softmax.

    The new tokens are attended first (causally, by position); then the cache's entries below
    `cache_used`, `block` at a time, straight from the stacked cache with a running softmax: a
    token's cost grows with the filled length, not with `max_len`, prefill and decode alike.
    Every product is batched over (batch, kv head): with the kv heads sharded (tensor
    parallelism) each device reads only its own heads' entries and nothing crosses devices.
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
    scores, valid = scores_of(new_keys, causal_mask(positions_BT, key_positions_BT))
    carry = accumulate(init, scores, valid, new_values)
    filled_blocks = (cache_used + block - 1) // block
    _, row_sum, acc = jax.lax.fori_loop(0, filled_blocks, step, carry)
    out = acc / jnp.maximum(row_sum, jnp.finfo(jnp.float32).tiny)
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, heads, e).astype(dtype)


def _read_block(cache, layer, start, block):
    """Entries `start`..`start + block` of layer `layer` of a stacked cache (L, B, S, ...): (B, block, ...)."""
    zero = jnp.zeros((), jnp.int32)
    size = (1, cache.shape[1], block, *cache.shape[3:])
    return jax.lax.dynamic_slice(cache, (layer, zero, start) + (zero,) * (cache.ndim - 3), size)[0]


def _block_valid(j, start, block, cache_positions_BS, positions_BT, cache_used):
    """(B, T, block): which entries of the block at `start` (loop step `j`) each new token attends to.

    The last block may overlap the one before it (`start` is clamped to fit the cache): its entries
    below `j * block` were already read.
    """
    entry_pos = jax.lax.dynamic_slice_in_dim(cache_positions_BS, start, block, axis=1)
    entry = start + jnp.arange(block)
    return ((entry_pos[:, None, :] >= 0) & (entry_pos[:, None, :] <= positions_BT[:, :, None])
            & (entry >= j * block) & (entry < cache_used))



class Attention(nnx.Module):
    """Grouped-query attention with RoPE, optional q/k RMSNorm (Qwen3) and optional biases."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        c = config
        pdt = dtype_of(c.param_dtype)
        self.dtype = dtype_of(c.dtype)
        self.head_dim = c.head_dim
        self.inv_freq = tuple(float(f) for f in rope_inv_freq(c.head_dim, c.rope))
        self.rope_scale = rope_attention_factor(c.rope)
        init = nnx.initializers.normal(c.initializer_range)
        d, h, kvh, hd = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
        self.wq = linear(rngs, init, (d,), (h, hd), ("embed", "heads", "head_dim"), pdt)
        self.wk = linear(rngs, init, (d,), (kvh, hd), ("embed", "kv_heads", "head_dim"), pdt)
        self.wv = linear(rngs, init, (d,), (kvh, hd), ("embed", "kv_heads", "head_dim"), pdt)
        self.wo = linear(rngs, init, (h, hd), (d,), ("heads", "head_dim", "embed"), pdt)
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

    def _biased(self, y, b):
        return y if b is None else y + b[...].astype(self.dtype)

    def __call__(self, x_BTD, *, positions_BT, mask=None, kv=None, layer=None, **cache_kwargs):
        """Attends `x` to itself (under `mask`, a `Mask`), or to itself and a stacked cache.

        With a cache, `kv = (k, v)` are the whole stacks (L, B, S, K, D), read only; this is layer
        `layer`, and `cache_kwargs` are `cached_attention`'s `key_positions_BT`,
        `cache_positions_BS` and `cache_used`.

        Returns:
            (out_BTD, new_kv): new_kv is the new tokens' (k, v), each (B, T, K, D), to be written
            into the cache at its next entries; None without a cache.
        """
        inv_freq = np.asarray(self.inv_freq, np.float32)
        q = checkpoint_name(self._biased(self.wq(x_BTD), self.bq), "query")
        k = checkpoint_name(self._biased(self.wk(x_BTD), self.bk), "key")
        v = checkpoint_name(self._biased(self.wv(x_BTD), self.bv), "value")
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = constrain(apply_rope(q, positions_BT, inv_freq, self.rope_scale), ("batch", "seq", "act_heads", None))
        k = apply_rope(k, positions_BT, inv_freq, self.rope_scale)
        scale = self.head_dim**-0.5
        if kv is None:
            out = self_attention(q, k, v, mask, scale=scale)
        else:
            out = cached_attention([q * scale], [k], v, kv[:1], kv[1], layer=layer, positions_BT=positions_BT,
                                   **cache_kwargs)
        new_kv = None if kv is None else (k, v)
        return checkpoint_name(self._biased(self.wo(out), self.bo), "attn_out"), new_kv
