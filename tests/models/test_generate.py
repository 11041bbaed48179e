"""Generation: greedy parity with transformers, cached decode vs full forward, sampling, sharded decode."""

from __future__ import annotations

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from hf_fixtures import save_hf_model

from podtrain.models import Llama, ModelConfig
from podtrain.models.generate import RowSampling, Sampling, ends_with_stop, generate, greedy, pick_tokens
from podtrain.models.hf_read import from_hf
from podtrain.sharding import DEFAULT_RULES, build_mesh, use_rules

PROMPT_LENGTHS = (7, 3, 12, 5)
NEW_TOKENS = 10
TINY = ModelConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=3, num_heads=4, num_kv_heads=2,
                   head_dim=16, initializer_range=0.2)


def _prompts(vocab: int, lengths=PROMPT_LENGTHS, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n).tolist() for n in lengths]


def _hf_greedy(hf_model, prompt: list[int], new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("kind", ["llama", "qwen3", "deepseek_v3"])
def test_greedy_generation_equals_transformers_generate(kind, tmp_path):
    """Prompts of different lengths in one padded batch give, token for token, what transformers'
    `generate()` gives for each prompt alone (which stops at its EOS, as ours does)."""
    hf_model = save_hf_model(kind, tmp_path)
    eos = hf_model.generation_config.eos_token_id
    stop = [eos] if isinstance(eos, int) else list(eos or [])
    _, model = from_hf(tmp_path)
    prompts = _prompts(hf_model.config.vocab_size)
    ours = generate(model, prompts, max_new_tokens=NEW_TOKENS, stop_tokens=stop)
    for prompt, tokens in zip(prompts, ours, strict=True):
        assert tokens == _hf_greedy(hf_model, prompt, NEW_TOKENS), f"prompt of {len(prompt)} tokens"


def test_stop_tokens_end_each_sequence_and_the_loop():
    model = Llama(TINY, rngs=nnx.Rngs(2))
    prompts = _prompts(TINY.vocab_size, seed=2)
    free = generate(model, prompts, max_new_tokens=8)
    stop = free[0][2]  # the third token of row 0
    stopped = generate(model, prompts, max_new_tokens=8, stop_tokens=[stop])
    for row, tokens in zip(free, stopped, strict=True):
        end = row.index(stop) + 1 if stop in row else len(row)
        assert tokens == row[:end]
    # When every row has stopped the loop ends: one token each, all of them the stop token.
    firsts = {row[0] for row in free}
    assert generate(model, prompts, max_new_tokens=8, stop_tokens=sorted(firsts)) == [[row[0]] for row in free]


def test_generating_past_max_position_embeddings_warns():
    model = Llama(TINY.replace(max_position_embeddings=12), rngs=nnx.Rngs(3))
    prompts = [[5, 6, 7, 8]]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        generate(model, prompts, max_new_tokens=9)  # positions 0..11: within
    with pytest.warns(UserWarning, match=r"reaches position 12, past the 12 positions the model is made for"):
        generate(model, prompts, max_new_tokens=10)


def test_sampling_is_reproducible_per_seed_and_differs_across_seeds():
    model = Llama(TINY, rngs=nnx.Rngs(3))
    prompts = _prompts(TINY.vocab_size, seed=3)
    hot = Sampling(temperature=1.5, top_k=20, top_p=0.95)
    first = generate(model, prompts, max_new_tokens=8, sampling=hot, seed=7)
    assert generate(model, prompts, max_new_tokens=8, sampling=hot, seed=7) == first
    assert generate(model, prompts, max_new_tokens=8, sampling=hot, seed=8) != first


def _pick(rows, keys, sampling):
    tokens, _ = pick_tokens(jnp.asarray(rows, jnp.float32), keys, RowSampling.of(sampling, keys),
                            filtered=sampling.filtered)
    return tokens


def _frequencies(logits, sampling, n=20000):
    keys = jax.random.split(jax.random.key(0), n)
    draws = _pick(np.broadcast_to(np.asarray(logits, np.float32), (n, len(logits))), keys, sampling)
    return np.bincount(np.asarray(draws), minlength=len(logits)) / n


def test_sample_follows_temperature_top_k_and_top_p():
    probs = np.array([0.4, 0.3, 0.2, 0.06, 0.04])
    logits = np.log(probs)
    # Temperature 2 flattens the distribution to softmax(logits / 2).
    tempered = np.exp(logits / 2) / np.exp(logits / 2).sum()
    np.testing.assert_allclose(_frequencies(logits, Sampling(temperature=2.0)), tempered, atol=0.015)
    # top-k 2: the two most likely, renormalised.
    np.testing.assert_allclose(_frequencies(logits, Sampling(temperature=1.0, top_k=2)),
                               [0.4 / 0.7, 0.3 / 0.7, 0, 0, 0], atol=0.015)
    # top-p 0.75: 0.4 + 0.3 < 0.75, so the third token completes the set.
    np.testing.assert_allclose(_frequencies(logits, Sampling(temperature=1.0, top_p=0.75)),
                               [0.4 / 0.9, 0.3 / 0.9, 0.2 / 0.9, 0, 0], atol=0.015)
    # Ties at the cut: of four equally likely tokens top-p 0.5 keeps two (by rank, as transformers).
    np.testing.assert_allclose(_frequencies(np.zeros(4), Sampling(temperature=1.0, top_p=0.5)),
                               [0.5, 0.5, 0, 0], atol=0.015)
    # Greedy, top-k 1 and a tiny top-p (at any temperature) all pick the most likely token.
    rows = jnp.asarray(np.random.default_rng(0).normal(size=(64, 50)), jnp.float32)
    for sampling in (Sampling(), Sampling(temperature=3.0, top_k=1), Sampling(temperature=3.0, top_p=1e-6)):
        np.testing.assert_array_equal(_pick(rows, jax.random.split(jax.random.key(1), 64), sampling),
                                      np.argmax(rows, axis=-1))


def test_picked_tokens_logprobs_are_under_the_distribution_they_were_drawn_from():
    """Each row its own temperature and filter: a greedy row's logprob is the plain softmax's, a
    hot row's the tempered and filtered one's."""
    logits = jnp.log(jnp.asarray([[0.4, 0.3, 0.2, 0.06, 0.04]] * 2, jnp.float32))
    sampling = RowSampling(jnp.asarray([0.0, 2.0]), jnp.asarray([0, 2]), jnp.asarray([1.0, 1.0]),
                           jax.random.split(jax.random.key(0), 2))
    tokens, logprobs = pick_tokens(logits, sampling.key, sampling, filtered=True)
    assert int(tokens[0]) == 0
    np.testing.assert_allclose(logprobs[0], np.log(0.4), rtol=1e-6)
    kept = np.exp(np.log([0.4, 0.3]) / 2)
    np.testing.assert_allclose(logprobs[1], np.log(kept / kept.sum())[int(tokens[1])], rtol=1e-6)


def test_a_row_stops_on_device_once_its_tokens_end_with_a_stop_sequence():
    tokens = jnp.asarray([[5, 6, 7, 0], [5, 6, 7, 0], [7, 0, 0, 0]])
    # Row 0: (6, 7) or the token 9; row 1: none; row 2: (5, 7), which its tokens never end with.
    stop = jnp.asarray([[[6, 7], [-1, 9]], [[-1, -1], [-1, -1]], [[5, 7], [-1, -1]]])
    assert [ends_with_stop(tokens, step, stop).tolist() for step in range(3)] == [
        [False, False, False], [False, False, False], [True, False, False]]
    assert ends_with_stop(jnp.asarray([[9]]), 0, jnp.asarray([[[-1, 9]]])).tolist() == [True]


def test_greedy_picks_the_first_maximum_as_argmax_does():
    rng = np.random.default_rng(0)
    rows = rng.normal(size=(16, 300)).astype(np.float32)
    rows[1, [7, 40, 299]] = 9.0          # ties: the first one
    rows[2, -1] = 9.0                    # the last index
    rows[3] = 0.0                        # all equal
    rows[4, [5, 9]] = np.nan             # NaN counts as the maximum, as in numpy
    rows[5, 0], rows[5, 10] = np.inf, np.nan
    rows[6, :] = -np.inf
    rows[7, 3] = np.inf
    np.testing.assert_array_equal(greedy(jnp.asarray(rows)), np.argmax(rows, axis=-1))
    assert greedy(jnp.asarray(rows)).dtype == jnp.int32


@pytest.mark.parametrize("bad, message", [
    (dict(sampling=Sampling(temperature=-1.0)), "temperature"),
    (dict(sampling=Sampling(top_p=0.0)), "top_p"),
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(max_len=8), "max_len"),
])
def test_generate_rejects_bad_arguments(bad, message):
    model = Llama(TINY, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=message):
        generate(model, _prompts(TINY.vocab_size), **{"max_new_tokens": 4, **bad})


@pytest.mark.parametrize("kind", ["llama", pytest.param("deepseek_v3", marks=pytest.mark.slow)])
def test_sharded_decode_equals_single_device(kind, tmp_path):
    """Greedy tokens with params and cache sharded over (fsdp=2, tp=2) equal one device's."""
    save_hf_model(kind, tmp_path)
    _, single = from_hf(tmp_path)
    prompts = _prompts(128, seed=5)
    expected = generate(single, prompts, max_new_tokens=NEW_TOKENS)
    mesh = build_mesh(dict(fsdp=2, tp=2), jax.devices()[:4])
    _, sharded = from_hf(tmp_path, mesh=mesh)
    assert len(sharded.embed[...].sharding.device_set) == 4
    with jax.set_mesh(mesh), use_rules(DEFAULT_RULES):
        assert generate(sharded, prompts, max_new_tokens=NEW_TOKENS) == expected
    if kind == "deepseek_v3":  # one prompt over fsdp x ep: a batch the token axes do not divide
        expected = generate(single, prompts[:1], max_new_tokens=NEW_TOKENS)
        mesh = build_mesh(dict(fsdp=2, ep=2), jax.devices()[:4])
        _, sharded = from_hf(tmp_path, mesh=mesh)
        with jax.set_mesh(mesh), use_rules(DEFAULT_RULES):
            assert generate(sharded, prompts[:1], max_new_tokens=NEW_TOKENS) == expected


@pytest.mark.parametrize("tokens", [1, 5])
def test_tensor_parallel_cached_attention_needs_no_collective(tokens):
    """With the query and kv heads sharded over tp=2, cached attention (a decode step's one token,
    and a prefill chunk) compiles to a program without any collective: each device reads only its
    own kv heads' cache slots, never another device's."""
    from podtrain.models.attention import cached_attention

    mesh = build_mesh(dict(tp=2), jax.devices()[:2])
    rng = np.random.default_rng(3)
    batch, length, kv_heads, group, d = 2, 64, 4, 2, 16
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape).astype(np.float32))  # noqa: E731
    heads_on_tp = lambda ndim: jax.NamedSharding(mesh, jax.P(*[None] * (ndim - 2), "tp", None))  # noqa: E731
    queries, new_keys = normal(batch, tokens, kv_heads * group, d), normal(batch, tokens, kv_heads, d)
    new_values = normal(batch, tokens, kv_heads, d)
    key_cache, value_cache = normal(3, batch, length, kv_heads, d), normal(3, batch, length, kv_heads, d)
    positions = jnp.broadcast_to(40 + jnp.arange(tokens, dtype=jnp.int32), (batch, tokens))
    slots = jnp.arange(length, dtype=jnp.int32)
    cache_positions = jnp.broadcast_to(jnp.where(slots < 40, slots, -1), (batch, length))

    def attend(q, k, v, k_cache, v_cache, layer):
        return cached_attention([q], [k], v, [k_cache], v_cache, layer=layer, positions_BT=positions,
                                key_positions_BT=positions, cache_positions_BS=cache_positions,
                                cache_used=jnp.int32(40), block=16)

    arrays = (queries, new_keys, new_values, key_cache, value_cache)
    shardings = tuple(heads_on_tp(a.ndim) for a in arrays)
    sharded = jax.jit(attend, in_shardings=(*shardings, None), out_shardings=heads_on_tp(4))
    hlo = sharded.lower(*arrays, jnp.int32(1)).compile().as_text()
    collectives = re.findall(r"(all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)", hlo)
    assert collectives == []
    expected = jax.jit(attend)(*arrays, jnp.int32(1))
    np.testing.assert_allclose(sharded(*arrays, jnp.int32(1)), expected, rtol=1e-5, atol=1e-6)


def test_decode_step_updates_the_stacked_cache_in_place():
    """A compiled decode step at max_len 4096: no copy of a whole stacked cache (the output cache
    aliases the donated input), and temporaries far below one layer's share of it."""
    config = TINY.replace(num_layers=4)
    model = Llama(config, rngs=nnx.Rngs(0))
    cache = model.init_cache(2, 4096)
    step = jax.jit(lambda m, token, cache: m(token, cache=cache)[:2], donate_argnums=2)
    compiled = step.lower(model, jnp.zeros((2, 1), jnp.int32), cache).compile()
    cache_shape = ",".join(map(str, cache.k[0].shape))
    copies = re.findall(rf"f32\[{cache_shape}\]\S* (?:copy|fusion)\(", compiled.as_text())
    # The only full-cache-shaped results: the in-place writes of k and v (dynamic-update-slice fusions).
    assert len(copies) == 2, copies
    assert not re.search(rf"f32\[{cache_shape}\]\S* copy\(", compiled.as_text())
    memory = compiled.memory_analysis()
    cache_bytes = 2 * cache.k[0].nbytes
    assert memory.alias_size_in_bytes >= cache_bytes
    assert memory.temp_size_in_bytes < cache.k[0].nbytes // config.num_layers
    # Two steps from a prompt token: the same logits as the uncompiled model's.
    tokens = jnp.asarray([[5], [9]], jnp.int32)
    logits, cache = compiled(model, tokens, cache)
    logits_2, _ = compiled(model, tokens + 1, cache)
    want, want_cache, _ = model(tokens, cache=model.init_cache(2, 4096))
    want_2, _, _ = model(tokens + 1, cache=want_cache)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(want), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(logits_2), np.asarray(want_2), rtol=1e-5, atol=1e-5)
