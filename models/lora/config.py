"""What a LoRA run adapts: rank, alpha, dropout and targets (HF module names), and the checks of
targets against a model."""

from __future__ import annotations

from dataclasses import dataclass

ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLA_TARGETS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
TARGETS = (*ATTENTION_TARGETS, *MLA_TARGETS, *MLP_TARGETS, "experts", "embed_tokens", "lm_head")
# The HF module name of each projection weight, by its attribute name in the model.
WEIGHT_TARGETS = {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj", "wq_a": "q_a_proj",
                  "wq_b": "q_b_proj", "wkv_a": "kv_a_proj_with_mqa", "wkv_b": "kv_b_proj", "w_gate": "gate_proj",
                  "w_up": "up_proj", "w_down": "down_proj", "embed": "embed_tokens", "lm_head": "lm_head"}


@dataclass(frozen=True)
class LoRAConfig:
    """`rank` 0 means no adapters. `alpha / rank` scales the update (PEFT's `lora_alpha`);
    `dropout` is the rate at which training drops an adapter's inputs (PEFT's `lora_dropout`);
    `targets` are HF module names (`TARGETS`); `base` is what a training run adapts (an HF
    directory or a podtrain checkpoint; None: the base `train.seed` makes), `init` a PEFT adapter
    its adapters start from (None: new adapters)."""

    rank: int = 0
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    base: str | None = None
    init: str | None = None

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def wants(self, target: str) -> bool:
        return self.rank > 0 and target in self.targets

    def validate(self, prefix: str = "lora") -> None:
        if self.rank < 0:
            raise ValueError(f"{prefix}.rank: expected 0 (no adapters) or a positive integer, found {self.rank}")
        if not self.alpha > 0:
            raise ValueError(f"{prefix}.alpha: expected a number > 0, found {self.alpha}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"{prefix}.dropout: expected a rate in [0, 1), found {self.dropout}")
        undropped = [t for t in ("experts", "lm_head") if t in self.targets]
        if self.dropout and undropped:
            raise ValueError(f"{prefix}.dropout: expected 0 with the target(s) {undropped}, found {self.dropout} (the "
                             "experts' adapters, as PEFT's on fused expert weights, and the LM head's, which the loss "
                             "reads merged into the head, take no dropout); set lora.dropout=0 or leave them out")
        unknown = [t for t in self.targets if t not in TARGETS]
        if unknown:
            raise ValueError(f"{prefix}.targets: unknown module name(s) {unknown}; expected some of {list(TARGETS)}")
        if self.rank and not self.targets:
            raise ValueError(f"{prefix}.targets: expected at least one module name with {prefix}.rank > 0")


def check_targets(lora: LoRAConfig, config) -> None:
    """Raises ValueError naming `lora.targets` for a target the model (a `ModelConfig`) lacks."""
    if not lora.rank:
        return
    if config.tie_word_embeddings and lora.wants("lm_head") and lora.wants("embed_tokens"):
        raise ValueError("lora.targets: lm_head and embed_tokens are one weight in a model with tied embeddings "
                         "(model.tie_word_embeddings); target one of them")
    if lora.wants("experts") and not config.num_moe_layers:
        raise ValueError(f"lora.targets: experts adapts routed experts, and this {config.model_type} model has none; "
                         "remove it from lora.targets")


def check_slot_targets(lora: LoRAConfig, config) -> None:
    """Raises ValueError naming `lora.targets` for a target that cannot hold adapter slots."""
    if config.tie_word_embeddings and lora.wants("embed_tokens"):
        raise ValueError("lora.targets: embed_tokens is also the LM head in a model with tied embeddings "
                         "(model.tie_word_embeddings), which takes no adapter slots; remove it from lora.targets")
