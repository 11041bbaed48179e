"""What the engine tests share: one small engine on llama3-tiny (built once per test module) and
single-adapter references read out of its slots."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from podtrain.models.lora import slot_view
from podtrain.orchestrator.config.compose import load_config
from podtrain.orchestrator.serve.checks import serve_targets
from podtrain.orchestrator.serve.engine import Engine
from podtrain.orchestrator.serve.work import Datum

# A loss chunk of 8 positions: rows of 16 to 64 tokens apply the head in 2 to 8 vocabulary slices,
# which the references (the whole logits of one adapter) check.
# Nothing compiled ahead (`serve.compile_ahead`) but where a test asks: CI has two cores.
OVERRIDES = ["serve.max_adapters=4", "serve.max_rank=8", "serve.max_seq_len=64", "serve.max_rows=8",
             "model.max_position_embeddings=128", "serve.loss_chunk=8", "serve.compile_ahead=false"]
TARGETS = serve_targets("llama")
ADAM = {"learning_rate": 1e-2, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.01, "grad_clip_norm": 0.5}


def make_engine(preset: str = "llama3-tiny", devices=1, overrides=(), page_dir=None):
    given = {o.split("=", 1)[0] for o in overrides}
    defaults = [o for o in OVERRIDES if o.split("=", 1)[0] not in given]
    config = load_config(preset, [*defaults, f"serve.base_model={preset}", *overrides])
    return Engine(config, jax.devices()[:devices], page_dir=page_dir)


def single(engine: Engine, model_id: str) -> nnx.Module:
    """The adapter `model_id` alone on the base model (its slot's view)."""
    slot = engine.loaded[model_id]
    return slot_view(engine.model, slot.index, slot.rank, engine.config.serve.lora_alpha, slot.targets)


def sft_datum(rng, length: int, vocab: int) -> Datum:
    tokens = rng.integers(0, vocab, length + 1).astype(np.int32)
    weights = (np.arange(length) >= length // 2).astype(np.float32)  # the second half only, as an SFT mask
    return Datum(tokens[:-1], {"target_tokens": tokens[1:], "weights": weights})


def padded(data, rows: int = 8, length: int = 64):
    """The data as right-padded (rows, length) arrays: tokens, targets and weights (0 on padding)."""
    tokens, targets, weights = (np.zeros((rows, length), dtype) for dtype in (np.int32, np.int32, np.float32))
    for r, datum in enumerate(data):
        n = len(datum.tokens)
        tokens[r, :n], targets[r, :n] = datum.tokens, datum.inputs["target_tokens"]
        weights[r, :n] = datum.inputs["weights"]
    return jnp.asarray(tokens), jnp.asarray(targets), jnp.asarray(weights)


@jax.jit
def target_logprobs(model: nnx.Module, tokens, targets):
    """Each position's log-probability of its target (a causal model: right padding changes nothing
    before it)."""
    logits = model(tokens)[0].astype(jnp.float32)
    return jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], axis=-1)[..., 0]


def reference_loss(model: nnx.Module, tokens, targets, weights):
    """The summed weighted cross-entropy of padded rows."""
    return -jnp.sum(target_logprobs(model, tokens, targets) * weights)


def reference_losses(model: nnx.Module, data) -> tuple[list[np.ndarray], float]:
    """Per datum its target logprobs, and the summed weighted cross-entropy, on the model alone."""
    tokens, targets, weights = padded(data)
    lp = np.asarray(target_logprobs(model, tokens, targets))
    lps = [lp[r, :len(datum.tokens)] for r, datum in enumerate(data)]
    return lps, float(sum(-(row * datum.inputs["weights"]).sum() for row, datum in zip(lps, data, strict=True)))
