"""LoRA adapters applied to a built model: the one package that knows adapters.

- `config.py`: `LoRAConfig` (rank, alpha, dropout, HF target names) and the target checks;
- `adapter.py`: the adapter modules beside a weight, their initial values, training's dropout;
- `experts.py`: adapters on DeepSeek-V3's routed experts, applied inside the expert dispatch;
- `apply.py`: `apply_lora` (the pass over a built model), `merged`, `with_base`, `adapters`;
- `rows.py`: how each batch row reaches its adapter slot (`rows(...)`), for many adapters at once;
- `slots.py`: one slot at a time: a new adapter, one slot's adapter as a plain one, and back;
- `peft.py`: the PEFT adapter format, both ways.
"""

from podtrain.models.lora.adapter import (
    ADAPTER_DTYPE,
    AdaptedWeight,
    Adapter,
    LoRAEmbedding,
    LoRALinear,
    LoRAParam,
    LoRATiedHead,
    dropout,
    dropout_stream,
)
from podtrain.models.lora.apply import adapters, apply_lora, merged, with_base
from podtrain.models.lora.config import (
    ATTENTION_TARGETS,
    MLA_TARGETS,
    MLP_TARGETS,
    TARGETS,
    WEIGHT_TARGETS,
    LoRAConfig,
    check_slot_targets,
    check_targets,
)
from podtrain.models.lora.experts import AdaptedExperts, LoRAExperts, SlotAdaptedExperts
from podtrain.models.lora.peft import load_peft, read_peft_config, to_peft
from podtrain.models.lora.rows import Rows, current_rows, rows
from podtrain.models.lora.slots import init_slot, set_slot, set_slot_arrays, slot_view

__all__ = [
    "ADAPTER_DTYPE", "ATTENTION_TARGETS", "MLA_TARGETS", "MLP_TARGETS", "TARGETS", "WEIGHT_TARGETS", "AdaptedExperts",
    "AdaptedWeight", "Adapter", "LoRAConfig", "LoRAEmbedding", "LoRAExperts", "LoRALinear", "LoRAParam",
    "LoRATiedHead", "Rows", "SlotAdaptedExperts", "adapters", "apply_lora", "check_slot_targets", "check_targets",
    "current_rows", "dropout", "dropout_stream", "init_slot", "load_peft", "merged", "read_peft_config", "rows",
    "set_slot", "set_slot_arrays", "slot_view", "to_peft", "with_base",
]
