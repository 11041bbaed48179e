"""The registry: every architecture podtrain builds, by `ModelConfig.model_type`, with all that
differs between them in one spec (module class, checks, HF config and tensor names, FLOPs, PEFT)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from podtrain.models import deepseek, llama
from podtrain.models.hf_mapping import DEEPSEEK_V3, LLAMA3, QWEN3, HFMapping

MLP_MODULES = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class AdapterTargets:
    """The HF module names of an architecture's attention projections, its feed-forward
    layers and its LM head: what a service's `train_attn`, `train_mlp` and `train_unembed` choose."""

    attention: tuple[str, ...]
    mlp: tuple[str, ...]
    unembed: tuple[str, ...] = ("lm_head",)

    def chosen(self, *, attn: bool = True, mlp: bool = True, unembed: bool = True) -> tuple[str, ...]:
        return (*(self.attention if attn else ()), *(self.mlp if mlp else ()), *(self.unembed if unembed else ()))


@dataclass(frozen=True)
class Architecture:
    """One architecture's pieces.

    Attributes:
        name: how messages name it.
        model_class: the module (`model_class(config, rngs=...)`).
        flops_per_token: model FLOPs of one training token at a sequence length.
        hf_class: the transformers class config.json's `architectures` names.
        hf_fields: `hf_fields(config_json, source)`: the ModelConfig fields its config.json sets
            beyond the keys every architecture shares.
        hf_keys: `hf_keys(config, shared)`: its config.json from the shared keys.
        hf_mapping: its HF checkpoint's tensor names and layouts.
        adapter_targets: the HF module names of its attention, feed-forward layers and LM head.
        peft_unwritable: adapter targets PEFT would read as other modules (refused on export).
    """

    name: str
    model_class: type[llama.Llama]
    flops_per_token: Callable
    hf_class: str
    hf_fields: Callable
    hf_keys: Callable
    hf_mapping: HFMapping
    adapter_targets: AdapterTargets
    peft_unwritable: tuple[str, ...] = ()


LLAMA_TARGETS = AdapterTargets(("q_proj", "k_proj", "v_proj", "o_proj"), MLP_MODULES)
# Latent attention's projections; the dense and shared-expert MLPs and the routed experts.
DEEPSEEK_TARGETS = AdapterTargets(("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"),
                                  (*MLP_MODULES, "experts"))

ARCHITECTURES = {
    "llama": Architecture("Llama 3", llama.Llama, llama.flops_per_token, "LlamaForCausalLM", llama.llama_from_hf,
                          llama.llama_to_hf, LLAMA3, LLAMA_TARGETS),
    "qwen3": Architecture("Qwen3", llama.Llama, llama.flops_per_token, "Qwen3ForCausalLM", llama.qwen3_from_hf,
                          llama.qwen3_to_hf, QWEN3, LLAMA_TARGETS),
    # peft takes the MLP module names to mean the routed experts' fused projections.
    "deepseek_v3": Architecture("DeepSeek-V3", deepseek.DeepseekV3, deepseek.flops_per_token, "DeepseekV3ForCausalLM",
                                deepseek.deepseek_from_hf, deepseek.deepseek_to_hf, DEEPSEEK_V3, DEEPSEEK_TARGETS,
                                peft_unwritable=MLP_MODULES),
}


def validate_model(config, prefix: str = "model") -> None:
    """Raises ValueError naming the key when `config` (a ModelConfig) is not one podtrain builds:
    an unknown `model_type`, a field out of range, or a section its architecture reads."""
    if config.model_type not in ARCHITECTURES:
        raise ValueError(f"{prefix}.model_type: expected one of {list(ARCHITECTURES)}, found {config.model_type!r}")
    ARCHITECTURES[config.model_type].model_class.check_config(config, prefix)


def flops_per_token(config, seq_len: int) -> float:
    """Model FLOPs of one training token of `config` at `seq_len` (forward + backward, no remat
    recompute), as its architecture counts them."""
    return ARCHITECTURES[config.model_type].flops_per_token(config, seq_len)
