"""LoRA adapters applied to a built model: new adapters change nothing, merged weights equal base +
adapter, adapters stacked and sharded like the weights they adapt, dropout in training only."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from podtrain.models import ARCHITECTURES
from podtrain.models.lora import TARGETS, Adapter, LoRAConfig, LoRAParam, apply_lora, dropout, merged
from podtrain.orchestrator.config.compose import load_config
from podtrain.sharding.mesh import build_mesh
from podtrain.sharding.place import abstract_model
from podtrain.sharding.rules import DEFAULT_RULES

PRESETS = ("llama3-tiny", "qwen3-tiny", "deepseek-v3-tiny")


def _every_target(config) -> tuple[str, ...]:
    return tuple(t for t in TARGETS if not (config.tie_word_embeddings and t == "lm_head")
                 and not (config.model_type != "deepseek_v3" and t == "experts"))


def _models(preset: str, rank: int = 4):
    config = load_config(preset).model.replace(scan_layers=True)
    cls = ARCHITECTURES[config.model_type].model_class
    lora = LoRAConfig(rank=rank, alpha=8.0, targets=_every_target(config))
    return config, apply_lora(cls(config, rngs=nnx.Rngs(0)), lora), cls(config, rngs=nnx.Rngs(0))


def _ids(config, batch=2, seq=12):
    return jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, (batch, seq)), jnp.int32)


@pytest.mark.parametrize("preset", PRESETS)
def test_new_adapters_leave_the_base_and_the_logits_unchanged(preset):
    config, adapted, plain = _models(preset)
    # Every base weight, by its path in the model without adapters, is the plain model's; a new
    # adapter's update is zero.
    base, want = dict(nnx.to_flat_state(merged(adapted))), dict(nnx.to_flat_state(nnx.state(plain)))
    assert base.keys() == want.keys()
    for path, value in want.items():
        np.testing.assert_array_equal(np.asarray(base[path].get_value()), np.asarray(value.get_value()))
    ids = _ids(config)
    np.testing.assert_array_equal(np.asarray(adapted(ids)[0]), np.asarray(plain(ids)[0]))


def _randomise_adapters(model, seed=1):
    """Non-zero A and B everywhere (trained adapters), so every update is seen."""
    rng = np.random.default_rng(seed)
    for _, module in nnx.iter_modules(model):
        if isinstance(module, Adapter):
            for p in (module.lora_a, module.lora_b):
                p.set_value(jnp.asarray(rng.normal(scale=0.05, size=p.shape), p.dtype))


@pytest.mark.parametrize("preset", PRESETS)
def test_merged_weights_give_the_logits_of_base_plus_adapter(preset):
    config, adapted, plain = _models(preset)
    _randomise_adapters(adapted)
    nnx.update(plain, merged(adapted))
    ids = _ids(config)
    want = np.asarray(adapted(ids)[0])
    np.testing.assert_allclose(np.asarray(plain(ids)[0]), want, rtol=1e-5, atol=1e-5)
    # The adapters change the model, and the merged weights follow them.
    _, _, untouched = _models(preset)
    assert np.abs(np.asarray(untouched(ids)[0]) - want).max() > 1e-3
    # Decoding from a cache (DeepSeek-V3 absorbs kv_b into the queries there) agrees too.
    cache_a, cache_p = adapted.init_cache(2, 16), plain.init_cache(2, 16)
    got_a, _, _ = adapted(ids, cache=cache_a)
    got_p, _, _ = plain(ids, cache=cache_p)
    np.testing.assert_allclose(np.asarray(got_a), want, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(got_p), np.asarray(got_a), rtol=1e-5, atol=1e-5)


def test_adapters_are_stacked_and_sharded_like_their_weights():
    config = load_config("llama3-tiny").model
    lora = LoRAConfig(rank=8, targets=("q_proj", "o_proj", "down_proj", "lm_head", "embed_tokens"))
    mesh = build_mesh({"fsdp": 2, "tp": 2}, jax.devices()[:4])
    cls = ARCHITECTURES[config.model_type].model_class
    _, state = abstract_model(lambda: apply_lora(cls(config, rngs=nnx.Rngs(0)), lora), mesh, DEFAULT_RULES)
    layers = state["layers"]
    L, D, H, HD = config.num_layers, config.hidden_size, config.num_heads, config.head_dim

    def spec(v):
        return tuple(v.get_value().sharding.spec), v.get_value().shape

    assert spec(layers["attn"]["wq"]["lora_a"]) == ((None, "fsdp", None), (L, D, 8))
    assert spec(layers["attn"]["wq"]["lora_b"]) == ((None, None, "tp", None), (L, 8, H, HD))
    assert spec(layers["attn"]["wq"]["base"]) == ((None, "fsdp", "tp", None), (L, D, H, HD))
    assert spec(layers["attn"]["wo"]["lora_a"]) == ((None, "tp", None, None), (L, H, HD, 8))
    assert spec(layers["mlp"]["w_down"]["lora_a"]) == ((None, "tp", None), (L, config.intermediate_size, 8))
    assert spec(state["lm_head"]["lora_b"]) == ((None, "tp"), (8, config.vocab_size))
    assert spec(state["embed"]["lora_a"]) == (("tp", None), (config.vocab_size, 8))
    assert isinstance(layers["attn"]["wk"], nnx.Variable)  # not targeted: the weight itself


def test_bad_lora_settings_name_the_key():
    config = load_config("llama3-tiny").model
    cls = ARCHITECTURES[config.model_type].model_class
    with pytest.raises(ValueError, match=r"^lora.targets: unknown module name\(s\) \['qproj'\]; expected some of"):
        apply_lora(cls(config, rngs=nnx.Rngs(0)), LoRAConfig(rank=4, targets=("qproj",)))
    with pytest.raises(ValueError, match=r"^lora.rank: expected 0 \(no adapters\) or a positive integer, found -1"):
        LoRAConfig(rank=-1).validate()
    tied = config.replace(tie_word_embeddings=True)
    with pytest.raises(ValueError, match=r"^lora.targets: lm_head is the embedding"):
        apply_lora(cls(tied, rngs=nnx.Rngs(0)), LoRAConfig(rank=4, targets=("lm_head",)))
    from podtrain.orchestrator.config.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^lora.targets: experts adapts routed experts, and this llama model has "
                                          r"none; remove it from lora.targets"):
        load_config("llama3-tiny", ["lora.rank=4", "lora.targets=[q_proj,experts]"])


STEP_TINY = ["model.num_layers=2", "model.hidden_size=64", "model.intermediate_size=128", "model.vocab_size=256",
             "model.head_dim=16", "train.batch_size=8", "train.seq_len=16", "mesh.fsdp=-1", "mesh.tp=2",
             "optimizer.learning_rate=0.01", "optimizer.schedule=constant"]


@pytest.mark.parametrize("preset, extra", [
    ("llama3-tiny", ["lora.targets=[q_proj,v_proj,o_proj,gate_proj,down_proj,lm_head,embed_tokens]"]),
    ("deepseek-v3-tiny", ["lora.targets=[q_a_proj,q_b_proj,kv_a_proj_with_mqa,kv_b_proj,o_proj,up_proj,experts]",
                          "mesh.tp=1", "mesh.ep=2"]),
])
def test_a_lora_run_trains_only_the_adapters_and_keeps_the_base(preset, extra):
    from podtrain.orchestrator.config.compose import load_config as load
    from podtrain.orchestrator.train.build import build_training
    from podtrain.orchestrator.train.synthetic import random_batch

    keys = {o.split("=")[0] for o in extra}
    overrides = [o for o in STEP_TINY if o.split("=")[0] not in keys] + extra + ["lora.rank=4"]
    training = build_training(load(preset, overrides))
    state, frozen = training.init_state(), training.init_frozen()
    base_before = [np.asarray(a) for a in jax.tree.leaves(frozen)]
    trained = nnx.to_flat_state(state.params)
    # Only the adapters (and DeepSeek's router biases, which balancing moves) are trained params,
    # and the optimizer state is theirs alone.
    assert all(isinstance(v, LoRAParam) or path[-1] == "router_bias" for path, v in trained)
    assert any(isinstance(v, LoRAParam) for _, v in trained)
    assert not any(isinstance(v, LoRAParam) for _, v in nnx.to_flat_state(frozen))
    trained_size = sum(v.size for v in jax.tree.leaves(state.params))
    moments = sum(v.size for v in jax.tree.leaves(state.opt_state) if v.ndim)
    assert moments == 2 * trained_size  # AdamW: two moments per trained parameter
    b_before = [np.asarray(v.get_value()) for path, v in trained if path[-1] == "lora_b"]
    losses = []
    for _ in range(3):
        state, metrics = training.step(state, random_batch(training, seed=0), frozen)
        losses.append(float(metrics["loss"]))
    assert losses[-1] < losses[0], losses
    for got, want in zip(jax.tree.leaves(frozen), base_before, strict=True):
        np.testing.assert_array_equal(np.asarray(got), want)
    b_after = [np.asarray(v.get_value()) for path, v in nnx.to_flat_state(state.params) if path[-1] == "lora_b"]
    assert all(np.abs(a - b).max() > 0 for a, b in zip(b_after, b_before, strict=True))
    fresh = jax.tree.leaves(training.init_frozen())
    for got, want in zip(fresh, base_before, strict=True):  # the base is the one train.seed makes
        np.testing.assert_array_equal(np.asarray(got), want)


def test_the_plan_counts_the_trained_params_and_only_their_optimizer_state():
    from podtrain.orchestrator.config.compose import load_config as load
    from podtrain.orchestrator.plan.report import format_plan, make_plan
    from podtrain.orchestrator.train.build import build_training

    overrides = [*STEP_TINY, "lora.targets=[q_proj,v_proj]"]
    full = make_plan(build_training(load("llama3-tiny", overrides)))
    lora = make_plan(build_training(load("llama3-tiny", [*overrides, "lora.rank=4"])))
    config = load_config("llama3-tiny", overrides).model
    adapters = config.num_layers * 4 * (config.hidden_size + config.num_heads * config.head_dim
                                        + config.hidden_size + config.num_kv_heads * config.head_dim)
    assert full["trainable_param_count"] == full["param_count"]
    assert lora["trainable_param_count"] == adapters and lora["param_count"] == full["param_count"] + adapters
    assert "lora       rank 4 on q_proj, v_proj: " in format_plan(lora) and "lora " not in format_plan(full)
    # Per device, the step reads the weights and AdamW's two moments of what it trains (a third of
    # the full run's state, with the adapters') and writes back only the trained params and moments.
    full_memory, lora_memory = full["memory"], lora["memory"]
    assert lora_memory["argument_bytes"] < 0.5 * full_memory["argument_bytes"], (full_memory, lora_memory)
    assert lora_memory["output_bytes"] * 10 < full_memory["output_bytes"], (full_memory, lora_memory)


def test_lora_on_the_experts_trains_the_same_with_ep2_as_with_ep1():
    """Expert adapters sharded over ep=2 with their experts train as with every expert on every
    device (ep=1, the batch over fsdp=2): same losses, same adapters after three steps (SGD, so
    that the optimizer does not amplify rounding in near-zero gradients)."""
    from podtrain.orchestrator.config.compose import load_config as load
    from podtrain.orchestrator.train.build import build_training
    from podtrain.orchestrator.train.synthetic import random_batch

    overrides = [o for o in STEP_TINY if not o.startswith(("mesh.", "optimizer."))] + [
        "lora.rank=4", "lora.targets=[experts,q_b_proj]", "optimizer.name=sgd", "optimizer.learning_rate=0.5",
        "optimizer.schedule=constant"]
    runs = {}
    for name, mesh in {"ep2": ["mesh.ep=2", "mesh.fsdp=1"], "ep1": ["mesh.ep=1", "mesh.fsdp=2"]}.items():
        training = build_training(load("deepseek-v3-tiny", overrides + mesh), jax.devices()[:2])
        state, frozen = training.init_state(), training.init_frozen()
        expert_a = state.params["moe_layers"]["mlp"]["gate_up"]["lora_a"].get_value()
        assert tuple(expert_a.sharding.spec)[:2] == (None, "ep" if name == "ep2" else None)
        losses = []
        for step in range(3):
            state, metrics = training.step(state, random_batch(training, seed=step), frozen)
            losses.append(float(metrics["loss"]))
        runs[name] = losses, {path: np.asarray(v.get_value()) for path, v in nnx.to_flat_state(state.params)}
    np.testing.assert_allclose(runs["ep2"][0], runs["ep1"][0], rtol=1e-5)
    assert runs["ep2"][0][-1] < runs["ep2"][0][0]
    experts = [path for path in runs["ep1"][1] if "gate_up" in path or "down" in path]
    assert len(experts) == 4
    for path, want in runs["ep1"][1].items():
        np.testing.assert_allclose(runs["ep2"][1][path], want, rtol=1e-5, atol=1e-6, err_msg=str(path))


def test_lora_dropout_drops_each_adapters_inputs_in_training_only():
    config = load_config("llama3-tiny").model.replace(scan_layers=True)
    cls = ARCHITECTURES[config.model_type].model_class
    targets = ("q_proj", "v_proj", "down_proj")
    dropping = apply_lora(cls(config, rngs=nnx.Rngs(0)), LoRAConfig(rank=4, dropout=0.25, targets=targets))
    plain = apply_lora(cls(config, rngs=nnx.Rngs(0)), LoRAConfig(rank=4, targets=targets))
    _randomise_adapters(dropping)
    _randomise_adapters(plain)
    ids, key = _ids(config), jax.random.key(0)

    def logits(model, key=None):
        with dropout(key):
            return np.asarray(model(ids)[0])

    undropped = logits(plain)
    np.testing.assert_array_equal(logits(dropping), undropped)  # no key: evaluation, generation
    np.testing.assert_array_equal(logits(plain, key), undropped)  # rate 0
    dropped = logits(dropping, key)
    np.testing.assert_array_equal(logits(dropping, key), dropped)
    assert np.abs(dropped - undropped).max() > 1e-3
    assert np.abs(logits(dropping, jax.random.key(1)) - dropped).max() > 1e-3
    # An input's entries are dropped at the rate and the rest scaled by 1 / (1 - rate); each target
    # of a layer draws its own mask.
    x = jnp.ones((64, 256))
    with dropout(key):
        masks = [np.asarray(a.dropped(x)) for a in (dropping.layers.attn.wq, dropping.layers.attn.wv)]
    for mask in masks:
        assert set(np.unique(mask).tolist()) == {0.0, np.float32(1 / 0.75)}
        assert abs((mask == 0).mean() - 0.25) < 0.01
    assert (masks[0] != masks[1]).any()


def test_a_lora_run_with_dropout_drops_from_its_second_step_on():
    """B starts at zero, so the first loss is dropout's too; then the dropped inputs change it."""
    from podtrain.orchestrator.config.compose import load_config as load
    from podtrain.orchestrator.train.build import build_training
    from podtrain.orchestrator.train.synthetic import random_batch

    losses = {}
    for rate in (0.0, 0.3):
        training = build_training(load("llama3-tiny", [*STEP_TINY, "lora.rank=4", f"lora.dropout={rate}",
                                                       "train.grad_accum=2"]))
        state, frozen = training.init_state(), training.init_frozen()
        losses[rate] = []
        for step in range(2):
            state, metrics = training.step(state, random_batch(training, seed=step), frozen)
            losses[rate].append(float(metrics["loss"]))
    assert losses[0.0][0] == losses[0.3][0] and losses[0.0][1] != losses[0.3][1], losses


def test_lora_dropout_is_refused_where_it_is_not_applied():
    config = load_config("deepseek-v3-tiny").model
    cls = ARCHITECTURES[config.model_type].model_class
    for targets in (("q_b_proj", "experts"), ("o_proj", "lm_head")):
        with pytest.raises(ValueError, match=r"^lora.dropout: expected 0 with the target\(s\) \['(experts|lm_head)'\], "
                                             r"found 0.1 .*set lora.dropout=0 or leave them out"):
            apply_lora(cls(config, rngs=nnx.Rngs(0)), LoRAConfig(rank=4, dropout=0.1, targets=targets))
    with pytest.raises(ValueError, match=r"^lora.dropout: expected a rate in \[0, 1\), found 1.0"):
        LoRAConfig(rank=4, dropout=1.0).validate()
