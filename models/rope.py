"""Rotary position embeddings: the frequencies of the default, Llama 3.1 and YaRN scalings, and the rotation."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from podtrain.models.config import RopeConfig


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
