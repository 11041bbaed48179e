"""LoRA adapters in the PEFT format: `adapter_model.safetensors` and `adapter_config.json`.

PEFT names an adapter by the HF module it adapts, `base_model.model.<module>.lora_A.weight`
`(rank, in_features)` and `lora_B.weight` `(out_features, rank)` (embeddings `lora_embedding_A`
`(rank, num_embeddings)` and `lora_embedding_B` `(embedding_dim, rank)`), one per layer, and
scales the update by `lora_alpha / r`, as podtrain does. An exported `target_modules` lists the
modules adapted by their full names (a short name such as `gate_proj` would also take in
DeepSeek-V3's routed experts, which podtrain's `gate_proj` target does not). Our `A (*in, rank)` and `B (rank, *out)`
are laid out the way the weight's HF tensor is (`hf_mapping`): its HF output dimension flattens
`B`'s output axes, its input dimension `A`'s input axes.

DeepSeek-V3's routed experts (the "experts" target) are adapted as PEFT adapts transformers' fused
expert parameters, listed in `target_parameters`: per layer one adapter on
`mlp.experts.gate_up_proj` `(E, 2F, D)` and one on `mlp.experts.down_proj` `(E, D, F)`, each with
`lora_A` `(E * rank, in)` (rows expert-major) and `lora_B` `(out, rank * E)` (columns rank-major).
PEFT wraps the expert module once per parameter, `gate_up_proj` innermost, so that one's tensors
are `...mlp.experts.base_layer.lora_A.weight`, the down projection's `...mlp.experts.lora_A.weight`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from safetensors.numpy import load_file, save_file

from podtrain.models.architectures import ARCHITECTURES
from podtrain.models.config import ModelConfig
from podtrain.models.hf_mapping import Axes
from podtrain.models.lora.adapter import Adapter
from podtrain.models.lora.apply import adapters
from podtrain.models.lora.config import LoRAConfig

ADAPTER_FILE, ADAPTER_CONFIG = "adapter_model.safetensors", "adapter_config.json"
PREFIX = "base_model.model."
# Our expert adapters by the fused HF parameter they adapt, in PEFT's wrapping order (innermost first).
EXPERT_PARAMETERS = {"mlp.w_gate_up": "gate_up_proj", "mlp.w_down": "down_proj"}


@dataclass(frozen=True)
class _Layout:
    """Where one adapter stands in a PEFT adapter: per layer (one for a global weight) the names of
    its A and B and the HF module (or, for `target_parameters`, parameter) it adapts, and the
    conversion of one layer's (A, B) to PEFT's (lora_A, lora_B) and back (given A's and B's shapes)."""

    names: list[tuple[str, str]]
    targets: list[str]
    parameter: bool
    stacked: bool
    to_peft: Callable
    from_peft: Callable


def _layout(config: ModelConfig, key: str, adapter: Adapter) -> _Layout:
    mapping = ARCHITECTURES[config.model_type].hf_mapping
    stack, _, weight = key.partition(".")
    stacked = stack in mapping.stacks
    if stack == mapping.expert_stack and weight in EXPERT_PARAMETERS:
        parameter = EXPERT_PARAMETERS[weight]
        experts = mapping.expert_tensors["mlp.w_gate"][0].partition(".{e}")[0]  # the HF module of the experts
        first = mapping.stacks[stack](config)
        wrapped = ".base_layer" * (len(EXPERT_PARAMETERS) - 1 - list(EXPERT_PARAMETERS.values()).index(parameter))
        modules = [f"model.layers.{first + i}.{experts}" for i in range(adapter.lora_a.shape[0])]
        return _Layout(_weight_names([m + wrapped for m in modules]), [f"{m}.{parameter}" for m in modules], True,
                       True, _experts_to_peft, _experts_from_peft)
    lead = adapter.lora_a.ndim - adapter.n_in - 1
    shape = (*adapter.lora_a.shape[:-1], *adapter.lora_b.shape[lead + 1:])  # the adapted weight's
    hf_names, axes = mapping.names(key, config, shape)
    modules = [str(n).removesuffix(".weight") for n in np.atleast_1d(hf_names)]
    if key == "embed":
        names = [(f"{PREFIX}{m}.lora_embedding_A", f"{PREFIX}{m}.lora_embedding_B") for m in modules]
        return _Layout(names, modules, False, stacked, lambda a, b: (a.T, b.T),
                       lambda lora_a, lora_b, *_: (lora_a.T, lora_b.T))
    return _Layout(_weight_names(modules), modules, False, stacked,
                   lambda a, b: _to_peft(a, b, axes, adapter.n_in),
                   lambda lora_a, lora_b, a_shape, b_shape: _from_peft(lora_a, lora_b, a_shape, b_shape, axes,
                                                                       adapter.n_in))


def _weight_names(modules: list[str]) -> list[tuple[str, str]]:
    return [(f"{PREFIX}{m}.lora_A.weight", f"{PREFIX}{m}.lora_B.weight") for m in modules]


def _to_peft(a: np.ndarray, b: np.ndarray, axes: Axes, n_in: int) -> tuple[np.ndarray, np.ndarray]:
    """One layer's (A, B) as PEFT's (lora_A, lora_B)."""
    out_group, in_group = axes
    lora_a = a.transpose([n_in, *in_group]).reshape(a.shape[-1], -1)
    lora_b = b.transpose([k - n_in + 1 for k in out_group] + [0]).reshape(-1, b.shape[0])
    return lora_a, lora_b


def _from_peft(lora_a: np.ndarray, lora_b: np.ndarray, a_shape, b_shape, axes: Axes, n_in: int):
    """PEFT's (lora_A, lora_B) as one layer's (A, B) of shapes `a_shape`, `b_shape`."""
    out_group, in_group = axes
    order_a = [n_in, *in_group]
    a = lora_a.reshape([a_shape[i] for i in order_a]).transpose(np.argsort(order_a))
    order_b = [k - n_in + 1 for k in out_group] + [0]
    b = lora_b.reshape([b_shape[i] for i in order_b]).transpose(np.argsort(order_b))
    return a, b


def _experts_to_peft(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One layer's expert adapters, A (E, in, r) and B (E, r, *out), as PEFT's (E * r, in) and (out, r * E)."""
    experts, rank = b.shape[:2]
    lora_a = a.transpose(0, 2, 1).reshape(experts * rank, -1)
    return lora_a, np.moveaxis(b, (0, 1), (-1, -2)).reshape(-1, rank * experts)


def _experts_from_peft(lora_a: np.ndarray, lora_b: np.ndarray, a_shape, b_shape) -> tuple[np.ndarray, np.ndarray]:
    """PEFT's expert (lora_A, lora_B) as one layer's A and B of shapes `a_shape`, `b_shape`."""
    experts, rank = b_shape[:2]
    a = lora_a.reshape(experts, rank, *a_shape[1:-1]).transpose(0, 2, 1)
    return a, np.moveaxis(lora_b.reshape(*b_shape[2:], rank, experts), (-1, -2), (0, 1))


def _host(x: jax.Array) -> np.ndarray:
    """The whole of an adapter array on this host (adapters are small)."""
    return np.asarray(multihost_utils.process_allgather(x, tiled=True) if jax.process_count() > 1 else x)


def to_peft(model: nnx.Module, config: ModelConfig, lora: LoRAConfig, path, *, base: str | None = None) -> None:
    """Writes `model`'s adapters as a PEFT adapter directory `path` (every process calls it;
    process 0 writes). `base` is recorded as `base_model_name_or_path`.

    Raises:
        ValueError: DeepSeek-V3 MLP adapters, which `peft` would put on the routed experts.
    """
    architecture = ARCHITECTURES[config.model_type]
    refused = sorted(set(lora.targets) & set(architecture.peft_unwritable))
    if refused:
        raise ValueError(f"lora.targets: {refused} on {architecture.name} cannot be written for peft, which takes "
                         "these names to mean other modules (the routed experts' fused projections, where podtrain "
                         "adapts the dense and shared-expert MLPs): export the merged weights instead "
                         "(podtrain export)")
    tensors, modules, parameters = {}, [], []
    for key, adapter in adapters(model):
        layout = _layout(config, key, adapter)
        a, b = _host(adapter.lora_a[...]), _host(adapter.lora_b[...])
        (parameters if layout.parameter else modules).extend(layout.targets)
        for (name_a, name_b), layer in zip(layout.names, zip(a, b, strict=True) if layout.stacked else [(a, b)],
                                           strict=True):
            lora_a, lora_b = layout.to_peft(*layer)
            tensors |= {name_a: np.ascontiguousarray(lora_a), name_b: np.ascontiguousarray(lora_b)}
    if jax.process_index() != 0:
        return
    # PEFT wraps in the order listed, the last innermost: gate_up_proj (the first wrapped) goes last.
    outermost_first = list(EXPERT_PARAMETERS.values())[::-1]
    parameters.sort(key=lambda name: outermost_first.index(name.rsplit(".", 1)[-1]))
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / ADAPTER_FILE), metadata={"format": "pt"})
    peft_config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank, "lora_alpha": lora.alpha,
                   "lora_dropout": lora.dropout, "target_modules": modules, "target_parameters": parameters or None,
                   "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
                   "inference_mode": True, "init_lora_weights": True, "base_model_name_or_path": base,
                   "modules_to_save": None}
    (out / ADAPTER_CONFIG).write_text(json.dumps(peft_config, indent=2) + "\n")


def read_peft_config(path) -> LoRAConfig:
    """The LoRA settings of a PEFT adapter directory; ValueError naming the file and key for what
    podtrain does not run (another PEFT type, rsLoRA, DoRA, biases, per-module ranks, parameters
    other than the routed experts' fused projections, both together)."""
    file = Path(path) / ADAPTER_CONFIG
    if not file.is_file():
        raise ValueError(f"{file}: not found; expected a PEFT adapter directory with {ADAPTER_CONFIG}")
    found = json.loads(file.read_text())
    unsupported = {"peft_type": found.get("peft_type") != "LORA", "bias": found.get("bias", "none") != "none",
                   **{key: bool(found.get(key)) for key in ("use_rslora", "use_dora", "rank_pattern", "alpha_pattern",
                                                             "modules_to_save", "layers_to_transform")}}
    for key, bad in unsupported.items():
        if bad:
            raise ValueError(f"{file}: {key}={found.get(key)!r} is not what podtrain runs (LoRA on modules, no "
                             "biases, one rank and alpha for every module, every layer, no rsLoRA or DoRA)")
    targets = found.get("target_modules") or []
    if isinstance(targets, str):
        raise ValueError(f"{file}: target_modules is a pattern ({targets!r}); podtrain reads a list of module names")
    targets = {name.rsplit(".", 1)[-1] for name in targets}
    parameters = {name.rsplit(".", 1)[-1] for name in found.get("target_parameters") or []}
    if parameters:
        if parameters != set(EXPERT_PARAMETERS.values()):
            raise ValueError(f"{file}: target_parameters={found['target_parameters']!r}; podtrain adapts the routed "
                             f"experts' {' and '.join(EXPERT_PARAMETERS.values())} together (lora.targets: experts)")
        targets.add("experts")
    return LoRAConfig(rank=int(found["r"]), alpha=float(found["lora_alpha"]),
                      dropout=float(found.get("lora_dropout") or 0.0), targets=tuple(sorted(targets)))


def load_peft(model: nnx.Module, config: ModelConfig, path) -> None:
    """Sets `model`'s adapters from the PEFT adapter directory `path`, each in its sharding; the
    adapters `model` has and the ones the files hold must be the same (ValueError listing both)."""
    file = Path(path) / ADAPTER_FILE
    if not file.is_file():
        raise ValueError(f"{file}: not found; expected a PEFT adapter directory with {ADAPTER_FILE}")
    tensors = load_file(str(file))
    used = set()
    for key, adapter in adapters(model):
        layout = _layout(config, key, adapter)
        lead = 1 if layout.stacked else 0  # the stack's leading axis
        layers_a, layers_b = [], []
        for names in layout.names:
            missing = [n for n in names if n not in tensors]
            if missing:
                raise ValueError(f"{file}: no tensor {missing[0]} for the adapter of {key}")
            a, b = layout.from_peft(tensors[names[0]], tensors[names[1]], adapter.lora_a.shape[lead:],
                                    adapter.lora_b.shape[lead:])
            layers_a.append(a)
            layers_b.append(b)
            used.update(names)
        for param, values in ((adapter.lora_a, layers_a), (adapter.lora_b, layers_b)):
            value = np.stack(values) if layout.stacked else values[0]
            if value.shape != param.shape:
                raise ValueError(f"{file}: the adapter of {key} is {value.shape} in the file, {param.shape} here")
            param.set_value(jax.device_put(value.astype(param.dtype), param[...].sharding))
    # PEFT also saves the base weights of targeted embeddings (`...base_layer.weight`), not adapters.
    extra = sorted(name for name in set(tensors) - used if not name.endswith(".base_layer.weight"))
    if extra:
        raise ValueError(f"{file}: tensors for modules this model's lora.targets leave out: {extra[:3]}"
                         + (f" and {len(extra) - 3} more" if len(extra) > 3 else ""))
