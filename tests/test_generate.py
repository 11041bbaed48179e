"""Generation: greedy parity with transformers, cached decode vs full forward, sampling, sharded decode."""

from __future__ import annotations

import dataclasses
import re
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from hf_fixtures import save_hf_model

from podtrain.models import Llama, ModelConfig, kernels
from podtrain.models.generate import (
    ONE_PASS_MAX_LAYER_BYTES,
    Sampling,
    auto_cache_reads,
    auto_layer_weights,
    generate,
    greedy,
    sample,
)
from podtrain.models.hf import from_hf
from podtrain.models.runner import split_stack
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


def _frequencies(logits, sampling, n=20000):
    keys = jax.random.split(jax.random.key(0), n)
    draws = jax.vmap(lambda k: sample(jnp.asarray([logits], jnp.float32), k, sampling)[0])(keys)
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
        np.testing.assert_array_equal(sample(rows, jax.random.key(1), sampling), np.argmax(rows, axis=-1))


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
    (dict(layer_weights="flat"), "layer_weights: expected one of auto, split, stacked, found 'flat'"),
    (dict(cache_reads="some"), "cache_reads: expected one of auto, filled, all, kernel, found 'some'"),
    (dict(decode_matmuls="eigen"), "decode_matmuls: expected one of auto, xla, kernel, found 'eigen'"),
])
def test_generate_rejects_bad_arguments(bad, message):
    model = Llama(TINY, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=message):
        generate(model, _prompts(TINY.vocab_size), **{"max_new_tokens": 4, **bad})


def test_auto_layer_weights_copies_the_layers_only_where_the_copy_fits(monkeypatch):
    """On CPU `auto` reads per-layer copies unless a second copy of the layer weights would take
    more than half of the host's available memory (a big model on a small host)."""
    model = Llama(TINY, rngs=nnx.Rngs(0))
    layer_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(nnx.state(model.layers)))
    module = sys.modules["podtrain.models.generate"]  # `models.generate` is also the function's name
    monkeypatch.setattr(module, "_available_host_bytes", lambda: 2 * layer_bytes)
    assert auto_layer_weights(model) == "split"
    monkeypatch.setattr(module, "_available_host_bytes", lambda: 2 * layer_bytes - 2)
    assert auto_layer_weights(model) == "stacked"
    monkeypatch.setattr(module, "_available_host_bytes", lambda: None)  # not Linux: copy
    assert auto_layer_weights(model) == "split"


def test_auto_cache_reads_picks_the_kernel_on_one_cpu_device_and_one_pass_on_small_gpu_caches(monkeypatch):
    """`auto` reads with the C++ kernel on one CPU device with a float32 cache (else the
    filled-block loop: several devices, bfloat16, no kernel, TPU); on GPU it reads every slot in
    one pass while a layer's slots take at most ONE_PASS_MAX_LAYER_BYTES (TINY: 256 bytes per
    batch row and slot)."""
    model = Llama(TINY, rngs=nnx.Rngs(0))
    fits = ONE_PASS_MAX_LAYER_BYTES // (2 * TINY.num_kv_heads * TINY.head_dim * 4 * 4)  # slots at batch 4
    assert auto_cache_reads(model, 4, 128) == "kernel"  # this machine: CPU, one device
    half = Llama(dataclasses.replace(TINY, dtype="bfloat16"), rngs=nnx.Rngs(0))
    assert auto_cache_reads(half, 4, 128) == "filled"
    module = sys.modules["podtrain.models.generate"]  # `models.generate` is also the function's name
    with monkeypatch.context() as patch:
        patch.setattr(module, "_devices", lambda state: 2)
        assert auto_cache_reads(model, 4, 128) == "filled"
    with monkeypatch.context() as patch:
        patch.setattr(module, "_kernel_missing", lambda: True)
        assert auto_cache_reads(model, 4, 128) == "filled"
    for platform in ("tpu", "gpu"):
        monkeypatch.setattr(module, "_platform", lambda state, platform=platform: platform)
        assert auto_cache_reads(model, 4, 128) == ("all" if platform == "gpu" else "filled")
        assert auto_cache_reads(model, 4, fits) == ("all" if platform == "gpu" else "filled")
        assert auto_cache_reads(model, 4, fits + 1) == "filled"


def test_kernel_reads_say_why_they_cannot_run(monkeypatch):
    """`cache_reads=kernel` where the kernel cannot run is an error naming the reason; `auto`
    falls back to the block loop with one warning that says why."""
    module = sys.modules["podtrain.models.generate"]
    prompts = _prompts(TINY.vocab_size)
    half = Llama(dataclasses.replace(TINY, dtype="bfloat16"), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"cache_reads=kernel: the kernel reads a float32 cache; .*\['bfloat16'\]"):
        generate(half, prompts, max_new_tokens=2, cache_reads="kernel")
    model = Llama(TINY, rngs=nnx.Rngs(0))
    monkeypatch.setattr(kernels, "kernel_error", lambda: "no working C++ compiler ('c++')")
    with pytest.raises(ValueError, match=r"kernel is not available: no working C\+\+ compiler"):
        generate(model, prompts, max_new_tokens=2, cache_reads="kernel")
    with pytest.warns(UserWarning, match=r"without the C\+\+ decode-attention kernel \(no working C\+\+ compiler"):
        assert module._kernel_missing.__wrapped__() is True
    monkeypatch.setattr(module, "_platform", lambda state: "gpu")
    with pytest.raises(ValueError, match="the decode-attention kernel runs on CPU; the params are on gpu"):
        generate(model, prompts, max_new_tokens=2, cache_reads="kernel")


def test_kernel_reads_and_matmuls_give_xlas_tokens():
    """Greedy and sampled tokens with the kernels' decode steps (attention, matmuls, both) equal
    those of XLA's block loop and dots."""
    model = Llama(TINY, rngs=nnx.Rngs(0))
    prompts = _prompts(TINY.vocab_size)
    def run(reads, matmuls, sampling):
        return generate(model, prompts, max_new_tokens=NEW_TOKENS, sampling=sampling, cache_reads=reads,
                        decode_matmuls=matmuls)

    for sampling in (Sampling(), Sampling(temperature=0.8, top_k=20)):
        expected = run("filled", "xla", sampling)
        assert run("kernel", "xla", sampling) == run("filled", "kernel", sampling) == expected
        assert run("kernel", "kernel", sampling) == expected


def test_auto_decode_matmuls_and_their_refusals(monkeypatch):
    """`auto` multiplies in the kernel on one CPU device with a float32 model, else in XLA;
    `decode_matmuls=kernel` where it cannot run says why."""
    module = sys.modules["podtrain.models.generate"]
    model = Llama(TINY, rngs=nnx.Rngs(0))
    half = Llama(dataclasses.replace(TINY, dtype="bfloat16"), rngs=nnx.Rngs(0))
    assert module.auto_decode_matmuls(model) == "kernel"
    assert module.auto_decode_matmuls(half) == "xla"
    with pytest.raises(ValueError, match="decode_matmuls=kernel: the kernel multiplies float32; this model has dtype "
                                         "bfloat16 and param_dtype float32"):
        generate(half, _prompts(TINY.vocab_size), max_new_tokens=2, decode_matmuls="kernel")
    with monkeypatch.context() as patch:
        patch.setattr(module, "_devices", lambda state: 4)
        assert module.auto_decode_matmuls(model) == "xla"
    monkeypatch.setattr(module, "_platform", lambda state: "tpu")
    assert module.auto_decode_matmuls(model) == "xla"
    with pytest.raises(ValueError, match="the matmul kernel runs on CPU; the params are on tpu"):
        generate(model, _prompts(TINY.vocab_size), max_new_tokens=2, decode_matmuls="kernel")


def test_one_pass_decode_step_has_no_data_dependent_loop():
    """With `reads="all"` a compiled decode step holds one loop, the layer scan (whose trip count
    XLA knows), and no loop over the cache blocks (whose trip count comes from the data: a
    device-to-host read per trip on GPU); its logits equal the block loop's, and prompts (more
    than one token) still loop over the filled blocks."""
    model = Llama(TINY, rngs=nnx.Rngs(0))
    step = jax.jit(lambda m, ids, cache: m(ids, kv_cache=cache))
    prompt, token = jnp.asarray([[5, 7, 9], [3, 4, 1]]), jnp.asarray([[8], [2]])
    loops, logits = {}, {}
    for reads in ("filled", "all"):
        _, cache = step(model, prompt, model.init_cache(2, 64, reads=reads))
        assert len(re.findall(r" while\(", step.lower(model, prompt, cache).compile().as_text())) == 2
        compiled = step.lower(model, token, cache).compile()
        loops[reads] = len(re.findall(r" while\(", compiled.as_text()))
        logits[reads] = compiled(model, token, cache)[0]
    assert loops == {"filled": 2, "all": 1}
    np.testing.assert_allclose(logits["all"], logits["filled"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["llama", "deepseek_v3"])
def test_sharded_decode_equals_single_device(kind, tmp_path):
    """Greedy tokens with params and cache sharded over (fsdp=2, tp=2) equal one device's, with
    the decode steps reading the layers' weights from per-layer copies (CPU's default) or from
    the stacked arrays (TPU's and GPU's)."""
    save_hf_model(kind, tmp_path)
    _, single = from_hf(tmp_path)
    prompts = _prompts(128, seed=5)
    expected = generate(single, prompts, max_new_tokens=NEW_TOKENS)
    assert generate(single, prompts, max_new_tokens=NEW_TOKENS, layer_weights="stacked") == expected
    mesh = build_mesh(dict(fsdp=2, tp=2), jax.devices()[:4])
    _, sharded = from_hf(tmp_path, mesh=mesh)
    assert len(sharded.embed[...].sharding.device_set) == 4
    with jax.set_mesh(mesh), use_rules(DEFAULT_RULES):
        assert generate(sharded, prompts, max_new_tokens=NEW_TOKENS) == expected
        assert generate(sharded, prompts, max_new_tokens=NEW_TOKENS, layer_weights="stacked") == expected
        assert generate(sharded, prompts, max_new_tokens=NEW_TOKENS, cache_reads="all") == expected
        # The kernel has no sharding rule: XLA gives it whole operands (correct, not fast).
        assert generate(sharded, prompts, max_new_tokens=NEW_TOKENS, cache_reads="kernel") == expected
    if kind == "deepseek_v3":  # one prompt over fsdp x ep: a batch the token axes do not divide
        expected = generate(single, prompts[:1], max_new_tokens=NEW_TOKENS)
        mesh = build_mesh(dict(fsdp=2, ep=2), jax.devices()[:4])
        _, sharded = from_hf(tmp_path, mesh=mesh)
        with jax.set_mesh(mesh), use_rules(DEFAULT_RULES):
            assert generate(sharded, prompts[:1], max_new_tokens=NEW_TOKENS) == expected


@pytest.mark.parametrize("reads", ["filled", "all"])
@pytest.mark.parametrize("tokens", [1, 5])
def test_tensor_parallel_cached_attention_needs_no_collective(tokens, reads):
    """With the query and kv heads sharded over tp=2, cached attention (a decode step's one token,
    and a prefill chunk; the filled blocks looped over or every slot in one pass) compiles to a
    program without any collective: each device reads only its own kv heads' cache slots, never
    another device's."""
    from podtrain.models.layers import cached_attention

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
                                cache_used=jnp.int32(40), block=16, reads=reads)

    arrays = (queries, new_keys, new_values, key_cache, value_cache)
    shardings = tuple(heads_on_tp(a.ndim) for a in arrays)
    sharded = jax.jit(attend, in_shardings=(*shardings, None), out_shardings=heads_on_tp(4))
    hlo = sharded.lower(*arrays, jnp.int32(1)).compile().as_text()
    collectives = re.findall(r"(all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)", hlo)
    assert collectives == []
    expected = jax.jit(attend)(*arrays, jnp.int32(1))
    np.testing.assert_allclose(sharded(*arrays, jnp.int32(1)), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("layer_weights, reads", [("stacked", "filled"), ("split", "filled"), ("split", "kernel")])
def test_decode_step_updates_the_stacked_cache_in_place(layer_weights, reads):
    """A compiled decode step at max_len 4096: no copy of a whole stacked cache (the output cache
    aliases the donated input), and temporaries far below one layer's share of it; with the
    weights read from the stacks or (CPU's default) from per-layer copies picked by `lax.switch`,
    and the cache read by the block loop or (CPU's default) the C++ kernel."""
    config = TINY.replace(num_layers=4)
    model = Llama(config, rngs=nnx.Rngs(0))
    cache = model.init_cache(2, 4096, reads=reads)
    states = [split_stack(stack) for stack in model.stacks()] if layer_weights == "split" else None
    step = jax.jit(lambda m, token, cache, states: m(token, kv_cache=cache, layer_states=states), donate_argnums=2)
    compiled = step.lower(model, jnp.zeros((2, 1), jnp.int32), cache, states).compile()
    if layer_weights == "split":
        assert "conditional(" in compiled.as_text()
    assert (reads == "kernel") == ("podtrain_decode_attention" in compiled.as_text())
    cache_shape = ",".join(map(str, cache.k[0].shape))
    copies = re.findall(rf"f32\[{cache_shape}\]\S* (?:copy|fusion)\(", compiled.as_text())
    # The only full-cache-shaped results: the in-place writes of k and v (dynamic-update-slice fusions).
    assert len(copies) == 2, copies
    assert not re.search(rf"f32\[{cache_shape}\]\S* copy\(", compiled.as_text())
    memory = compiled.memory_analysis()
    cache_bytes = 2 * cache.k[0].nbytes
    assert memory.alias_size_in_bytes >= cache_bytes
    assert memory.temp_size_in_bytes < cache.k[0].nbytes // config.num_layers
    # Two steps from a prompt token: the same logits as the layers run on the stacked weights.
    tokens = jnp.asarray([[5], [9]], jnp.int32)
    logits, cache = compiled(model, tokens, cache, states)
    logits_2, _ = compiled(model, tokens + 1, cache, states)
    want, want_cache = model(tokens, kv_cache=model.init_cache(2, 4096))
    want_2, _ = model(tokens + 1, kv_cache=want_cache)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(want), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(logits_2), np.asarray(want_2), rtol=1e-5, atol=1e-5)
