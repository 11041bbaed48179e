"""Self-attention kernels: the XLA reference, splash (Pallas, TPU) and cuDNN flash attention.

- "xla": any platform: the (queries x keys) scores as batched matmuls, softmax in float32, a
  backward pass that recomputes the probabilities from the saved row logsumexp.
- "splash": the Pallas splash attention kernel that ships with JAX (TPU flash attention); with
  `interpret` it runs in Pallas's interpret mode (CPU devices, for tests).
- "cudnn": cuDNN's flash attention (`jax.nn.dot_product_attention(implementation="cudnn")`), CUDA
  GPUs only, bfloat16 or float16.

The flash kernels never build the score matrix. They mask causally by token index within
segments (packed documents) and run per device on its batch rows and heads (`sharded`).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

NEG_INF = float(np.finfo(np.float32).min)
BACKENDS = ("auto", "xla", "splash", "cudnn")
FLASH_SEQ_MULTIPLE = 128  # the splash kernel's tiles are multiples of the TPU's 128 lanes
_SPLASH_BLOCK = 512


def flash_multiple(context: int = 1) -> int:
    """What a sequence length must be a multiple of for the flash kernels when split over `context`
    devices: their tile, or one tile per chunk of the balanced order (2 per device)."""
    return FLASH_SEQ_MULTIPLE if context == 1 else 2 * context * FLASH_SEQ_MULTIPLE


def resolve_backend(name: str, platform: str, dtype: str = "bfloat16", seq_len: int | None = None,
                    context: int = 1) -> str:
    """The backend `name` resolves to on devices of `platform` ("cpu", "tpu", "gpu") for sequences
    of `seq_len` tokens (None: any length the kernels take) split over `context` devices (context
    parallelism: splash only, on a whole number of tiles per chunk)."""
    if name != "auto":
        return name
    if seq_len is not None and seq_len % flash_multiple(context):
        return "xla"
    if platform == "tpu":
        return "splash"
    if platform in ("gpu", "cuda") and dtype in ("bfloat16", "float16") and context == 1:
        return "cudnn"
    return "xla"


def check_backend(name: str, platform: str, dtype: str, seq_len: int | None = None, key: str = "model.attention",
                  seq_key: str = "train.seq_len", context: int = 1, context_key: str = "mesh.cp"):
    """Raises ValueError naming `key` when backend `name` cannot run on `platform` at `dtype`, or
    on sequences of `seq_len` tokens (the config key `seq_key`) split over `context` devices (the
    config key `context_key`)."""
    if name not in BACKENDS:
        raise ValueError(f"{key}: expected one of {list(BACKENDS)}, found {name!r}")
    if name == "cudnn":
        if platform not in ("gpu", "cuda"):
            raise ValueError(f"{key}=cudnn: cuDNN attention needs CUDA GPUs, found {platform} devices")
        if dtype not in ("bfloat16", "float16"):
            raise ValueError(f"{key}=cudnn: cuDNN attention needs model.dtype bfloat16 or float16, found {dtype}")
        if context > 1:
            raise ValueError(f"{key}=cudnn: cuDNN attention cannot take a sequence split over devices, found "
                             f"{context_key}={context}; use {key}=xla (or splash on TPU)")
    if name == "splash" and platform not in ("tpu", "cpu"):
        raise ValueError(f"{key}=splash: splash attention runs on TPU (interpreted on CPU), found {platform} devices")
    multiple = flash_multiple(context)
    if name in ("splash", "cudnn") and seq_len is not None and seq_len % multiple:
        per = f" ({FLASH_SEQ_MULTIPLE} per chunk, 2 chunks per device of {context_key}={context})"
        per = per if context > 1 else ""
        raise ValueError(f"{key}={name}: {seq_key} must be a multiple of {multiple}{per}, found {seq_len}")


def _batched_matmul(a: jax.Array, b: jax.Array) -> jax.Array:
    """(B, K, M, C) @ (B, K, C, N) -> (B, K, M, N) in float32."""
    return jax.lax.dot_general(a, b, (((3,), (2,)), ((0, 1), (0, 1))), preferred_element_type=jnp.float32)


def _masked_scores(q, k_t, bias_BTS):
    """q (B, K, G*T, D) @ k_t (B, K, D, S) plus the (B, T, S) bias broadcast over K and G."""
    scores = _batched_matmul(q, k_t)
    b, kv_heads, gt, s = scores.shape
    t = bias_BTS.shape[1]
    return (scores.reshape(b, kv_heads, gt // t, t, s) + bias_BTS[:, None, None]).reshape(scores.shape)


@jax.custom_vjp
def attend(q, k_t, v, bias_BTS):
    """softmax(q k_t + bias) v for q (B, K, G*T, D), k_t (B, K, D, S), v (B, K, S, D); softmax in float32.

    The backward pass recomputes the probabilities from the saved row logsumexp (as flash
    attention does) instead of keeping them, and every (queries x keys) array is made and used
    by canonical batched matmuls, so XLA never copies one into a transposed layout.
    """
    return _attend_fwd(q, k_t, v, bias_BTS)[0]


def _attend_fwd(q, k_t, v, bias_BTS):
    scores = _masked_scores(q, k_t, bias_BTS)
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    unnormalised = jnp.exp(scores - row_max)
    row_sum = jnp.sum(unnormalised, axis=-1, keepdims=True)
    out = _batched_matmul((unnormalised / row_sum).astype(v.dtype), v).astype(v.dtype)
    return out, (q, k_t, v, bias_BTS, out, row_max + jnp.log(row_sum))


def _attend_bwd(residuals, d_out):
    q, k_t, v, bias_BTS, out, logsumexp = residuals
    probs = jnp.exp(_masked_scores(q, k_t, bias_BTS) - logsumexp)
    d_v_t = _batched_matmul(jnp.swapaxes(d_out, 2, 3), probs.astype(d_out.dtype))
    d_probs = _batched_matmul(d_out, jnp.swapaxes(v, 2, 3))
    d_scores = probs * (d_probs - jnp.sum(d_out * out, axis=-1, keepdims=True, dtype=jnp.float32))
    d_scores = d_scores.astype(q.dtype)
    d_q = _batched_matmul(d_scores, jnp.swapaxes(k_t, 2, 3)).astype(q.dtype)
    d_k_t = _batched_matmul(jnp.swapaxes(q, 2, 3), d_scores).astype(k_t.dtype)
    return d_q, d_k_t, jnp.swapaxes(d_v_t, 2, 3).astype(v.dtype), None


attend.defvjp(_attend_fwd, _attend_bwd)


def xla_attention(q_BTHD, k_BSKD, v_BSKE, mask_BTS):
    """`attend` in head-major layout: (B, K, G*T, D) queries, one batched matmul per kv head;
    `mask_BTS` says which keys each query sees (the scale is already in q)."""
    b, t, heads, d = q_BTHD.shape
    kv_heads = k_BSKD.shape[2]
    group = heads // kv_heads
    q = q_BTHD.reshape(b, t, kv_heads, group, d).transpose(0, 2, 3, 1, 4).reshape(b, kv_heads, -1, d)
    bias_BTS = jnp.where(mask_BTS, 0.0, NEG_INF).astype(jnp.float32)
    out = attend(q, k_BSKD.transpose(0, 2, 3, 1), v_BSKE.transpose(0, 2, 1, 3), bias_BTS)
    e = out.shape[-1]
    return out.reshape(b, kv_heads, group, t, e).transpose(0, 3, 1, 2, 4).reshape(b, t, heads, e)


@functools.cache
def _causal_mask(splash):
    """Splash's causal mask, answering a block that lies wholly inside or outside it from the
    block's first and last indices. Splash classifies every (query block, key block) pair when it
    builds a kernel, four times over; evaluated element by element that takes minutes at 131072
    tokens. The kernel still computes the mask from `mask_function` and `q_sequence`."""

    class BlockCausalMask(splash.CausalMask):
        def __getitem__(self, idx):
            q_slice, kv_slice = idx
            if not (isinstance(q_slice, slice) and isinstance(kv_slice, slice)) or self.offset:
                return super().__getitem__(idx)
            rows = self.q_sequence[q_slice]
            first, stop, step = kv_slice.indices(self.shape[1])
            if rows.size and stop > first and step == 1:
                seen_all, seen_none = rows.min() >= stop - 1, rows.max() < first
                if seen_all or seen_none:
                    return _constant_block(bool(seen_all), (rows.size, stop - first))
            return super().__getitem__(idx)

    return BlockCausalMask


@functools.cache
def _constant_block(value: bool, shape: tuple[int, int]) -> np.ndarray:
    """One read-only block of `value` per shape, shared by every block it stands for."""
    block = np.full(shape, value)
    block.flags.writeable = False
    return block


def splash_kernel(heads: int, q_len: int, kv_len: int, *, shards: int = 1, q_sequence: np.ndarray | None = None,
                  interpret: bool = False):
    """Splash attention's kernel for `heads` heads of a causal mask over `q_len` queries and `kv_len` keys.

    `q_sequence` is each query's index among the keys when the queries are held in another order
    (context parallelism's balanced order); the mask is evaluated on it, so blocks that no query
    of theirs may see are still skipped. With `shards` > 1 the kernel's mask data is split over
    the queries (`q_seq_shards`): inside a `shard_map`, each device gets its own queries' rows
    (`kernel.manual_sharding_spec`). Its blocks then lie within one chunk of the balanced order
    (2 per device), so each device visits the same number of blocks.
    """
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    tile = q_len if shards == 1 else q_len // (2 * shards)
    bq, bkv = math.gcd(_SPLASH_BLOCK, tile), math.gcd(_SPLASH_BLOCK, kv_len if shards == 1 else tile)
    sizes = splash.BlockSizes(block_q=bq, block_kv=bkv, block_kv_compute=bkv, block_q_dkv=bq, block_kv_dkv=bkv,
                              block_kv_dkv_compute=bkv, block_q_dq=bq, block_kv_dq=bkv)
    causal = _causal_mask(splash)((q_len, kv_len), shard_count=shards)
    if q_sequence is not None:
        causal.q_sequence = np.asarray(q_sequence, np.int32)
    return splash.make_splash_mha(splash.MultiHeadMask([causal] * heads), block_sizes=sizes, head_shards=1,
                                  q_seq_shards=shards, interpret=interpret)


def run_splash(kernel, q_BTHD, k_BSKD, v_BSKE, segments_q_BT=None, segments_kv_BS=None):
    """`kernel` (`splash_kernel`) on each batch row; causal within equal segment ids when given."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    q, k, v = (x.transpose(0, 2, 1, 3) for x in (q_BTHD, k_BSKD, v_BSKE))
    if segments_q_BT is None:
        out = jax.vmap(lambda q, k, v: kernel(q, k, v))(q, k, v)
    else:
        out = jax.vmap(lambda q, k, v, sq, skv: kernel(q, k, v, segment_ids=splash.SegmentIds(q=sq, kv=skv)))(
            q, k, v, segments_q_BT, segments_kv_BS)
    return out.transpose(0, 2, 1, 3)


def splash_attention(q_BTHD, k_BSKD, v_BSKE, segments_BT, *, interpret: bool = False):
    """One device's splash attention: causal within segments, GQA by the kernel's head groups."""
    kernel = splash_kernel(q_BTHD.shape[2], q_BTHD.shape[1], k_BSKD.shape[1], interpret=interpret)
    return run_splash(kernel, q_BTHD, k_BSKD, v_BSKE, segments_BT, segments_BT)


def cudnn_attention(q_BTHD, k_BSKD, v_BSKE, segments_BT):
    """One device's cuDNN flash attention (scale already applied to q)."""
    mask = None if segments_BT is None else (segments_BT[:, None, :, None] == segments_BT[:, None, None, :])
    return jax.nn.dot_product_attention(q_BTHD, k_BSKD, v_BSKE, mask=mask, scale=1.0, is_causal=True,
                                        implementation="cudnn")


def sharded(local, q_BTHD, k_BSKD, v_BSKE, segments_BT, *, batch_axes: tuple[str, ...],
            head_axes: tuple[str, ...]):
    """`local(q, k, v, segments)` on each device's batch rows and heads, a kernel the partitioner
    cannot split itself: rows over `batch_axes`, heads over `head_axes` (mesh axis names; both
    empty: one call over the whole arrays)."""
    if not batch_axes and not head_axes:
        return local(q_BTHD, k_BSKD, v_BSKE, segments_BT)
    entry = lambda axes: None if not axes else axes[0] if len(axes) == 1 else axes  # noqa: E731
    x_spec = PartitionSpec(entry(batch_axes), None, entry(head_axes), None)
    seg_spec = PartitionSpec(entry(batch_axes), None)
    if segments_BT is None:
        body, args, specs = (lambda q, k, v: local(q, k, v, None)), (q_BTHD, k_BSKD, v_BSKE), (x_spec,) * 3
    else:
        body, args, specs = local, (q_BTHD, k_BSKD, v_BSKE, segments_BT), (x_spec,) * 3 + (seg_spec,)
    return jax.shard_map(body, in_specs=specs, out_specs=x_spec, check_vma=False)(*args)
