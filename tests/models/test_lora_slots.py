"""Adapter slots: many adapters on one model, each batch row picking its own. A mixed batch gives
each row the logits and gradients of its adapter alone; empty slots leave the base unchanged; a
slot is initialised as `apply_lora` (PEFT's init) makes a new adapter; a slot's adapter goes in and
out whole; what cannot take slots is refused by name."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from lora_fixtures import ALPHA, SLOT_TARGETS, alone, config_of, filled, row_arrays, slotted

from podtrain.models import ARCHITECTURES
from podtrain.models.lora import LoRAConfig, LoRAParam, adapters, apply_lora, init_slot, rows, slot_view
from podtrain.sharding.mesh import build_mesh
from podtrain.sharding.place import abstract_model, state_shardings
from podtrain.sharding.rules import DEFAULT_RULES, use_rules

MLP_ONLY = ("gate_proj", "up_proj", "down_proj")
# slot: (rank, targets, seed); slot 2 of a lower rank and other targets than slot 0.
CHOSEN = [(4, SLOT_TARGETS, 1), (8, SLOT_TARGETS, 2), (2, MLP_ONLY, 3)]
# With tied embeddings the head's adapters adapt the output projection alone (the embedding, one
# weight with it, takes none).
TIED_TARGETS = tuple(t for t in SLOT_TARGETS if t != "embed_tokens")


def _case(tied: bool):
    """(config, the slots' targets, CHOSEN) untied or with the head tied to the embedding."""
    if not tied:
        return config_of(), SLOT_TARGETS, CHOSEN
    chosen = [(rank, TIED_TARGETS if targets == SLOT_TARGETS else targets, seed) for rank, targets, seed in CHOSEN]
    return config_of().replace(tie_word_embeddings=True), TIED_TARGETS, chosen


def _ids(config, batch, seq=10, seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(0, config.vocab_size, (batch, seq)), jnp.int32)


@pytest.mark.slow
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_each_row_gets_the_logits_of_its_adapter_alone(tied):
    config, targets, chosen = _case(tied)
    model, singles = filled(config, 4, 8, chosen, targets)
    # Whatever lies above a slot's rank is masked: fill slot 2's ranks 2..7 with noise.
    rng = np.random.default_rng(9)
    for _, adapter in adapters(model):
        axis = adapter.lora_a.get_metadata()["out_sharding"].index("lora_adapters")
        for param in (adapter.lora_a, adapter.lora_b):
            value = np.array(param[...])
            noise = rng.normal(size=value.shape).astype(value.dtype)
            where = np.zeros(value.shape, bool)
            rank_axis = value.ndim - 1 if param is adapter.lora_a else axis + 1
            where[(slice(None),) * axis + (2,)] = True
            where &= (np.arange(value.shape[rank_axis]) >= 2).reshape(
                [-1 if d == rank_axis else 1 for d in range(value.ndim)])
            param.set_value(jnp.asarray(np.where(where, noise, value)))
    index = [2, 0, 1, 0, 3]  # slot 3 is empty: the base model
    ids = _ids(config, len(index))
    with rows(*row_arrays(index, [4, 8, 2, 8])):
        got = np.asarray(model(ids)[0])
        # The loss's path (the head a vocabulary slice at a time) gives the same logprobs.
        h = model.hidden_states(ids)[0]
        sliced = np.asarray(model.target_logprobs(h, ids, slices=2))
    logprobs = np.asarray(jax.nn.log_softmax(got))
    np.testing.assert_allclose(sliced, np.take_along_axis(logprobs, np.asarray(ids)[..., None], -1)[..., 0],
                               rtol=1e-5, atol=1e-5)
    base = ARCHITECTURES[config.model_type].model_class(config, rngs=nnx.Rngs(0))
    for row, slot in enumerate(index):
        reference = base if slot == 3 else singles[slot]
        want = np.asarray(reference(ids[row:row + 1])[0])[0]
        np.testing.assert_allclose(got[row], want, rtol=2e-5, atol=2e-5)
    # The adapters matter: slot 1's rows differ from the base's.
    assert np.abs(got[2] - np.asarray(base(ids[2:3])[0])[0]).max() > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_each_slot_gets_the_gradient_of_its_rows_alone(tied):
    config, slot_targets, chosen = _case(tied)
    model, singles = filled(config, 3, 8, chosen, slot_targets)
    index = [1, 0, 1, 2]
    ids = _ids(config, len(index), seed=1)
    graphdef, params, rest = nnx.split(model, LoRAParam, ...)

    def loss(params):
        with rows(*row_arrays(index, [4, 8, 2])):
            logits = nnx.merge(graphdef, params, rest)(ids)[0]
        return jnp.sum(jax.nn.log_softmax(logits.astype(jnp.float32))[..., 0])

    grads = nnx.State(jax.grad(loss)(params))
    grad_model = nnx.merge(graphdef, grads, rest)
    for slot, single in enumerate(singles):
        mine = [row for row, s in enumerate(index) if s == slot]
        s_graph, s_params, s_rest = nnx.split(single, LoRAParam, ...)

        def single_loss(p, s_graph=s_graph, s_rest=s_rest, mine=mine):
            logits = nnx.merge(s_graph, p, s_rest)(ids[np.asarray(mine)])[0]
            return jnp.sum(jax.nn.log_softmax(logits.astype(jnp.float32))[..., 0])

        want = dict(adapters(nnx.merge(s_graph, nnx.State(jax.grad(single_loss)(s_params)), s_rest)))
        rank, targets, _ = chosen[slot]
        got = dict(adapters(slot_view(grad_model, slot, rank, ALPHA, targets)))
        assert got.keys() == want.keys() and got
        for key, adapter in want.items():
            for name in ("lora_a", "lora_b"):
                w, g = np.asarray(getattr(adapter, name)[...]), np.asarray(getattr(got[key], name)[...])
                np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5 * max(1.0, np.abs(w).max()), err_msg=key)
        # Ranks above the slot's get nothing, nor targets it does not have.
        full = dict(adapters(slot_view(grad_model, slot, 8, ALPHA, slot_targets)))
        for key, adapter in full.items():
            a = np.asarray(adapter.lora_a[...])
            if adapter.target not in targets:
                assert not a.any() and not np.asarray(adapter.lora_b[...]).any(), key
            else:
                assert not a[..., rank:].any(), key


def test_empty_slots_and_new_adapters_leave_the_base_unchanged():
    config = config_of()
    model = slotted(config, 2, 8)
    ids = _ids(config, 2)
    base = ARCHITECTURES[config.model_type].model_class(config, rngs=nnx.Rngs(0))
    want = np.asarray(base(ids)[0])
    with rows(*row_arrays([0, 1], [8, 8])):
        np.testing.assert_array_equal(np.asarray(model(ids)[0]), want)
        init_slot(model, 1, 4, SLOT_TARGETS, seed=5)
        np.testing.assert_allclose(np.asarray(model(ids)[0]), want, rtol=0, atol=0)


@pytest.mark.parametrize("preset, slot_targets, targets", [
    ("llama3-tiny", SLOT_TARGETS, ("q_proj", "down_proj", "embed_tokens")),
    ("deepseek-v3-tiny", ("q_a_proj", "gate_proj", "experts"), ("q_a_proj", "experts")),
])
def test_a_new_slot_is_the_adapter_apply_lora_makes_cut_to_its_rank(preset, slot_targets, targets):
    """PEFT's init draws every rank alike: a rank-4 slot is the first 4 ranks of the adapter
    `apply_lora` makes at the slots' rank 8 (routed experts' adapters included), whether the rank
    and targets are traced or not."""
    config = config_of(preset)
    model = slotted(config, 3, 8, slot_targets)
    init_slot(model, 2, 4, targets, seed=7)
    traced = slotted(config, 3, 8, slot_targets)
    graphdef, params, rest = nnx.split(traced, LoRAParam, ...)

    @jax.jit
    def new(params, rank, chosen):
        m = nnx.merge(graphdef, params, rest)
        init_slot(m, 2, rank, chosen, 7)
        return nnx.state(m, LoRAParam)

    nnx.update(traced, new(params, jnp.int32(4), {t: jnp.asarray(t in targets) for t in slot_targets}))
    want = dict(adapters(alone(config, 8, targets, 7)))
    # Compiled, the draw's scale and shift fuse with the draw, which XLA:CPU may round differently from
    # the eager ops: some values differ by one float32 ulp of the draw's range, so the traced init is
    # compared with the eager one to that ulp, and the eager one with `apply_lora`'s exactly.
    traced_values, eager_values = (np.concatenate([np.ravel(x) for x in jax.tree.leaves(nnx.state(m, LoRAParam))])
                                   for m in (traced, model))
    np.testing.assert_allclose(traced_values, eager_values, rtol=0, atol=np.spacing(np.abs(eager_values).max()))
    got = dict(adapters(slot_view(model, 2, 4, ALPHA, targets)))
    assert got.keys() == want.keys()
    for key, adapter in want.items():
        a, b = np.asarray(adapter.lora_a[...]), np.asarray(adapter.lora_b[...])
        rank_axis = adapter.lora_b.get_metadata()["out_sharding"].index("lora_rank")
        np.testing.assert_array_equal(np.asarray(got[key].lora_a[...]), a[..., :4], err_msg=key)
        np.testing.assert_array_equal(np.asarray(got[key].lora_b[...]), np.take(b, range(4), axis=rank_axis),
                                      err_msg=key)
    # The other slots stay empty.
    for _, adapter in adapters(slot_view(model, 0, 8, ALPHA, slot_targets)):
        assert not np.asarray(adapter.lora_a[...]).any() and not np.asarray(adapter.lora_b[...]).any()


def test_slots_carry_an_adapter_axis_sharded_like_their_weights_and_their_rank_over_the_free_batch_axes():
    """Each slot array keeps its weight's sharding on the axes it shares with it; its rank axis
    takes the batch axes left free (ZeRO), so no half of an adapter is whole on every device."""
    config = config_of()
    lora = LoRAConfig(rank=8, targets=("q_proj", "down_proj", "lm_head"))
    mesh = build_mesh({"fsdp": 2, "tp": 2}, jax.devices()[:4])
    cls = ARCHITECTURES[config.model_type].model_class
    _, state = abstract_model(lambda: apply_lora(cls(config, rngs=nnx.Rngs(0)), lora, slots=5), mesh, DEFAULT_RULES)
    L, D, H, HD = config.num_layers, config.hidden_size, config.num_heads, config.head_dim

    def spec(v):
        return tuple(v.get_value().sharding.spec), v.get_value().shape

    layers = state["layers"]
    assert spec(layers["attn"]["wq"]["lora_a"]) == ((None, None, "fsdp", None), (L, 5, D, 8))
    assert spec(layers["attn"]["wq"]["lora_b"]) == ((None, None, "fsdp", "tp", None), (L, 5, 8, H, HD))
    assert spec(layers["mlp"]["w_down"]["lora_a"]) == ((None, None, "tp", "fsdp"), (L, 5, config.intermediate_size, 8))
    assert spec(layers["mlp"]["w_down"]["lora_b"]) == ((None, None, "fsdp", None), (L, 5, 8, D))
    assert spec(state["lm_head"]["lora_b"]) == ((None, "fsdp", "tp"), (5, 8, config.vocab_size))


@pytest.mark.slow
def test_what_cannot_take_slots_is_refused_by_name():
    config = config_of()
    model = slotted(config, 2, 4)
    with pytest.raises(ValueError, match=r"lora.rows"):
        model(_ids(config, 1))
    with pytest.raises(ValueError, match="slot"):
        next(a for _, a in adapters(model)).delta()
    cls = ARCHITECTURES["qwen3"].model_class
    tied = config_of("qwen3-tiny").replace(tie_word_embeddings=True)
    with pytest.raises(ValueError, match="embed_tokens"):
        apply_lora(cls(tied, rngs=nnx.Rngs(0)), LoRAConfig(rank=4, targets=("q_proj", "embed_tokens")), slots=2)
    with pytest.raises(ValueError, match="rank: expected 1 to 4"):
        init_slot(model, 0, 5, SLOT_TARGETS, 0)


@pytest.mark.slow
def test_mla_cached_decoding_gives_each_row_its_kv_b_adapter():
    """DeepSeek-V3's cached decoding absorbs kv_b into the queries and the output: with slots, each
    row adds its own adapter's low-rank product, as the whole sequence without a cache does."""
    config = config_of("deepseek-v3-tiny")
    targets = ("q_a_proj", "kv_b_proj", "o_proj")
    chosen = [(4, targets, 1), (8, ("kv_b_proj",), 2)]
    model, singles = filled(config, 3, 8, chosen, targets)
    index = [1, 0, 2, 0]  # slot 2 is empty: the base model
    ids = _ids(config, len(index), seq=9)
    with rows(*row_arrays(index, [4, 8, 8])):
        cache = model.init_cache(len(index), 16, jnp.float32)
        prefill, cache, _ = model(ids[:, :6], cache=cache)
        step, _, _ = model(ids[:, 6:], cache=cache)
    got = np.concatenate([np.asarray(prefill), np.asarray(step)], axis=1)
    base = ARCHITECTURES[config.model_type].model_class(config, rngs=nnx.Rngs(0))
    for row, slot in enumerate(index):
        reference = base if slot == 2 else singles[slot]
        np.testing.assert_allclose(got[row], np.asarray(reference(ids[row:row + 1])[0])[0], rtol=1e-4, atol=1e-4)
    assert np.abs(got[0] - np.asarray(base(ids[:1])[0])[0]).max() > 1e-3  # slot 1 (kv_b alone) matters


EXPERT_TARGETS = ("q_a_proj", "o_proj", "gate_proj", "experts")
EXPERT_CHOSEN = [(4, EXPERT_TARGETS, 1), (8, ("experts",), 2)]
EXPERT_ROWS, EXPERT_RANKS = [1, 0, 2, 0], [4, 8, 8]  # slot 2 is empty: the base model


@functools.cache
def _expert_references():
    """DeepSeek-V3's single adapters of EXPERT_CHOSEN (and the base) on the rows of EXPERT_ROWS:
    (ids, each row's logits, the base's logits of row 0, each slot's adapter gradients on its rows
    alone (path key -> (dA, dB))), as NumPy; the dispatch's settings do not change them."""
    config = config_of("deepseek-v3-tiny")
    _, singles = filled(config, 3, 8, EXPERT_CHOSEN, EXPERT_TARGETS)
    ids = _ids(config, len(EXPERT_ROWS), seq=16, seed=4)
    base = ARCHITECTURES[config.model_type].model_class(config, rngs=nnx.Rngs(0))
    logits = [np.asarray((base if slot == 2 else singles[slot])(ids[row:row + 1])[0])[0]
              for row, slot in enumerate(EXPERT_ROWS)]
    grads = []
    for slot, single in enumerate(singles):
        mine = np.asarray([row for row, s in enumerate(EXPERT_ROWS) if s == slot])
        s_graph, s_params, s_rest = nnx.split(single, LoRAParam, ...)

        def single_loss(p, s_graph=s_graph, s_rest=s_rest, mine=mine):
            out = nnx.merge(s_graph, p, s_rest)(ids[mine])[0]
            return jnp.sum(jax.nn.log_softmax(out.astype(jnp.float32))[..., 0])

        model = nnx.merge(s_graph, nnx.State(jax.jit(jax.grad(single_loss))(s_params)), s_rest)
        grads.append({key: (np.asarray(a.lora_a[...]), np.asarray(a.lora_b[...])) for key, a in adapters(model)})
    return ids, logits, np.asarray(base(ids[:1])[0])[0], grads


@pytest.mark.parametrize("mesh_sizes, capacity, buffer_factor", [
    pytest.param({}, False, 1.25, marks=pytest.mark.slow),  # the quick tier's largest test: kept under 5 minutes
    pytest.param({"ep": 2, "fsdp": 2}, False, 0.25, marks=pytest.mark.slow),  # about 32 rows an owner, 16 a round
    pytest.param({"ep": 2}, True, 1.25, marks=pytest.mark.slow),
], ids=["ep1", "ep2_fsdp2_rounds", "ep2_capacity"])
def test_each_row_takes_its_own_expert_adapters_through_the_dispatch(mesh_sizes, capacity, buffer_factor):
    """Routed experts with slots: each row's tokens meet its slot's expert adapters wherever their
    experts live (dropless in one round and in several, and the capacity dispatch with room for
    every token), for the logits and for each slot's gradients, which equal its single adapter's
    on its rows alone."""
    config = config_of("deepseek-v3-tiny")
    moe = config.moe
    config = config.replace(moe=dataclasses.replace(
        moe, capacity_factor=capacity * moe.num_experts / moe.num_experts_per_tok, buffer_factor=buffer_factor))
    model, _ = filled(config, 3, 8, EXPERT_CHOSEN, EXPERT_TARGETS)
    ids, want_logits, base_first, want_grads = _expert_references()
    graphdef, params, rest = nnx.split(model, LoRAParam, ...)
    mesh = build_mesh({"fsdp": 1, **mesh_sizes}, jax.devices()[:max(1, int(np.prod(list(mesh_sizes.values()))))])

    def placed(state):
        return jax.device_put(state, state_shardings(state, mesh, DEFAULT_RULES))

    def loss(params, rest):
        with rows(*row_arrays(EXPERT_ROWS, EXPERT_RANKS)):
            logits = nnx.merge(graphdef, params, rest)(ids)[0]
        return jnp.sum(jax.nn.log_softmax(logits.astype(jnp.float32))[..., 0]), logits

    with jax.set_mesh(mesh), use_rules(DEFAULT_RULES):
        grads, got = jax.jit(jax.grad(loss, has_aux=True))(placed(params), placed(rest))
    for row, want in enumerate(want_logits):
        np.testing.assert_allclose(np.asarray(got[row]), want, rtol=2e-5, atol=2e-5)
    assert np.abs(want_logits[0] - base_first).max() > 1e-3  # row 0's slot 1 (experts alone) matters
    grad_model = nnx.merge(graphdef, nnx.State(grads), rest)
    for slot, want in enumerate(want_grads):
        rank, slot_targets, _ = EXPERT_CHOSEN[slot]
        got_grads = dict(adapters(slot_view(grad_model, slot, rank, ALPHA, slot_targets)))
        assert got_grads.keys() == want.keys() and any("w_gate_up" in key for key in want)
        for key, (a, b) in want.items():
            for w, g in ((a, got_grads[key].lora_a[...]), (b, got_grads[key].lora_b[...])):
                np.testing.assert_allclose(np.asarray(g), w, rtol=1e-4, atol=1e-5 * max(1.0, np.abs(w).max()),
                                           err_msg=key)
