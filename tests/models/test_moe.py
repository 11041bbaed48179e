"""Expert-parallel dispatch: exact against a per-token reference on every mesh, capacity drops
counted, per-device FLOPs shrinking with EP, and the router-bias balancing of the train step."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding

from podtrain.models.kernels.exchange import resolve_exchange
from podtrain.models.kernels.grouped_matmul import resolve_grouped_matmul
from podtrain.models.lora import AdaptedExperts, LoRAConfig, LoRAParam, apply_lora, rows
from podtrain.models.moe import MoE, balance_router_bias, dispatch, dropless, route
from podtrain.models.moe.dispatch import capacity
from podtrain.models.moe.dropless import Kernels, buffer_rows
from podtrain.models.moe.experts import EXPERT_DOWN_NAMES, EXPERT_GATE_NAMES, SwiGLUExperts
from podtrain.orchestrator.common.errors import ConfigError
from podtrain.orchestrator.config.compose import load_config
from podtrain.orchestrator.config.validate import validate
from podtrain.orchestrator.train.build import build_training
from podtrain.orchestrator.train.synthetic import random_batch
from podtrain.sharding.mesh import build_mesh
from podtrain.sharding.place import abstract_model
from podtrain.sharding.rules import DEFAULT_RULES, logical_to_spec, use_rules

TINY = load_config("deepseek-v3-tiny").model
E, K, D, F = TINY.moe.num_experts, TINY.moe.num_experts_per_tok, TINY.hidden_size, TINY.moe.moe_intermediate_size
MESHES = {
    "ep1": {}, "ep2": {"ep": 2}, "ep4": {"ep": 4}, "ep2_fsdp2": {"ep": 2, "fsdp": 2}, "ep2_tp2": {"ep": 2, "tp": 2},
    "dp2_ep2_tp2": {"dp": 2, "ep": 2, "tp": 2},
}


def routed_experts(x, expert, weight, gate, up, down, *, experts=None, capacity_factor=0.0, buffer_factor=1.25):
    """The dispatch of SwiGLU experts `gate, up, down` (or of `experts`) with the kernels of CPU devices."""
    experts = SwiGLUExperts(gate, up, down) if experts is None else experts
    return dispatch.routed_experts(x, expert, weight, experts, capacity_factor=capacity_factor,
                                   buffer_factor=buffer_factor, kernels=Kernels(exchange="all_to_all"))


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


def _reference_grads(x, experts, weights, w, cotangent):
    """d sum(y * cotangent) / d (x, weights, w_gate, w_up, w_down), dropless, in float64 by hand."""
    gate, up, down = (a.astype(np.float64) for a in w)
    grads = [np.zeros(a.shape) for a in (x, weights, gate, up, down)]
    dx, dweights, dgate, dup, ddown = grads
    for i, j, k in np.ndindex(experts.shape):
        e, h, c = experts[i, j, k], x[i, j].astype(np.float64), cotangent[i, j].astype(np.float64)
        a, u = h @ gate[e], h @ up[e]
        s = 1 / (1 + np.exp(-a))
        act = a * s * u
        dweights[i, j, k] = c @ (act @ down[e])
        d_act = (weights[i, j, k] * c) @ down[e].T
        ddown[e] += np.outer(act, weights[i, j, k] * c)
        d_a, d_u = d_act * u * (s + a * s * (1 - s)), d_act * a * s
        dgate[e] += np.outer(h, d_a)
        dup[e] += np.outer(h, d_u)
        dx[i, j] += gate[e] @ d_a + up[e] @ d_u
    return grads


def _rounds(experts, mesh, buffer_factor):
    """Exchange rounds the dropless dispatch takes for this routing on `mesh`."""
    shards = mesh.shape["dp"] * mesh.shape["fsdp"] * mesh.shape["ep"]
    ep, local = mesh.shape["ep"], E // mesh.shape["ep"]
    rows = experts.size // shards
    buffer = buffer_rows(rows, ep, K, local, buffer_factor)
    groups = experts.reshape(shards // ep, ep, -1)  # token shards: (dp, fsdp) outer, ep inner
    received = np.stack([np.bincount(g.reshape(-1) // local, minlength=ep) for g in groups])
    return int(np.ceil(received.max() / buffer))


@pytest.mark.parametrize("mesh_name", list(MESHES))
@pytest.mark.parametrize("buffer_factor", [1.25, 0.25])
def test_dropless_gradients_equal_the_float64_reference(mesh_name, buffer_factor):
    """Values and gradients (tokens, combine weights, experts) of the dropless dispatch, in one
    exchange round and in several (a buffer of a quarter of the balanced share)."""
    x, experts, weights, w = _inputs(seed=2)
    cotangent = np.random.default_rng(3).normal(size=x.shape).astype(np.float32)
    mesh = _mesh(MESHES[mesh_name])
    if buffer_factor < 1:
        assert _rounds(experts, mesh, buffer_factor) > 1
    want_y, _ = _reference(x, experts, weights, w, shards=1, slots=x.shape[0] * x.shape[1])
    want = _reference_grads(x, experts, weights, w, cotangent)

    def place(a, names):
        spec = logical_to_spec(names, dict(mesh.shape), shape=a.shape, rules=DEFAULT_RULES)
        return jax.device_put(a, NamedSharding(mesh, spec))

    tokens = ("batch", "seq", None)
    args = [place(x, tokens), place(weights, tokens), place(w[0], ("experts", "embed", "mlp")),
            place(w[1], ("experts", "embed", "mlp")), place(w[2], ("experts", "mlp", "embed"))]
    experts_placed = place(experts, tokens)

    def loss(x, weights, gate, up, down):
        y, _, _ = routed_experts(x, experts_placed, weights, gate, up, down, buffer_factor=buffer_factor)
        return jnp.sum(y * cotangent), y

    with jax.set_mesh(mesh), use_rules(DEFAULT_RULES):
        grads, y = jax.jit(jax.grad(loss, argnums=range(5), has_aux=True))(*args)
    np.testing.assert_allclose(np.asarray(y), want_y, rtol=0, atol=2e-5)
    for name, got, expected in zip(("x", "weights", "w_gate", "w_up", "w_down"), grads, want, strict=True):
        np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-4, atol=1e-4, err_msg=name)


ADAPTERS = ("gate_up_a", "gate_up_b", "down_a", "down_b")


def _adapters(seed=4, rank=3):
    """Random expert adapters (`AdaptedExperts`' A and B, B scaled) and the merged weights they make."""
    rng = np.random.default_rng(seed)
    lora = dict(zip(ADAPTERS, (rng.normal(scale=0.15, size=s).astype(np.float32)
                               for s in ((E, D, rank), (E, rank, 2, F), (E, F, rank), (E, rank, D))), strict=True))
    return (lora, lora["gate_up_a"] @ lora["gate_up_b"].reshape(E, rank, 2 * F),
            lora["down_a"] @ lora["down_b"])


@pytest.mark.parametrize("mesh_name", ["ep1", "ep2_fsdp2", "ep2_tp2", "dp2_ep2_tp2"])
@pytest.mark.parametrize("capacity_factor, buffer_factor", [(0.0, 1.25), (0.0, 0.25), (E / K, 1.25)])
def test_expert_adapters_train_alone_and_their_gradients_equal_the_float64_reference(mesh_name, capacity_factor,
                                                                                      buffer_factor):
    """With LoRA adapters on the experts (dropless in one round and in several, and the capacity
    dispatch with room for every token), the output is that of the merged weights, the adapters'
    gradients follow from the merged weights' (dA = dW B^T, dB = A^T dW; gate and up share A), and
    the frozen base weights get none."""
    x, experts, weights, w = _inputs(seed=2)
    lora, gate_up, down = _adapters()
    merged_w = [w[0] + gate_up[..., :F], w[1] + gate_up[..., F:], w[2] + down]
    cotangent = np.random.default_rng(3).normal(size=x.shape).astype(np.float32)
    mesh = _mesh(MESHES[mesh_name])
    if buffer_factor < 1:
        assert _rounds(experts, mesh, buffer_factor) > 1
    want_y, _ = _reference(x, experts, weights, merged_w, shards=1, slots=x.shape[0] * x.shape[1])
    dx, _, d_gate, d_up, d_down = _reference_grads(x, experts, weights, merged_w, cotangent)
    a64, b64 = lora["gate_up_a"].astype(np.float64), lora["gate_up_b"].astype(np.float64)
    want = {
        "x": dx,
        "gate_up_a": d_gate @ b64[:, :, 0].transpose(0, 2, 1) + d_up @ b64[:, :, 1].transpose(0, 2, 1),
        "gate_up_b": np.stack([a64.transpose(0, 2, 1) @ d_gate, a64.transpose(0, 2, 1) @ d_up], axis=2),
        "down_a": d_down @ lora["down_b"].astype(np.float64).transpose(0, 2, 1),
        "down_b": lora["down_a"].astype(np.float64).transpose(0, 2, 1) @ d_down,
    }

    def place(a, names):
        spec = logical_to_spec(names, dict(mesh.shape), shape=a.shape, rules=DEFAULT_RULES)
        return jax.device_put(a, NamedSharding(mesh, spec))

    tokens = ("batch", "seq", None)
    base = SwiGLUExperts(place(w[0], EXPERT_GATE_NAMES), place(w[1], EXPERT_GATE_NAMES),
                         place(w[2], EXPERT_DOWN_NAMES))
    names = AdaptedExperts(base, *(None,) * 4).names()
    adapted = AdaptedExperts(base, *(place(lora[a], getattr(names, a)) for a in ADAPTERS))
    experts_placed, weights_placed = place(experts, tokens), place(weights, tokens)

    def loss(x, adapted):
        y, _, _ = routed_experts(x, experts_placed, weights_placed, None, None, None, experts=adapted,
                                 capacity_factor=capacity_factor, buffer_factor=buffer_factor)
        return jnp.sum(y * cotangent), y

    with jax.set_mesh(mesh), use_rules(DEFAULT_RULES):
        (d_x, d_adapted), y = jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))(place(x, tokens), adapted)
    np.testing.assert_allclose(np.asarray(y), want_y, rtol=0, atol=2e-5)
    for name, got in [("x", d_x), *((a, getattr(d_adapted, a)) for a in ADAPTERS)]:
        np.testing.assert_allclose(np.asarray(got), want[name], rtol=1e-4, atol=1e-4, err_msg=name)
    for got in jax.tree.leaves(d_adapted.base):
        assert not np.asarray(got).any()


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


needs_tpu = pytest.mark.skipif(not __import__("importlib").util.find_spec("libtpu"), reason="needs podtrain[aot]")


def _compiled_moe(config, sizes: dict, devices, rules=DEFAULT_RULES, tokens=(8, 128), lora=None, slots=0):
    """The compiled forward and backward pass of one MoE layer (routed experts only) over
    `tokens`, and the bytes of one device's shard of its expert weights. With `lora` (a
    `LoRAConfig`) the gradient is the adapters' and the tokens' only, as in a LoRA run; with
    `slots`, the adapters have that many slots and row b takes slot b % slots."""
    platform = devices[0].platform  # the kernels a run's build resolves for these devices
    moe = dataclasses.replace(config.moe, num_shared_experts=0, grouped_matmul=resolve_grouped_matmul("auto", platform),
                              exchange=resolve_exchange("auto", platform))
    config = config.replace(moe=moe, dtype="bfloat16", param_dtype="bfloat16")
    mesh = build_mesh({"fsdp": 1, **sizes}, devices[: int(np.prod(list(sizes.values())))])
    graphdef, state = abstract_model(
        lambda: apply_lora(MoE(config, rngs=nnx.Rngs(0)), lora or LoRAConfig(), slots=slots), mesh, rules)
    trained, frozen = nnx.split_state(state, LoRAParam if lora else nnx.Param, ...)
    token_spec = logical_to_spec(("batch", "seq", None), dict(mesh.shape), rules=rules)
    x = jax.ShapeDtypeStruct((*tokens, D), jnp.bfloat16, sharding=NamedSharding(mesh, token_spec))

    def loss(trained, x, frozen):
        if not slots:
            return nnx.merge(graphdef, trained, frozen)(x)[0].astype(jnp.float32).sum()
        index = jnp.arange(tokens[0], dtype=jnp.int32) % slots
        with rows(index, jnp.ones(tokens[0], jnp.float32), jnp.full(tokens[0], lora.rank, jnp.int32)):
            return nnx.merge(graphdef, trained, frozen)(x)[0].astype(jnp.float32).sum()

    with jax.set_mesh(mesh), use_rules(rules):
        compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(trained, x, frozen).compile()
    w = (state["base"] if lora else state)["w_gate"].get_value()
    return compiled, 3 * math.prod(w.sharding.shard_shape(w.shape)) * w.dtype.itemsize, mesh


def _first_round_only(monkeypatch):
    """Compile the dropless dispatch as it runs when the routing fits the buffer: its overflow
    rounds, loops that then make no trips but that `cost_analysis` counts once, left out."""
    monkeypatch.setattr(dropless, "_overflow", lambda plan, one_round, body, init: init)


@pytest.mark.slow
@needs_tpu
@pytest.mark.filterwarnings("ignore:Error reading persistent compilation cache entry:UserWarning")
def test_expert_parallelism_at_a_fixed_device_count_shards_the_experts_and_keeps_the_routed_flops(monkeypatch):
    """Four TPU chips: EP=4 against fsdp=4 with the experts replicated (each device runs every
    expert on its own tokens, exactly its routed share, in one round). EP must hold a quarter of
    the expert weights and compute the same routed share (a buffer of exactly the balanced
    share, routing that fits it); neither recomputes the experts in the backward pass."""
    from podtrain.orchestrator.plan.targets import compile_devices, parse_target

    devices = compile_devices(parse_target("v5p-8"))
    config = TINY.replace(moe=dataclasses.replace(TINY.moe, buffer_factor=1.0))
    _first_round_only(monkeypatch)
    replicated, replicated_bytes, _ = _compiled_moe(config, {"fsdp": 4}, devices,
                                                    rules=DEFAULT_RULES | {"embed": None, "experts": None})
    ep, ep_bytes, _ = _compiled_moe(config, {"ep": 4}, devices)
    assert ep_bytes * 4 == replicated_bytes
    routed = 8 * 128 // 4 * K * 3 * 2 * D * F  # forward FLOPs of a device's own assignments
    flops = {"replicated": replicated.cost_analysis()["flops"], "ep": ep.cost_analysis()["flops"]}
    assert 3 * routed <= flops["replicated"] <= 3.2 * routed, flops  # backward twice the forward, no recompute
    assert 0.97 <= flops["ep"] / flops["replicated"] <= 1.03, flops


@pytest.mark.slow
@needs_tpu
@pytest.mark.filterwarnings("ignore:Error reading persistent compilation cache entry:UserWarning")
def test_expert_adapters_on_tpu_leave_the_frozen_experts_without_weight_gradients(monkeypatch):
    """EP=4 on four TPU chips with LoRA on the experts: the backward pass computes the tokens'
    gradients and the adapters', never the expert weights' (a full run's third routed pass), so
    the step costs two routed passes plus the adapters' own matmuls (and the router, exchanges and
    activations, within a quarter of a routed pass)."""
    from podtrain.orchestrator.plan.targets import compile_devices, parse_target

    devices = compile_devices(parse_target("v5p-8"))
    config = TINY.replace(moe=dataclasses.replace(TINY.moe, buffer_factor=1.0))
    _first_round_only(monkeypatch)
    rank, rows = 8, 8 * 128 // 4 * K  # a device's assignments
    full = _compiled_moe(config, {"ep": 4}, devices)[0].cost_analysis()["flops"]
    lora = _compiled_moe(config, {"ep": 4}, devices, lora=LoRAConfig(rank=rank, targets=("experts",)))[0]
    routed = rows * 3 * 2 * D * F
    adapters = 3 * rows * 2 * rank * (D + 2 * F + F + D)  # forward and backward of A and B, gate_up and down
    flops = lora.cost_analysis()["flops"]
    assert 3 * routed <= full <= 3.2 * routed, full
    assert 2 * routed + adapters <= flops <= 2.25 * routed + adapters, (flops, routed, adapters)
    # With 8 adapter slots (each row its own), the adapters' matmuls are still one adapter's.
    slotted = _compiled_moe(config, {"ep": 4}, devices, lora=LoRAConfig(rank=rank, targets=("experts",)), slots=8)[0]
    assert 0.99 <= slotted.cost_analysis()["flops"] / flops <= 1.01, (slotted.cost_analysis()["flops"], flops)


@pytest.mark.slow
@needs_tpu
@pytest.mark.filterwarnings("ignore:Error reading persistent compilation cache entry:UserWarning")
def test_dropless_dispatch_compiles_for_tpu_as_ragged_exchanges_and_grouped_matmul_kernels():
    """The exchanges are ragged all-to-alls (dispatch and combine, forward and backward, for round
    0 and in the overflow rounds' loops), the experts Pallas grouped matmuls; no token rows are
    all-reduced, no XLA ragged dot is left."""
    from podtrain.orchestrator.plan import hlo_comm
    from podtrain.orchestrator.plan.targets import compile_devices, parse_target

    compiled, _, mesh = _compiled_moe(TINY, {"ep": 4}, compile_devices(parse_target("v5p-8")))
    text = compiled.as_text()
    found = hlo_comm.collectives(text, mesh.devices.shape, mesh.axis_names)
    kinds = sorted(c.kind for c in found)
    ragged_ops = [c for c in found if c.kind == "ragged-all-to-all"]
    assert len(ragged_ops) == 8 and sum("while" in c.op_name for c in ragged_ops) == 4, ragged_ops
    assert not {"all-to-all", "reduce-scatter"} & set(kinds), kinds
    reduced = [dims for c in found if c.kind == "all-reduce" for _, dims in hlo_comm.arrays(c.shape)]
    assert set(reduced) <= {(), (D, E)}, reduced  # the loss and the router's gradient
    assert "tpu_custom_call" in text and "ragged-dot" not in text


@pytest.mark.slow
@pytest.mark.skipif(not __import__("importlib").util.find_spec("jax_plugins.xla_cuda12"), reason="needs podtrain[aot]")
def test_dropless_dispatch_compiles_for_gpus_as_ragged_exchanges():
    """On CUDA the exchanges are ragged all-to-alls too (the grouped matmuls XLA's ragged dot)."""
    from podtrain.orchestrator.plan import hlo_comm
    from podtrain.orchestrator.plan.targets import compile_devices, parse_target

    compiled, _, mesh = _compiled_moe(TINY, {"ep": 4}, compile_devices(parse_target("h100x8")))
    kinds = [c.kind for c in hlo_comm.collectives(compiled.as_text(), mesh.devices.shape, mesh.axis_names)]
    assert kinds.count("ragged-all-to-all") == 8 and "all-to-all" not in kinds, kinds


@pytest.mark.slow
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
