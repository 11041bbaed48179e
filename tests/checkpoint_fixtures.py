"""What the checkpoint tests share: a tiny run on fsdp=4 x tp=2, random states, bit-exact comparison."""

from pathlib import Path

import jax
import numpy as np
import pytest

from podtrain.orchestrator.checkpoint.checkpointer import Checkpointer
from podtrain.orchestrator.config.compose import load_config
from podtrain.orchestrator.config.schema import CheckpointConfig
from podtrain.orchestrator.train.build import build_training

# A restore that fails part way leaves tensorstore reads in flight; they complete on tensorstore's threads after
# Orbax closed its event loop, which Python reports as an unraisable "Event loop is closed" (harmless).
EVENT_LOOP_CLOSED = pytest.mark.filterwarnings(
    "ignore:(?s)Exception ignored in.*Event loop is closed:pytest.PytestUnraisableExceptionWarning"
)

CHECKPOINT_LOGGER = "podtrain.orchestrator.checkpoint.checkpointer"
TINY = ["model.num_layers=2", "model.hidden_size=64", "model.intermediate_size=128", "model.vocab_size=256",
        "model.head_dim=16", "model.num_heads=4", "model.num_kv_heads=2", "train.batch_size=8", "train.seq_len=16"]


def tiny_training():
    """fsdp=4 x tp=2 on the 8 fake devices."""
    return build_training(load_config("llama3-tiny", TINY + ["mesh.fsdp=4", "mesh.tp=2"]))


def random_state(training, seed):
    """Random values in every leaf, placed with the state's shardings, without compiling the model's init.

    Non-negative floats keep Adam's second moments valid, so the state also trains.
    """
    rng = np.random.default_rng(seed)

    def leaf(abstract):
        if np.issubdtype(abstract.dtype, np.integer):
            value = np.zeros(abstract.shape, abstract.dtype)
        else:
            value = (0.02 * np.abs(rng.standard_normal(abstract.shape))).astype(abstract.dtype)
        return jax.make_array_from_callback(abstract.shape, abstract.sharding, lambda index: value[index])

    return jax.tree.map(leaf, training.abstract_state())


def assert_bit_equal(actual, expected):
    actual_leaves, actual_tree = jax.tree.flatten(actual)
    expected_leaves, expected_tree = jax.tree.flatten(expected)
    assert actual_tree == expected_tree
    for a, e in zip(actual_leaves, expected_leaves, strict=True):
        assert a.dtype == e.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(e), strict=True)


def checkpointer(path, **changes):
    return Checkpointer(path, CheckpointConfig(**{"every_steps": 2, "keep": 5} | changes))


def files(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}
