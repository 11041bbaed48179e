"""Model hyper-parameters: plain data shared by the model code, the config schema and HF I/O."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from podtrain.models.kernels.attention import BACKENDS as ATTENTION_BACKENDS
from podtrain.models.kernels.exchange import IMPLEMENTATIONS as EXCHANGES
from podtrain.models.kernels.grouped_matmul import IMPLEMENTATIONS as GROUPED_MATMULS
from podtrain.models.runner import REMAT

ROPE_TYPES = ("default", "llama3", "yarn")
DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters, named as in HF's `rope_parameters`.

    `rope_type="llama3"` applies Llama 3.1's frequency-dependent scaling with `factor`,
    `low_freq_factor`, `high_freq_factor` and `original_max_position_embeddings`.
    `rope_type="yarn"` (DeepSeek-V3) interpolates the low frequencies by `factor` with a ramp
    between `beta_fast` and `beta_slow` rotations; `mscale`/`mscale_all_dim` set the attention
    factor on cos/sin, and `mscale_all_dim` also the softmax scale (0 means unset, as in HF).
    """

    rope_type: str = "default"
    theta: float = 10000.0
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V3), named as in HF's config.

    `q_lora_rank=0` projects queries directly (no low-rank query path). Keys and values are
    rebuilt per head from a `kv_lora_rank` latent plus one shared `qk_rope_head_dim` rotary key;
    `rope_interleave` reads the rotary dimensions as interleaved pairs (the released weights).
    """

    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    rope_interleave: bool = True

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def validate(self, prefix: str, num_heads: int, num_kv_heads: int) -> None:
        """Raises ValueError naming the key when a field is out of range (`prefix`: the section's key)."""
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{prefix}.{name}: expected a positive integer, found {getattr(self, name)}")
        if self.q_lora_rank < 0:
            raise ValueError(f"{prefix}.q_lora_rank: expected 0 (no query compression) or more, "
                             f"found {self.q_lora_rank}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"{prefix}.qk_rope_head_dim: RoPE needs an even size, found {self.qk_rope_head_dim}")
        if num_kv_heads != num_heads:
            model = prefix.rpartition(".")[0]
            raise ValueError(f"{model}.num_kv_heads: MLA has one key/value per query head; expected {num_heads}, "
                             f"found {num_kv_heads}")


@dataclass(frozen=True)
class MoEConfig:
    """Routed and shared experts (DeepSeek-V3); `num_experts=0` means no MoE layers.

    The first `first_k_dense_replace` layers use the dense MLP (`intermediate_size`), the rest a
    sigmoid router choosing `num_experts_per_tok` of `num_experts` experts within the best
    `topk_group` of `n_group` groups, plus `num_shared_experts` always-on experts.
    `capacity_factor=0` dispatches dropless: tokens sorted by expert run as grouped matmuls over
    exactly the rows routed, each device's experts taking `buffer_factor` x its own rows
    (tokens x k) per exchange round, more rounds when routing sends them more (none dropped).
    A positive `capacity_factor` caps each expert's tokens per source shard at
    `capacity_factor * tokens * k / num_experts` and counts the tokens dropped.
    `bias_update_rate > 0` turns on auxiliary-loss-free balancing: after each step the router's
    correction bias moves by this rate towards the experts that got fewer tokens than average.
    `grouped_matmul` (megablox, ragged_dot) and `exchange` (ragged_all_to_all, all_to_all: padded)
    pick the dropless dispatch's kernels (`models/kernels/`); "auto" is resolved for the devices
    when a run is built (megablox on TPU, the padded exchange on CPU), and a model made directly
    with "auto" runs ragged_dot and the padded exchange, which run anywhere.
    """

    num_experts: int = 0
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 2048
    num_shared_experts: int = 1
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    first_k_dense_replace: int = 0
    capacity_factor: float = 0.0
    buffer_factor: float = 1.25
    bias_update_rate: float = 0.0
    grouped_matmul: str = "auto"
    exchange: str = "auto"

    def validate(self, prefix: str, num_layers: int) -> None:
        """Raises ValueError naming the key when a field is out of range (`prefix`: the section's key)."""
        model = prefix.rpartition(".")[0]
        if not 0 <= self.first_k_dense_replace <= num_layers:
            raise ValueError(f"{prefix}.first_k_dense_replace: expected 0..{model}.num_layers ({num_layers}), "
                             f"found {self.first_k_dense_replace}")
        if self.first_k_dense_replace == num_layers:
            return
        for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "n_group", "topk_group"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{prefix}.{name}: expected a positive integer, found {getattr(self, name)}")
        if self.num_shared_experts < 0:
            raise ValueError(f"{prefix}.num_shared_experts: expected >= 0, found {self.num_shared_experts}")
        if self.num_experts % self.n_group:
            raise ValueError(f"{prefix}.n_group={self.n_group} must divide {prefix}.num_experts={self.num_experts}")
        if self.n_group > 1 and self.num_experts // self.n_group < 2:
            raise ValueError(f"{prefix}.n_group: group scores sum each group's best 2 experts; "
                             f"groups of {self.num_experts // self.n_group} expert(s) are too small")
        if self.topk_group > self.n_group:
            raise ValueError(f"{prefix}.topk_group={self.topk_group} must be <= {prefix}.n_group={self.n_group}")
        routable = self.topk_group * (self.num_experts // self.n_group)
        if self.num_experts_per_tok > routable:
            raise ValueError(f"{prefix}.num_experts_per_tok={self.num_experts_per_tok} exceeds the {routable} experts "
                             f"in the best {prefix}.topk_group={self.topk_group} groups")
        if not self.routed_scaling_factor > 0:
            raise ValueError(f"{prefix}.routed_scaling_factor: expected a number > 0, "
                             f"found {self.routed_scaling_factor}")
        for name in ("capacity_factor", "bias_update_rate"):
            if getattr(self, name) < 0:
                raise ValueError(f"{prefix}.{name}: expected a number >= 0, found {getattr(self, name)}")
        if not self.buffer_factor > 0:
            raise ValueError(f"{prefix}.buffer_factor: expected a number > 0, found {self.buffer_factor}")
        for name, choices in (("grouped_matmul", GROUPED_MATMULS), ("exchange", EXCHANGES)):
            if getattr(self, name) not in choices:
                raise ValueError(f"{prefix}.{name}: expected one of {list(choices)}, found {getattr(self, name)!r}")


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and numerics of a decoder-only transformer (Llama 3, Qwen3 and DeepSeek-V3 families).

    DeepSeek-V3 (`model_type="deepseek_v3"`) reads `mla` and `moe`; its `num_kv_heads` equals
    `num_heads` and `head_dim` is unused (MLA sets the per-head sizes).

    `remat` names what the per-layer `jax.checkpoint` keeps for the backward pass (the policies
    are described in `models/runner.py`); `scan_layers=False` unrolls the layer loop (a reference
    and benchmark baseline); `dtype` is the compute dtype, `param_dtype` the storage dtype.
    `attention` picks the self-attention backend (`models/kernels/attention.py`: auto, xla, splash,
    cudnn); "auto" is resolved for the devices when a run is built, and a model made directly with
    "auto" runs xla. `interpret_kernels` runs the Pallas kernels (splash, megablox) in Pallas's
    interpret mode: set when a run is built on CPU devices, where they cannot compile.
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
    attention: str = "auto"
    interpret_kernels: bool = False
    scan_layers: bool = True
    initializer_range: float = 0.02
    mla: MLAConfig = field(default_factory=MLAConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)

    def validate(self, prefix: str = "model") -> None:
        """Raises ValueError naming the key when a field every architecture reads is out of range
        (`architectures.validate_model` checks the model type and the sections it reads too)."""
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
        for name in ("rms_norm_eps", "initializer_range"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{prefix}.{name}: expected a number > 0, found {getattr(self, name)}")
        for name in ("dtype", "param_dtype"):
            if getattr(self, name) not in DTYPES:
                raise ValueError(f"{prefix}.{name}: expected one of {list(DTYPES)}, found {getattr(self, name)!r}")
        if self.remat not in REMAT:
            raise ValueError(f"{prefix}.remat: unknown remat policy {self.remat!r}; valid policies: {', '.join(REMAT)}")
        if self.attention not in ATTENTION_BACKENDS:
            raise ValueError(
                f"{prefix}.attention: expected one of {list(ATTENTION_BACKENDS)}, found {self.attention!r}")
        self._validate_rope(f"{prefix}.rope")

    def _validate_rope(self, prefix: str) -> None:
        rope = self.rope
        if rope.rope_type not in ROPE_TYPES:
            raise ValueError(f"{prefix}.rope_type: expected one of {list(ROPE_TYPES)}, found {rope.rope_type!r}")
        if not rope.theta > 1:
            raise ValueError(f"{prefix}.theta: expected a base > 1 (such as 10000.0), found {rope.theta}")
        if not rope.factor > 0:
            raise ValueError(f"{prefix}.factor: expected a number > 0, found {rope.factor}")
        if rope.original_max_position_embeddings <= 0:
            raise ValueError(f"{prefix}.original_max_position_embeddings: expected a positive integer, "
                             f"found {rope.original_max_position_embeddings}")
        if rope.rope_type == "llama3" and not 0 < rope.low_freq_factor < rope.high_freq_factor:
            raise ValueError(f"{prefix}.low_freq_factor={rope.low_freq_factor}, {prefix}.high_freq_factor="
                             f"{rope.high_freq_factor}: expected 0 < low_freq_factor < high_freq_factor")
        if rope.rope_type == "yarn":
            if not 0 < rope.beta_slow <= rope.beta_fast:
                raise ValueError(f"{prefix}.beta_fast={rope.beta_fast}, {prefix}.beta_slow={rope.beta_slow}: "
                                 "expected 0 < beta_slow <= beta_fast (rotations; 1 and 32 in DeepSeek-V3)")
            for name in ("mscale", "mscale_all_dim"):
                if not getattr(rope, name) >= 0:
                    raise ValueError(f"{prefix}.{name}: expected a number >= 0 (0: unset), found {getattr(rope, name)}")

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def num_dense_layers(self) -> int:
        """Layers with the dense MLP: all of them unless the model has routed experts (`moe.num_experts`)."""
        return self.moe.first_k_dense_replace if self.moe.num_experts else self.num_layers

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.num_dense_layers
