"""What the adapter-slot tests share: a model with adapter slots, single-adapter models to compare
it with, and the rows of a mixed batch."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx

from podtrain.models import ARCHITECTURES
from podtrain.models.lora import LoRAConfig, apply_lora, init_slot, set_slot
from podtrain.orchestrator.config.compose import load_config

# Every target a slot can hold on llama3-tiny (untied head): attention, MLP, embedding and head.
SLOT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "embed_tokens",
                "lm_head")
ALPHA = 16.0


def config_of(preset: str = "llama3-tiny"):
    return load_config(preset).model.replace(scan_layers=True)


def slotted(config, slots: int, max_rank: int, targets=SLOT_TARGETS):
    """The base model (seed 0) with `slots` empty adapter slots of rank up to `max_rank` on `targets`."""
    cls = ARCHITECTURES[config.model_type].model_class
    return apply_lora(cls(config, rngs=nnx.Rngs(0)), LoRAConfig(rank=max_rank, alpha=ALPHA, targets=targets),
                      slots=slots)


def alone(config, rank: int, targets, seed: int):
    """The base model with one new adapter of `rank` on `targets` (`apply_lora` with `seed`)."""
    cls = ARCHITECTURES[config.model_type].model_class
    return apply_lora(cls(config, rngs=nnx.Rngs(0)), LoRAConfig(rank=rank, alpha=ALPHA, targets=tuple(targets)),
                      seed)


def randomised(model, seed: int):
    """`model` with every adapter matrix drawn at random (in place): a trained adapter."""
    from podtrain.models.lora import Adapter

    rng = np.random.default_rng(seed)
    for _, module in nnx.iter_modules(model):
        if isinstance(module, Adapter):
            for p in (module.lora_a, module.lora_b):
                p.set_value(jnp.asarray(rng.normal(scale=0.05, size=p.shape), p.dtype))
    return model


def filled(config, slots: int, max_rank: int, chosen, targets=SLOT_TARGETS):
    """A slotted model (on `targets`) whose slot i holds `chosen[i]` = (rank, targets, seed) as a
    trained adapter (`randomised` with the seed), with those single-adapter models."""
    model, singles = slotted(config, slots, max_rank, targets), []
    for slot, (rank, targets, seed) in enumerate(chosen):
        init_slot(model, slot, rank, targets, seed)
        single = randomised(alone(config, rank, targets, seed), seed)
        set_slot(model, slot, single)
        singles.append(single)
    return model, singles


def row_arrays(index, ranks):
    """`lora.rows` arguments for rows on slots `index`, slot s of rank `ranks[s]`."""
    index = np.asarray(index, np.int32)
    rank = np.asarray(ranks, np.int32)[index]
    return jnp.asarray(index), jnp.asarray(ALPHA / rank, jnp.float32), jnp.asarray(rank)
