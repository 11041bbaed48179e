"""Model hyper-parameters: plain data shared by the model code, the config schema and HF I/O."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

MODEL_TYPES = ("llama", "qwen3")
ROPE_TYPES = ("default", "llama3")
DTYPES = ("float32", "bfloat16", "float16")
REMAT_POLICIES = ("none", "full", "dots", "dots_no_batch", "save_attn_out", "save_qkv_attn_out")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters, named as in HF's `rope_parameters`.

    `rope_type="llama3"` applies Llama 3.1's frequency-dependent scaling with `factor`,
    `low_freq_factor`, `high_freq_factor` and `original_max_position_embeddings`.
    """

    rope_type: str = "default"
    theta: float = 10000.0
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and numerics of a decoder-only transformer (Llama 3 and Qwen3 families).

    `remat` names what the per-layer `jax.checkpoint` keeps for the backward pass (the policies
    are described in `models/runner.py`); `scan_layers=False` unrolls the layer loop (a reference
    and benchmark baseline); `dtype` is the compute dtype, `param_dtype` the storage dtype.
    """

    model_type: str = "llama"
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_layers: int = 32
    num_heads: int = 32
    num_kv_heads: int = 32
    head_dim: int = 128
    rms_norm_eps: float = 1e-5
    rope: RopeConfig = field(default_factory=RopeConfig)
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    dtype: str = "float32"
    param_dtype: str = "float32"
    remat: str = "full"
    scan_layers: bool = True
    initializer_range: float = 0.02

    def validate(self, prefix: str = "model") -> None:
        """Raises ValueError naming the key when a field is out of range."""
        if self.model_type not in MODEL_TYPES:
            raise ValueError(
                f"{prefix}.model_type: expected one of {list(MODEL_TYPES)}, found {self.model_type!r}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{prefix}.{name}: expected a positive integer, found {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"{prefix}.num_heads ({self.num_heads}) must be a multiple of "
                f"{prefix}.num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"{prefix}.head_dim: RoPE needs an even head_dim, found {self.head_dim}")
        for name in ("dtype", "param_dtype"):
            if getattr(self, name) not in DTYPES:
                raise ValueError(f"{prefix}.{name}: expected one of {list(DTYPES)}, found {getattr(self, name)!r}")
        if self.remat not in REMAT_POLICIES:
            raise ValueError(
                f"{prefix}.remat: unknown remat policy {self.remat!r}; valid policies: {', '.join(REMAT_POLICIES)}"
            )
        if self.rope.rope_type not in ROPE_TYPES:
            raise ValueError(
                f"{prefix}.rope.rope_type: expected one of {list(ROPE_TYPES)}, found {self.rope.rope_type!r}"
            )

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads
