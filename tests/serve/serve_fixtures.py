"""What the engine tests share: one small engine on llama3-tiny (built once per test module) and
single-adapter references read out of its slots."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from podtrain.models.lora_slots import slot_view
from podtrain.orchestrator.config.compose import load_config
from podtrain.orchestrator.serve.backend import Engine, serve_targets
from podtrain.orchestrator.serve.work import Datum

OVERRIDES = ["serve.max_adapters=4", "serve.max_rank=8", "serve.max_seq_len=64", "serve.max_rows=8",
             "model.max_position_embeddings=128"]
TARGETS = serve_targets("llama")
ADAM = {"learning_rate": 1e-2, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.01, "grad_clip_norm": 0.5}


def make_engine(preset: str = "llama3-tiny", devices=1, overrides=()):
    config = load_config(preset, [*OVERRIDES, f"serve.base_model={preset}", *overrides])
    return Engine(config, jax.devices()[:devices])


def single(engine: Engine, model_id: str) -> nnx.Module:
    """The adapter `model_id` alone on the base model (its slot's view)."""
    slot = engine.slots[model_id]
    return slot_view(engine.model, slot.index, slot.rank, engine.config.serve.lora_alpha, slot.targets)


def sft_datum(rng, length: int, vocab: int) -> Datum:
    tokens = rng.integers(0, vocab, length + 1).astype(np.int32)
    weights = (np.arange(length) >= length // 2).astype(np.float32)  # the second half only, as an SFT mask
    return Datum(tokens[:-1], {"target_tokens": tokens[1:], "weights": weights})


def reference_losses(model: nnx.Module, data) -> tuple[list[np.ndarray], float]:
    """Per datum its target logprobs, and the summed weighted cross-entropy, one row at a time."""
    lps, total = [], 0.0
    for datum in data:
        logits = model(jnp.asarray(datum.tokens)[None])[0][0].astype(jnp.float32)
        lp = np.asarray(jax.nn.log_softmax(logits))[np.arange(len(datum.tokens)), datum.inputs["target_tokens"]]
        lps.append(lp)
        total += float(-(lp * datum.inputs["weights"]).sum())
    return lps, total
