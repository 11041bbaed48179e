"""Params born sharded: the same params as on one device, and an init within its memory budget."""

import jax
import numpy as np
import pytest
from flax import nnx
from model_fixtures import QWEN, tokens

from podtrain.models import Llama
from podtrain.models.runner import only_layer
from podtrain.orchestrator.config.compose import load_config
from podtrain.orchestrator.placed.model import model_factory
from podtrain.orchestrator.plan.report import sharding_table
from podtrain.orchestrator.train.build import build_training
from podtrain.sharding import DEFAULT_RULES, build_mesh, create_sharded, use_rules
from podtrain.sharding.place import init_peak_bytes


@pytest.mark.parametrize(
    "preset, mesh", [("llama3-tiny", ["mesh.fsdp=4", "mesh.tp=2"]), ("qwen3-tiny", ["mesh.fsdp=8"])]
)
def test_params_are_born_sharded_within_budget(preset, mesh):
    """The compiled init holds at most 1.25x the sharded parameter bytes per device, at any time."""
    config = load_config(preset, mesh)
    training = build_training(config)
    param_bytes = sum(row["bytes_per_device"] for row in sharding_table(training))
    init = init_peak_bytes(model_factory(config.model), training.mesh, config.sharding.rules, layer_slice=only_layer)
    assert init["param_bytes"] == pytest.approx(param_bytes, rel=0.001)
    assert init["peak_bytes"] <= 1.25 * param_bytes, (init, param_bytes)


@pytest.mark.parametrize("sizes", [dict(fsdp=8), pytest.param(dict(fsdp=2, tp=2, ep=2), marks=pytest.mark.slow),
                                   pytest.param(dict(dp=2, fsdp=2, tp=2), marks=pytest.mark.slow)])
def test_sharded_model_equals_single_device(sizes):
    config = QWEN.replace(tie_word_embeddings=False, num_heads=4, num_kv_heads=2, vocab_size=96)
    # Born sharded layer by layer, or in one piece on one device: the same seed, the same params.
    reference = create_sharded(lambda: Llama(config, rngs=nnx.Rngs(4)), build_mesh({}, jax.devices()[:1]))
    ids = tokens(batch=8, seq=8, seed=4, vocab=96)
    mesh = build_mesh(sizes)
    sharded = create_sharded(lambda: Llama(config, rngs=nnx.Rngs(4)), mesh, layer_slice=only_layer)
    for (path, a), (_, b) in zip(nnx.to_flat_state(nnx.state(reference)), nnx.to_flat_state(nnx.state(sharded)),
                                 strict=True):
        np.testing.assert_allclose(a.get_value(), b.get_value(), rtol=1e-6, atol=1e-9, err_msg=str(path))
    with jax.set_mesh(mesh), use_rules(DEFAULT_RULES):
        logits = jax.jit(lambda m, x: m(x)[0])(sharded, ids)
    np.testing.assert_allclose(logits, reference(ids)[0], rtol=1e-5, atol=1e-5)
