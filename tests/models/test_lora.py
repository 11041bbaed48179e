"""LoRA adapters applied to a built model: new adapters change nothing, merged weights equal base +
adapter, adapters stacked and sharded like the weights they adapt, dropout in training only."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from podtrain.models import ARCHITECTURES
from podtrain.models.lora import TARGETS, Adapter, LoRAConfig, apply_lora, dropout, merged
from podtrain.orchestrator.config.compose import load_config
from podtrain.sharding.mesh import build_mesh
from podtrain.sharding.place import abstract_model
from podtrain.sharding.rules import DEFAULT_RULES

PRESETS = ("llama3-tiny", "qwen3-tiny", pytest.param("deepseek-v3-tiny", marks=pytest.mark.slow))


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
    with pytest.raises(ValueError, match=r"^lora.targets: lm_head and embed_tokens are one weight"):
        apply_lora(cls(tied, rngs=nnx.Rngs(0)), LoRAConfig(rank=4, targets=("lm_head", "embed_tokens")))
    with pytest.raises(ValueError, match=r"^lora.targets: the LM head's adapter of a model with tied embeddings "
                                         r"cannot be merged"):
        merged(apply_lora(cls(tied, rngs=nnx.Rngs(0)), LoRAConfig(rank=4, targets=("lm_head",))))
    from podtrain.orchestrator.common.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^lora.targets: experts adapts routed experts, and this llama model has "
                                          r"none; remove it from lora.targets"):
        load_config("llama3-tiny", ["lora.rank=4", "lora.targets=[q_proj,experts]"])


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


def test_lora_dropout_is_refused_where_it_is_not_applied():
    config = load_config("deepseek-v3-tiny").model
    cls = ARCHITECTURES[config.model_type].model_class
    for targets in (("q_b_proj", "experts"), ("o_proj", "lm_head")):
        with pytest.raises(ValueError, match=r"^lora.dropout: expected 0 with the target\(s\) \['(experts|lm_head)'\], "
                                             r"found 0.1 .*set lora.dropout=0 or leave them out"):
            apply_lora(cls(config, rngs=nnx.Rngs(0)), LoRAConfig(rank=4, dropout=0.1, targets=targets))
    with pytest.raises(ValueError, match=r"^lora.dropout: expected a rate in \[0, 1\), found 1.0"):
        LoRAConfig(rank=4, dropout=1.0).validate()
