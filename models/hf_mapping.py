"""Hugging Face tensor names and layouts of each architecture's parameters (pure: no files, no devices).

A podtrain parameter is one array; its HF counterpart is one tensor (global parameters), one per
layer (stacked parameters, `model.layers.{l}.<name>`) or one per layer and expert (DeepSeek-V3's
routed experts, `model.layers.{l}.mlp.experts.{e}.<name>`), each a transposed and flattened view of
one slice of the array.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from podtrain.models.config import ModelConfig

# Per HF dimension, the axes of our (per-layer, per-expert) array that it flattens: wq (embed, heads,
# head_dim) is q_proj (heads*head_dim, embed), i.e. ((1, 2), (0,)).
Axes = tuple[tuple[int, ...], ...]
Table = Mapping[str, tuple[str, Axes]]

MATRIX, MATRIX_T, VECTOR = ((0,), (1,)), ((1,), (0,)), ((0,),)  # as is; transposed (nn.Linear's (out, in))
HEADS_IN, HEADS_OUT = ((1, 2), (0,)), ((2,), (0, 1))  # (embed, heads, head_dim) / (heads, head_dim, embed)
HEADS_VECTOR = ((0, 1),)  # (heads, head_dim)

# Tensors transformers itself skips: old per-layer RoPE buffers.
ROPE_BUFFERS = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")
LAYER_INDEX = re.compile(r"model\.layers\.(\d+)\.")


@dataclass(frozen=True)
class HFMapping:
    """How one architecture's parameters are named and laid out in HF checkpoints.

    Each table maps our parameter path (within a layer for `layer_tensors` and `expert_tensors`)
    to (HF tensor name, axes). `stacks` gives each layer stack the HF index of its first layer;
    in `expert_stack` the `expert_tensors` have one HF tensor per layer and expert.
    `trailing_layers` allows HF layers after the last one (DeepSeek-V3's multi-token-prediction
    modules, which are not part of the model).
    """

    global_tensors: Table
    layer_tensors: Table
    stacks: Mapping[str, Callable[[ModelConfig], int]]
    expert_tensors: Table = field(default_factory=dict)
    expert_stack: str | None = None
    trailing_layers: bool = False

    def names(self, key: str, config: ModelConfig, shape: tuple[int, ...]) -> tuple[np.ndarray, Axes]:
        """The HF tensor names of our parameter `key` (of `shape`) and its axes map.

        The names form an array over the stacked leading axes: () for a global tensor, (layers,)
        for a stacked one, (layers, experts) for expert weights.
        """
        stack, _, sub = key.partition(".")
        if stack not in self.stacks:
            name, axes = self.global_tensors[key]
            return np.array(name, dtype=object), axes
        first = self.stacks[stack](config)
        layers = range(first, first + shape[0])
        if stack == self.expert_stack and sub in self.expert_tensors:
            name, axes = self.expert_tensors[sub]
            names = [[f"model.layers.{i}.{name.format(e=e)}" for e in range(shape[1])] for i in layers]
            return np.array(names, dtype=object), axes
        name, axes = self.layer_tensors[sub]
        return np.array([f"model.layers.{i}.{name}" for i in layers], dtype=object), axes

    def skips(self, name: str, config: ModelConfig) -> bool:
        """Whether HF tensor `name` may stand in a checkpoint without being part of the model."""
        if ROPE_BUFFERS.fullmatch(name) or (config.tie_word_embeddings and name == "lm_head.weight"):
            return True
        layer = LAYER_INDEX.match(name)
        return self.trailing_layers and layer is not None and int(layer.group(1)) >= config.num_layers


def hf_shape(shape: tuple[int, ...], axes: Axes) -> tuple[int, ...]:
    """The shape of the HF tensor that holds a (per-layer) array of `shape`."""
    return tuple(math.prod(shape[a] for a in group) for group in axes)


def to_hf_layout(x: np.ndarray, axes: Axes) -> np.ndarray:
    """Our (per-layer) array `x` as its HF tensor."""
    order = [a for group in axes for a in group]
    return np.ascontiguousarray(x.transpose(order).reshape(hf_shape(x.shape, axes)))


def from_hf_block(tensor, shape: tuple[int, ...], axes: Axes, index: tuple[slice, ...]) -> np.ndarray:
    """Block `index` of our array of `shape` from its HF tensor, reading only the rows it needs.

    `tensor` is anything that numpy-slices (a lazy safetensors slice reads only what is asked).
    Each HF dimension is read over the range its outermost axis needs (a contiguous run); the
    inner axes it flattens are sliced after the reshape.
    """
    hf_index, block_shape = [], []
    for group in axes:
        rows = range(shape[group[0]])[index[group[0]]]
        inner = [shape[a] for a in group[1:]]
        hf_index.append(slice(rows.start * math.prod(inner), rows.stop * math.prod(inner)))
        block_shape += [len(rows), *inner]
    order = [a for group in axes for a in group]
    block = tensor[tuple(hf_index)].reshape(block_shape).transpose(np.argsort(order))
    outer = {group[0] for group in axes}
    return block[tuple(slice(None) if a in outer else index[a] for a in range(len(shape)))]


SHARED_GLOBALS = {
    "embed": ("model.embed_tokens.weight", MATRIX),
    "final_norm.scale": ("model.norm.weight", VECTOR),
    "lm_head": ("lm_head.weight", MATRIX_T),
}
LAYER_NORMS = {
    "input_norm.scale": ("input_layernorm.weight", VECTOR),
    "post_attn_norm.scale": ("post_attention_layernorm.weight", VECTOR),
}
DENSE_MLP = {
    "mlp.w_gate": ("mlp.gate_proj.weight", MATRIX_T),
    "mlp.w_up": ("mlp.up_proj.weight", MATRIX_T),
    "mlp.w_down": ("mlp.down_proj.weight", MATRIX_T),
}

LLAMA3 = HFMapping(
    global_tensors=SHARED_GLOBALS,
    layer_tensors={
        **LAYER_NORMS, **DENSE_MLP,
        "attn.wq": ("self_attn.q_proj.weight", HEADS_IN),
        "attn.wk": ("self_attn.k_proj.weight", HEADS_IN),
        "attn.wv": ("self_attn.v_proj.weight", HEADS_IN),
        "attn.wo": ("self_attn.o_proj.weight", HEADS_OUT),
        "attn.bq": ("self_attn.q_proj.bias", HEADS_VECTOR),
        "attn.bk": ("self_attn.k_proj.bias", HEADS_VECTOR),
        "attn.bv": ("self_attn.v_proj.bias", HEADS_VECTOR),
        "attn.bo": ("self_attn.o_proj.bias", VECTOR),
        "mlp.b_gate": ("mlp.gate_proj.bias", VECTOR),
        "mlp.b_up": ("mlp.up_proj.bias", VECTOR),
        "mlp.b_down": ("mlp.down_proj.bias", VECTOR),
    },
    stacks={"layers": lambda c: 0},
)

QWEN3 = HFMapping(
    global_tensors=SHARED_GLOBALS,
    layer_tensors={
        **LLAMA3.layer_tensors,
        "attn.q_norm.scale": ("self_attn.q_norm.weight", VECTOR),
        "attn.k_norm.scale": ("self_attn.k_norm.weight", VECTOR),
    },
    stacks=LLAMA3.stacks,
)

# Latent attention in every layer, the dense MLP in the first `first_k_dense_replace` layers and the
# router, shared and routed experts in the rest; `attn.wq` is the direct query projection of a model
# without query compression (`q_lora_rank=0`).
DEEPSEEK_V3 = HFMapping(
    global_tensors=SHARED_GLOBALS,
    layer_tensors={
        **LAYER_NORMS, **DENSE_MLP,
        "attn.wq": ("self_attn.q_proj.weight", HEADS_IN),
        "attn.wq_a": ("self_attn.q_a_proj.weight", MATRIX_T),
        "attn.q_norm.scale": ("self_attn.q_a_layernorm.weight", VECTOR),
        "attn.wq_b": ("self_attn.q_b_proj.weight", HEADS_IN),
        "attn.wkv_a": ("self_attn.kv_a_proj_with_mqa.weight", MATRIX_T),
        "attn.kv_norm.scale": ("self_attn.kv_a_layernorm.weight", VECTOR),
        "attn.wkv_b": ("self_attn.kv_b_proj.weight", HEADS_IN),
        "attn.wo": ("self_attn.o_proj.weight", HEADS_OUT),
        "mlp.router": ("mlp.gate.weight", MATRIX_T),
        "mlp.router_bias": ("mlp.gate.e_score_correction_bias", VECTOR),
        "mlp.shared.w_gate": ("mlp.shared_experts.gate_proj.weight", MATRIX_T),
        "mlp.shared.w_up": ("mlp.shared_experts.up_proj.weight", MATRIX_T),
        "mlp.shared.w_down": ("mlp.shared_experts.down_proj.weight", MATRIX_T),
    },
    stacks={"dense_layers": lambda c: 0, "moe_layers": lambda c: c.num_dense_layers},
    expert_tensors={
        "mlp.w_gate": ("mlp.experts.{e}.gate_proj.weight", MATRIX_T),
        "mlp.w_up": ("mlp.experts.{e}.up_proj.weight", MATRIX_T),
        "mlp.w_down": ("mlp.experts.{e}.down_proj.weight", MATRIX_T),
    },
    expert_stack="moe_layers",
    trailing_layers=True,
)
