"""The DeepSeek-V3 model end to end: expert-parallel meshes and remat policies against one device,
token dropping against transformers' dropless logits, on a tiny checkpoint of hf_fixtures."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hf_fixtures import hf_logits, save_hf_model

from podtrain.models import DeepseekV3, ModelConfig, causal_lm_loss, from_hf
from podtrain.orchestrator.config.compose import load_config
from podtrain.sharding.mesh import build_mesh
from podtrain.sharding.rules import DEFAULT_RULES, use_rules

# name -> (mesh sizes, devices). The batch (4) divides every mesh's batch axes (dp * fsdp * ep).
MESHES = {"ep2": ({"ep": 2}, 2), "ep4": ({"ep": 4}, 4), "ep2_fsdp2": ({"ep": 2, "fsdp": 2}, 4)}
BATCH, SEQ = 4, 12


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(directory, transformers model) of the tiny deepseek_v3_plain: MoE in every layer (8 experts,
    top-2, shared experts), so one layer stack, which compiles in half the time of deepseek_v3's two
    (whose maths test_hf checks against transformers, on one device and on a mesh)."""
    path = tmp_path_factory.mktemp("deepseek_v3_plain")
    return path, save_hf_model("deepseek_v3_plain", path)


def _tokens(vocab_size: int, seq: int = SEQ) -> np.ndarray:
    return np.random.default_rng(0).integers(0, vocab_size, (BATCH, seq)).astype(np.int32)


def _mesh(name: str | None):
    if name is None:
        return None
    sizes, devices = MESHES[name]
    return build_mesh(sizes, jax.devices()[:devices])


def _with_config(model: DeepseekV3, config: ModelConfig) -> DeepseekV3:
    """`model`'s parameters (and placement) under `config` (remat, capacity factor)."""
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: DeepseekV3(config, rngs=nnx.Rngs(0))))
    return nnx.merge(graphdef, nnx.state(model))


def _on_mesh(mesh, fn, *args):
    if mesh is None:
        return fn(*args)
    with jax.set_mesh(mesh), use_rules(DEFAULT_RULES):
        return fn(*args)


@functools.cache
def _loss_logits_grads(path, mesh_name: str | None, remat: str):
    """(loss, logits, grads) as numpy, of the checkpoint at `path` placed on mesh `mesh_name`.

    Cached: the one-device and remat="none" results are each test's reference.
    """
    mesh = _mesh(mesh_name)
    config, model = from_hf(path, mesh=mesh)
    model = _with_config(model, config.replace(remat=remat))
    if mesh is not None:  # the experts really are split over ep (and dispatched by all-to-all)
        assert model.moe_layers.mlp.w_gate[...].sharding.spec[1] == "ep"
    ids = jnp.asarray(_tokens(config.vocab_size, SEQ + 1))
    graphdef, params = nnx.split(model)

    def loss(params):
        logits, _, _ = nnx.merge(graphdef, params)(ids[:, :-1])
        return causal_lm_loss(logits, ids[:, 1:])[0], logits

    (value, logits), grads = _on_mesh(mesh, jax.jit(jax.value_and_grad(loss, has_aux=True)), params)
    return np.asarray(value), np.asarray(logits), jax.tree.map(np.asarray, grads)


def _assert_grads_equal(grads, reference, what: str) -> None:
    flat, expected = nnx.to_flat_state(grads), dict(nnx.to_flat_state(reference))
    for path, g in flat:
        np.testing.assert_allclose(g.get_value(), expected[path].get_value(), rtol=1e-5, atol=1e-7,
                                   err_msg=f"{what}: {path}")


@pytest.mark.parametrize("mesh_name", ["ep2", *(pytest.param(name, marks=pytest.mark.slow) for name in MESHES
                                                if name != "ep2")])
def test_expert_parallel_meshes_equal_one_device(checkpoint, mesh_name):
    path, _ = checkpoint
    loss, logits, grads = _loss_logits_grads(path, mesh_name, "none")
    ref_loss, ref_logits, ref_grads = _loss_logits_grads(path, None, "none")
    np.testing.assert_allclose(logits, ref_logits, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    _assert_grads_equal(grads, ref_grads, mesh_name)


@pytest.mark.parametrize("remat", ["full", "dots"])
def test_remat_policies_give_equal_loss_and_gradients(checkpoint, remat):
    # On a mesh, so that the recomputed layers include the all-to-all dispatch.
    path, _ = checkpoint
    loss, _, grads = _loss_logits_grads(path, "ep2", remat)
    ref_loss, _, ref_grads = _loss_logits_grads(path, "ep2", "none")
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    _assert_grads_equal(grads, ref_grads, remat)


def test_capacity_factor_drops_tokens_and_reports_them(checkpoint):
    path, hf_model = checkpoint
    config, model = from_hf(path)
    ids = _tokens(config.vocab_size)
    forward = jax.jit(lambda m, x: m(x)[::2])
    tokens, k, experts = BATCH * SEQ, config.moe.num_experts_per_tok, config.moe.num_experts

    dropless, stats = forward(model, ids)
    np.testing.assert_allclose(np.asarray(dropless), hf_logits(hf_model, ids), rtol=0, atol=1e-4)
    np.testing.assert_array_equal(stats["dropped_tokens"], np.zeros(config.num_moe_layers))

    factor = 0.5
    capped = _with_config(model, config.replace(moe=dataclasses.replace(config.moe, capacity_factor=factor)))
    logits, capped_stats = forward(capped, ids)
    load, dropped = np.asarray(capped_stats["expert_load"]), np.asarray(capped_stats["dropped_tokens"])
    assert load.shape == (config.num_moe_layers, experts)
    np.testing.assert_array_equal(load.sum(-1), np.full(config.num_moe_layers, tokens * k))
    # The first MoE layer sees the same hidden states either way; drops change what the next sees.
    np.testing.assert_array_equal(load[0], stats["expert_load"][0])
    slots = math.ceil(factor * tokens * k / experts)  # per expert, on one device
    np.testing.assert_array_equal(dropped, np.maximum(load - slots, 0).sum(-1))
    assert np.all(dropped > 0)
    assert not np.allclose(np.asarray(logits), np.asarray(dropless), atol=1e-4)


@pytest.mark.slow
def test_cached_decode_of_both_stacks_equals_the_full_forward():
    """Prefill then token-by-token decode through the dense and the MoE stack's cache pairs; the
    cache holds MLA's latent and rotary key, `kv_lora_rank + qk_rope_head_dim` values per token."""
    config = load_config("deepseek-v3-tiny", ["model.num_layers=2"]).model
    model = DeepseekV3(config, rngs=nnx.Rngs(0))
    ids = jnp.asarray(_tokens(config.vocab_size, 10))
    full = np.asarray(jax.jit(lambda m, ids: m(ids)[0])(model, ids))
    cache = model.init_cache(batch=BATCH, max_len=16)
    step = jax.jit(lambda m, ids, cache: m(ids, cache=cache)[:2])
    assert [k.shape for k in cache.k] == [(1, BATCH, 16, 1, 32)] * 2
    assert cache.bytes_per_token() == 2 * (32 + 16) * 4
    logits, cache = step(model, ids[:, :6], cache)
    steps = [np.asarray(logits)]
    for t in range(6, 10):
        logits, cache = step(model, ids[:, t:t + 1], cache)
        steps.append(np.asarray(logits))
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full, rtol=0, atol=2e-5)
