"""LoRA adapters in the PEFT format: `adapter_model.safetensors` and `adapter_config.json`.

PEFT names an adapter by the HF module it adapts, `base_model.model.<module>.lora_A.weight`
`(rank, in_features)` and `lora_B.weight` `(out_features, rank)` (embeddings `lora_embedding_A`
`(rank, num_embeddings)` and `lora_embedding_B` `(embedding_dim, rank)`), one per layer, and
scales the update by `lora_alpha / r`, as podtrain does. An exported `target_modules` lists the
modules adapted by their full names (a short name such as `gate_proj` would also take in
DeepSeek-V3's routed experts, which podtrain's `gate_proj` target does not). Our `A (*in, rank)` and `B (rank, *out)`
are laid out the way the weight's HF tensor is (`hf_mapping`): its HF output dimension flattens
`B`'s output axes, its input dimension `A`'s input axes.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from safetensors.numpy import load_file, save_file

from podtrain.models.architectures import ARCHITECTURES
from podtrain.models.config import ModelConfig
from podtrain.models.hf_mapping import Axes
from podtrain.models.lora import MLP_TARGETS, Adapter, LoRAConfig

ADAPTER_FILE, ADAPTER_CONFIG = "adapter_model.safetensors", "adapter_config.json"
PREFIX = "base_model.model."


def _adapters(model: nnx.Module):
    """(weight key as `hf_mapping` names it, the weight's per-layer shape, adapter) of every adapter."""
    for path, module in nnx.iter_modules(model):
        for name, value in vars(module).items():
            if name.endswith("_lora") and isinstance(value, Adapter):
                weight = getattr(module, name[: -len("_lora")])
                yield ".".join(str(p) for p in (*path, name[: -len("_lora")])), weight.shape, value


def _names(config: ModelConfig, key: str, shape) -> tuple[list[str], Axes, bool]:
    """(the HF module names per layer, the weight's axes map, whether it is an embedding)."""
    names, axes = ARCHITECTURES[config.model_type].hf_mapping.names(key, config, shape)
    modules = [str(n).removesuffix(".weight") for n in np.atleast_1d(names)]
    return modules, axes, key == "embed"


def _to_peft(a: np.ndarray, b: np.ndarray, axes: Axes, n_in: int, embedding: bool) -> tuple[np.ndarray, np.ndarray]:
    """One layer's (A, B) as PEFT's (lora_A, lora_B)."""
    if embedding:
        return a.T, b.T
    out_group, in_group = axes
    lora_a = a.transpose([n_in, *in_group]).reshape(a.shape[-1], -1)
    lora_b = b.transpose([k - n_in + 1 for k in out_group] + [0]).reshape(-1, b.shape[0])
    return lora_a, lora_b


def _from_peft(lora_a: np.ndarray, lora_b: np.ndarray, a_shape, b_shape, axes: Axes, n_in: int, embedding: bool):
    """PEFT's (lora_A, lora_B) as one layer's (A, B) of shapes `a_shape`, `b_shape`."""
    if embedding:
        return lora_a.T, lora_b.T
    out_group, in_group = axes
    order_a = [n_in, *in_group]
    a = lora_a.reshape([a_shape[i] for i in order_a]).transpose(np.argsort(order_a))
    order_b = [k - n_in + 1 for k in out_group] + [0]
    b = lora_b.reshape([b_shape[i] for i in order_b]).transpose(np.argsort(order_b))
    return a, b


def _host(x: jax.Array) -> np.ndarray:
    """The whole of an adapter array on this host (adapters are small)."""
    return np.asarray(multihost_utils.process_allgather(x, tiled=True) if jax.process_count() > 1 else x)


def to_peft(model: nnx.Module, config: ModelConfig, lora: LoRAConfig, path, *, base: str | None = None) -> None:
    """Writes `model`'s adapters as a PEFT adapter directory `path` (every process calls it;
    process 0 writes). `base` is recorded as `base_model_name_or_path`.

    Raises:
        ValueError: DeepSeek-V3 MLP adapters, which `peft` would put on the routed experts.
    """
    mlp = sorted(set(lora.targets) & set(MLP_TARGETS)) if config.model_type == "deepseek_v3" else []
    if mlp:
        raise ValueError(f"lora.targets: {mlp} on DeepSeek-V3 cannot be written for peft, which takes these names "
                         "to mean the routed experts' fused projections (podtrain adapts the dense and shared-expert "
                         "MLPs): export the merged weights instead (podtrain export)")
    tensors, modules_adapted = {}, []
    for key, shape, adapter in _adapters(model):
        modules, axes, embedding = _names(config, key, shape)
        a, b = _host(adapter.a[...]), _host(adapter.b[...])
        layers = zip(a, b, strict=True) if a.ndim > adapter.n_in + 1 else [(a, b)]
        modules_adapted += modules
        for module, (layer_a, layer_b) in zip(modules, layers, strict=True):
            lora_a, lora_b = _to_peft(layer_a, layer_b, axes, adapter.n_in, embedding)
            stem = PREFIX + module
            names = (f"{stem}.lora_embedding_A", f"{stem}.lora_embedding_B") if embedding else \
                (f"{stem}.lora_A.weight", f"{stem}.lora_B.weight")
            tensors |= dict(zip(names, (np.ascontiguousarray(lora_a), np.ascontiguousarray(lora_b)), strict=True))
    if jax.process_index() != 0:
        return
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / ADAPTER_FILE), metadata={"format": "pt"})
    peft_config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank, "lora_alpha": lora.alpha,
                   "lora_dropout": 0.0, "target_modules": modules_adapted, "bias": "none",
                   "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "inference_mode": True,
                   "init_lora_weights": True, "base_model_name_or_path": base, "modules_to_save": None}
    (out / ADAPTER_CONFIG).write_text(json.dumps(peft_config, indent=2) + "\n")


def read_peft_config(path) -> LoRAConfig:
    """The LoRA settings of a PEFT adapter directory; ValueError naming the file and key for what
    podtrain does not run (another PEFT type, rsLoRA, DoRA, biases, per-module ranks)."""
    file = Path(path) / ADAPTER_CONFIG
    if not file.is_file():
        raise ValueError(f"{file}: not found; expected a PEFT adapter directory with {ADAPTER_CONFIG}")
    found = json.loads(file.read_text())
    unsupported = {"peft_type": found.get("peft_type") != "LORA", "bias": found.get("bias", "none") != "none",
                   **{key: bool(found.get(key)) for key in ("use_rslora", "use_dora", "rank_pattern", "alpha_pattern",
                                                             "modules_to_save", "layers_to_transform",
                                                             "target_parameters")}}
    for key, bad in unsupported.items():
        if bad:
            raise ValueError(f"{file}: {key}={found.get(key)!r} is not what podtrain runs (LoRA on modules, no "
                             "biases, one rank and alpha for every module, every layer, no rsLoRA or DoRA)")
    targets = found.get("target_modules") or []
    if isinstance(targets, str):
        raise ValueError(f"{file}: target_modules is a pattern ({targets!r}); podtrain reads a list of module names")
    return LoRAConfig(rank=int(found["r"]), alpha=float(found["lora_alpha"]),
                      targets=tuple(sorted({name.rsplit(".", 1)[-1] for name in targets})))


def load_peft(model: nnx.Module, config: ModelConfig, path) -> None:
    """Sets `model`'s adapters from the PEFT adapter directory `path`, each in its sharding; the
    adapters `model` has and the ones the files hold must be the same (ValueError listing both)."""
    file = Path(path) / ADAPTER_FILE
    if not file.is_file():
        raise ValueError(f"{file}: not found; expected a PEFT adapter directory with {ADAPTER_FILE}")
    tensors = load_file(str(file))
    used = set()
    for key, shape, adapter in _adapters(model):
        modules, axes, embedding = _names(config, key, shape)
        layers_a, layers_b = [], []
        for module in modules:
            stem = PREFIX + module
            names = (f"{stem}.lora_embedding_A", f"{stem}.lora_embedding_B") if embedding else \
                (f"{stem}.lora_A.weight", f"{stem}.lora_B.weight")
            missing = [n for n in names if n not in tensors]
            if missing:
                raise ValueError(f"{file}: no tensor {missing[0]} for the adapter of {key}")
            lead = adapter.a.ndim - adapter.n_in - 1  # the stack's leading axes
            a, b = _from_peft(tensors[names[0]], tensors[names[1]], adapter.a.shape[lead:], adapter.b.shape[lead:],
                              axes, adapter.n_in, embedding)
            layers_a.append(a)
            layers_b.append(b)
            used.update(names)
        stacked = adapter.a.ndim > adapter.n_in + 1
        for param, values in ((adapter.a, layers_a), (adapter.b, layers_b)):
            value = np.stack(values) if stacked else values[0]
            if value.shape != param.shape:
                raise ValueError(f"{file}: the adapter of {key} is {value.shape} in the file, {param.shape} here")
            param.set_value(jax.device_put(value.astype(param.dtype), param[...].sharding))
    # PEFT also saves the base weights of targeted embeddings (`...base_layer.weight`), not adapters.
    extra = sorted(name for name in set(tensors) - used if not name.endswith(".base_layer.weight"))
    if extra:
        raise ValueError(f"{file}: tensors for modules this model's lora.targets leave out: {extra[:3]}"
                         + (f" and {len(extra) - 3} more" if len(extra) > 3 else ""))
