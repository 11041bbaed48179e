"""Expert-parallel dispatch: exact against a per-token reference on every mesh, capacity drops
counted, per-device FLOPs shrinking with EP, and the router-bias balancing of the train step."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from podtrain.models.moe import MoE, balance_router_bias, route
from podtrain.orchestrator.build import build_training
from podtrain.orchestrator.config import ConfigError, load_config, validate
from podtrain.orchestrator.synthetic import random_batch
from podtrain.sharding.experts import capacity, routed_experts
from podtrain.sharding.mesh import build_mesh
from podtrain.sharding.place import create_sharded
from podtrain.sharding.rules import DEFAULT_RULES, logical_to_spec, use_rules

TINY = load_config("deepseek-v3-tiny").model
E, K, D, F = TINY.moe.num_experts, TINY.moe.num_experts_per_tok, TINY.hidden_size, TINY.moe.moe_intermediate_size
MESHES = {
    "ep1": {}, "ep2": {"ep": 2}, "ep4": {"ep": 4}, "ep2_fsdp2": {"ep": 2, "fsdp": 2}, "ep2_tp2": {"ep": 2, "tp": 2},
    "dp2_ep2_tp2": {"dp": 2, "ep": 2, "tp": 2},
}


def _mesh(sizes: dict):
    sizes = {"fsdp": 1, **sizes}
    return build_mesh(sizes, jax.devices()[: int(np.prod(list(sizes.values())))])


def _inputs(batch=8, seq=6, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(batch, seq, D)).astype(np.float32)
    experts = np.stack([rng.permutation(E)[:K] for _ in range(batch * seq)]).reshape(batch, seq, K).astype(np.int32)
    weights = rng.uniform(0.1, 1.0, size=(batch, seq, K)).astype(np.float32)
    w = [rng.normal(scale=0.2, size=s).astype(np.float32) for s in ((E, D, F), (E, D, F), (E, F, D))]
    return x, experts, weights, w


def _reference(x, experts, weights, w, *, shards: int, slots: int):
    """Per token and choice, in float64; a choice beyond the first `slots` of its expert within
    its shard (tokens in order, the batch split into `shards` contiguous row blocks) is dropped."""
    gate, up, down = (a.astype(np.float64) for a in w)
    b, t, _ = x.shape
    y = np.zeros(x.shape)
    dropped = 0
    for shard in range(shards):
        used = np.zeros(E, int)
        for i in range(shard * b // shards, (shard + 1) * b // shards):
            for j in range(t):
                for k in range(K):
                    e = experts[i, j, k]
                    used[e] += 1
                    if used[e] > slots:
                        dropped += 1
                        continue
                    h = x[i, j].astype(np.float64)
                    act = (h @ gate[e]) / (1 + np.exp(-(h @ gate[e]))) * (h @ up[e])
                    y[i, j] += weights[i, j, k] * (act @ down[e])
    return y, dropped


@pytest.mark.parametrize("mesh_name", list(MESHES))
@pytest.mark.parametrize("capacity_factor", [0.0, 0.5])
def test_dispatch_equals_the_per_token_reference(mesh_name, capacity_factor):
    x, experts, weights, w = _inputs()
    mesh = _mesh(MESHES[mesh_name])
    shards = mesh.shape["dp"] * mesh.shape["fsdp"] * mesh.shape["ep"]
    b, t = experts.shape[:2]
    slots = capacity(b * t // shards, K, E, capacity_factor)
    want, want_dropped = _reference(x, experts, weights, w, shards=shards, slots=slots)
    assert (want_dropped > 0) == (capacity_factor > 0)

    def place(a, names):
        spec = logical_to_spec(names, dict(mesh.shape), shape=a.shape, rules=DEFAULT_RULES)
        return jax.device_put(a, NamedSharding(mesh, spec))

    tokens = ("batch", "seq", None)
    args = [place(x, tokens), place(experts, tokens), place(weights, tokens),
            place(w[0], ("experts", "embed", "mlp")), place(w[1], ("experts", "embed", "mlp")),
            place(w[2], ("experts", "mlp", "embed"))]
    with jax.set_mesh(mesh), use_rules(DEFAULT_RULES):
        y, load, dropped = jax.jit(lambda *a: routed_experts(*a, capacity_factor=capacity_factor))(*args)
    np.testing.assert_allclose(np.asarray(y), want, rtol=0, atol=2e-5)
    np.testing.assert_array_equal(np.asarray(load), np.bincount(experts.reshape(-1), minlength=E))
    assert float(dropped) == want_dropped


@pytest.mark.parametrize("mesh_name, rules", [
    ("ep2_fsdp2", {"mlp": "fsdp", "embed": None}),  # the expert hidden dim over a batch axis
    ("ep2_tp2", {"seq": "tp"}),  # tokens over tp too (sequence parallel), the hidden dim over tp
])
def test_dispatch_with_the_expert_hidden_dim_over_a_token_axis_equals_the_reference(mesh_name, rules):
    """Devices along such an axis hold different tokens: their partial results must not be summed."""
    x, experts, weights, w = _inputs()
    mesh, rules = _mesh(MESHES[mesh_name]), DEFAULT_RULES | rules
    want, _ = _reference(x, experts, weights, w, shards=1, slots=x.shape[0] * x.shape[1])  # dropless

    def place(a, names):
        return jax.device_put(a, NamedSharding(mesh, logical_to_spec(names, dict(mesh.shape), shape=a.shape,
                                                                     rules=rules)))

    tokens = ("batch", "seq", None)
    args = [place(x, tokens), place(experts, tokens), place(weights, tokens),
            place(w[0], ("experts", "embed", "mlp")), place(w[1], ("experts", "embed", "mlp")),
            place(w[2], ("experts", "mlp", "embed"))]
    with jax.set_mesh(mesh), use_rules(rules):
        y, load, _ = jax.jit(routed_experts)(*args)
    np.testing.assert_allclose(np.asarray(y), want, rtol=0, atol=2e-5)
    np.testing.assert_array_equal(np.asarray(load), np.bincount(experts.reshape(-1), minlength=E))


@pytest.mark.parametrize("mesh_name", ["ep2", "ep2_fsdp2", "dp2_ep2_tp2"])
@pytest.mark.parametrize("batch, seq", [(1, 1), (1, 6), (3, 1)])
def test_dispatch_of_a_batch_the_token_axes_do_not_divide_equals_the_reference(mesh_name, batch, seq):
    """One prompt (or one decode step) on an EP mesh: padding rows pick no expert and are dropped."""
    x, experts, weights, w = _inputs(batch=batch, seq=seq)
    mesh = _mesh(MESHES[mesh_name])
    want, _ = _reference(x, experts, weights, w, shards=1, slots=batch * seq)  # dropless
    with jax.set_mesh(mesh), use_rules(DEFAULT_RULES):
        y, load, dropped = jax.jit(routed_experts)(x, experts, weights, *w)
    assert y.shape == x.shape
    np.testing.assert_allclose(np.asarray(y), want, rtol=0, atol=2e-5)
    np.testing.assert_array_equal(np.asarray(load), np.bincount(experts.reshape(-1), minlength=E))
    assert float(dropped) == 0


def test_routing_is_group_limited_and_weighted_as_configured():
    moe = TINY.moe
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(2, 16, D)), jnp.float32)
    router = jnp.asarray(rng.normal(scale=0.3, size=(D, E)), jnp.float32)
    bias = jnp.asarray(rng.normal(scale=0.3, size=(E,)), jnp.float32)
    weights, experts = route(x, router, bias, moe)
    scores = 1 / (1 + np.exp(-(np.asarray(x) @ np.asarray(router))))
    choice = (scores + np.asarray(bias)).reshape(2, 16, moe.n_group, -1)
    group_scores = np.sort(choice, -1)[..., -2:].sum(-1)
    best = np.argsort(-group_scores, -1)[..., : moe.topk_group]
    for i in range(2):
        for j in range(16):
            allowed = {g * (E // moe.n_group) + e for g in best[i, j] for e in range(E // moe.n_group)}
            assert set(np.asarray(experts[i, j]).tolist()) <= allowed
            masked = np.where([e in allowed for e in range(E)], choice[i, j].reshape(-1), -np.inf)
            assert set(np.asarray(experts[i, j]).tolist()) == set(np.argsort(-masked)[:K].tolist())
            picked = scores[i, j, np.asarray(experts[i, j])]
            np.testing.assert_allclose(np.asarray(weights[i, j]), picked / picked.sum() * moe.routed_scaling_factor,
                                       rtol=1e-5)


def _moe_flops(config, ep: int) -> float:
    """FLOPs of one device's forward and backward pass of a MoE layer over 8 x 128 tokens."""
    mesh = _mesh({"ep": ep})
    layer = create_sharded(lambda: MoE(config, rngs=nnx.Rngs(0)), mesh)
    graphdef, state = nnx.split(layer)
    spec = PartitionSpec("ep") if ep > 1 else PartitionSpec()
    x = jax.ShapeDtypeStruct((8, 128, D), jnp.float32, sharding=NamedSharding(mesh, spec))

    def loss(state, x):
        return nnx.merge(graphdef, state)(x)[0].sum()

    with jax.set_mesh(mesh), use_rules(DEFAULT_RULES):
        compiled = jax.jit(jax.grad(loss)).lower(state, x).compile()
    return compiled.cost_analysis()["flops"]


@pytest.mark.parametrize("capacity_factor", [0.0, 1.25])
def test_per_device_moe_flops_at_ep4_are_at_most_035_of_ep1(capacity_factor):
    """From the compiled programs: each of 4 EP ranks computes only its experts' tokens."""
    config = TINY.replace(moe=dataclasses.replace(TINY.moe, capacity_factor=capacity_factor))
    one, four = _moe_flops(config, 1), _moe_flops(config, 4)
    assert four <= 0.35 * one, (four, one)


def test_bias_balancing_moves_the_router_bias_towards_the_mean_load():
    config = load_config("deepseek-v3-tiny", ["train.seq_len=16", "mesh.fsdp=1", "mesh.ep=2", "model.num_layers=2"])
    training = build_training(config, jax.devices()[:2])
    state = training.init_state()
    before = np.asarray(state.params["moe_layers"]["mlp"]["router_bias"].get_value())
    state, metrics = training.step(state, random_batch(training))
    load = np.asarray(metrics["expert_load"])
    assert load.shape == (config.model.num_moe_layers, E)
    np.testing.assert_array_equal(load.sum(-1), config.train.batch_size * config.train.seq_len * K)
    after = np.asarray(state.params["moe_layers"]["mlp"]["router_bias"].get_value())
    np.testing.assert_allclose(after, np.asarray(balance_router_bias(before, load, config.model.moe.bias_update_rate)),
                               rtol=0, atol=1e-7)
    assert float(metrics["dropped_tokens"]) == 0.0


def test_experts_must_be_sharded_over_a_token_axis():
    config = load_config("deepseek-v3-tiny", ["mesh.fsdp=1", "mesh.ep=2", "sharding.rules.batch=[dp,fsdp]"])
    with pytest.raises(ConfigError, match=r"experts are sharded over \['ep'\]; expected one mesh axis that the tokens"):
        validate(config, 2)


def test_experts_must_divide_over_ep():
    config = load_config("deepseek-v3-tiny", ["mesh.fsdp=1", "mesh.ep=16", "train.batch_size=16"])
    with pytest.raises(ConfigError, match=r"model.moe.num_experts=8 is not divisible by the 16 expert shards"):
        validate(config, 16)
