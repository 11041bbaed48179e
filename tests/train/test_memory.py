"""Deterministic memory of compiled steps (XLA's `memory_analysis()`), one device.

Remat bounds what the backward pass keeps of the activations; the gradients themselves are as
large as the params whatever the policy. At the benchmark's shape (seq 256) the gradients are most
of what grows with depth, so there the depth and policy bounds are asserted on the forward +
backward program whose outputs are the gradients (its temp bytes are the activations and
scratch), and the full train step is checked to stay within that plus the gradient bytes. At a
long sequence (2048), where the activations full remat removes dominate, the two bounds (full
remat at most 1/4 of none, at most 25% growth from 8 to 32 layers) are asserted on the train step
itself.
"""

import jax
import pytest
from flax import nnx

from podtrain.models import causal_lm_loss
from podtrain.orchestrator.config.compose import load_config
from podtrain.orchestrator.train.build import build_training

# The benchmark shape: llama3-tiny's model, batch 8 x seq 256, one device; at 8 and 32 layers.
SHAPE = ["mesh.fsdp=1", "train.batch_size=8", "train.seq_len=256"]


def compiled_temp_bytes(layers: int, remat: str, shape: list[str] = SHAPE) -> dict:
    config = load_config("llama3-tiny", shape + [f"model.num_layers={layers}", f"model.remat={remat}"])
    training = build_training(config, devices=jax.devices()[:1])
    state, batch = training.abstract_state(), training.abstract_batch()

    def loss(params, batch):
        logits, _, _ = nnx.merge(training.graphdef, params)(batch["inputs"])
        return causal_lm_loss(logits, batch["targets"], batch["weights"])[0]

    grad_step = jax.jit(jax.value_and_grad(loss)).lower(state.params, batch).compile()
    train_step = training.step.lower(state, batch).compile()
    param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state.params))
    return {
        "grad": grad_step.memory_analysis().temp_size_in_bytes,
        "train": train_step.memory_analysis().temp_size_in_bytes,
        "param_bytes": param_bytes,
    }


@pytest.mark.slow
def test_full_remat_bounds_backward_memory():
    full_8, full_32, none_32 = (compiled_temp_bytes(8, "full"), compiled_temp_bytes(32, "full"),
                                compiled_temp_bytes(32, "none"))
    assert full_32["grad"] <= none_32["grad"] / 4, (full_32, none_32)
    # Per-layer remat keeps one residual (batch, seq, hidden) per layer and nothing else per layer.
    config = load_config("llama3-tiny", SHAPE)
    residual_bytes = config.train.batch_size * config.train.seq_len * config.model.hidden_size * 4
    assert full_32["grad"] - full_8["grad"] <= 1.05 * 24 * residual_bytes, (full_8, full_32)
    # The train step adds the gradients (one param-sized buffer) and the optimizer's scratch.
    assert full_32["train"] <= full_32["grad"] + 2 * full_32["param_bytes"], full_32
    assert full_32["train"] <= none_32["train"] / 4, (full_32, none_32)  # at most 1/4
    # The memory target for this step (32 layers, full remat, bench shape, one device).
    assert full_32["train"] <= 300 * 2**20, full_32


@pytest.mark.slow
def test_full_remat_train_step_flat_in_depth_at_long_sequence():
    """The two bounds on the whole train step (gradients and optimizer included), at seq 2048. At
    seq 256 the same step grows more with depth, mostly the gradients of every layer that
    global-norm clipping needs all at once (bench/RESULTS.md, `bench/memory_depth.py`)."""
    shape = ["mesh.fsdp=1", "train.batch_size=8", "train.seq_len=2048"]
    full_8, full_32, none_32 = (compiled_temp_bytes(8, "full", shape), compiled_temp_bytes(32, "full", shape),
                                compiled_temp_bytes(32, "none", shape))
    assert full_32["train"] <= none_32["train"] / 4, (full_32, none_32)
    assert full_32["train"] <= 1.25 * full_8["train"], (full_8, full_32)
