"""The decoder block and its parts: RMSNorm, the SwiGLU MLP and the pre-norm decoder layer."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from podtrain.models.config import ModelConfig
from podtrain.models.linear import dtype_of, linear, param
from podtrain.sharding.rules import constrain


class RMSNorm(nnx.Module):
    """Root-mean-square norm over the last axis, computed in float32 (as HF does)."""

    def __init__(self, dim: int, *, eps: float, param_dtype, rngs: nnx.Rngs):
        self.eps = eps
        self.scale = param(rngs, nnx.initializers.ones, (dim,), ("norm",), param_dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.scale[...].astype(x.dtype) * x32.astype(x.dtype)


def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """The SwiGLU activation of the gate and up projections: silu(gate) * up (the MLP's and every expert's)."""
    return jax.nn.silu(gate) * up


class MLP(nnx.Module):
    """SwiGLU feed-forward: down(swiglu(gate(x), up(x))), `intermediate_size` wide unless given."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, intermediate_size: int | None = None):
        c = config
        pdt = dtype_of(c.param_dtype)
        self.dtype = dtype_of(c.dtype)
        init = nnx.initializers.normal(c.initializer_range)
        d, f = c.hidden_size, intermediate_size or c.intermediate_size
        self.w_gate = linear(rngs, init, (d,), (f,), ("embed", "mlp"), pdt)
        self.w_up = linear(rngs, init, (d,), (f,), ("embed", "mlp"), pdt)
        self.w_down = linear(rngs, init, (f,), (d,), ("mlp", "embed"), pdt)
        if c.mlp_bias:
            zeros = nnx.initializers.zeros
            self.b_gate = param(rngs, zeros, (f,), ("mlp",), pdt)
            self.b_up = param(rngs, zeros, (f,), ("mlp",), pdt)
            self.b_down = param(rngs, zeros, (d,), ("norm",), pdt)
        else:
            self.b_gate = self.b_up = self.b_down = None

    def _biased(self, y, b):
        return y if b is None else y + b[...].astype(self.dtype)

    def __call__(self, x_BTD):
        gate = self._biased(self.w_gate(x_BTD), self.b_gate)
        up = self._biased(self.w_up(x_BTD), self.b_up)
        return self._biased(self.w_down(swiglu(gate, up)), self.b_down)


class DecoderLayer(nnx.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x)).

    `attention` and `mlp` make the blocks from the layer's Rngs: GQA attention and the SwiGLU
    `MLP` for Llama and Qwen3; DeepSeek-V3 makes latent attention and, in its MoE stack, the MoE
    block (whose call returns `(y, stats)`).
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, attention: Callable[[nnx.Rngs], nnx.Module],
                 mlp: Callable[[nnx.Rngs], nnx.Module]):
        pdt = dtype_of(config.param_dtype)
        self.input_norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, param_dtype=pdt, rngs=rngs)
        self.attn = attention(rngs)
        self.post_attn_norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, param_dtype=pdt, rngs=rngs)
        self.mlp = mlp(rngs)

    def __call__(self, x_BTD, *, positions_BT, **attention_kwargs):
        """Returns (x, outputs): `outputs["kv"]` is the updated stacked cache pair (None without a
        cache), plus the MoE block's statistics when the layer has one. `attention_kwargs` (the mask
        or the cache arguments) go to the attention block."""
        attn, new_kv = self.attn(self.input_norm(x_BTD), positions_BT=positions_BT, **attention_kwargs)
        x_BTD = x_BTD + attn
        mlp_out = self.mlp(self.post_attn_norm(x_BTD))
        stats = {}
        if isinstance(mlp_out, tuple):
            mlp_out, stats = mlp_out
        x_BTD = x_BTD + mlp_out
        return constrain(x_BTD, ("batch", "seq", "act_embed")), {"kv": new_kv, **stats}
