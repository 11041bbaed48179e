"""The stacked model: remat policies, scan vs loop, cache, masks, sharded vs single device."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from podtrain.models import KVCache, Llama, ModelConfig, RopeConfig, causal_lm_loss
from podtrain.models.loss import chunked_causal_lm_loss
from podtrain.models.runner import REMAT, only_layer
from podtrain.sharding import DEFAULT_RULES, build_mesh, create_sharded, use_rules

TINY = ModelConfig(
    vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=24,
    rope=RopeConfig(rope_type="llama3", theta=500000.0, factor=8.0, original_max_position_embeddings=64),
)
QWEN = TINY.replace(model_type="qwen3", qk_norm=True, attention_bias=True, mlp_bias=True, tie_word_embeddings=True)


def tokens(batch=2, seq=12, seed=0, vocab=97):
    return jnp.asarray(np.random.default_rng(seed).integers(0, vocab, (batch, seq)), jnp.int32)


def loss_and_grads(model, ids):
    graphdef, params = nnx.split(model)

    def loss(params):
        logits, _, _ = nnx.merge(graphdef, params)(ids[:, :-1])
        return causal_lm_loss(logits, ids[:, 1:])[0]

    return jax.jit(jax.value_and_grad(loss))(params)


def test_layers_are_stacked_at_creation():
    model = Llama(TINY, rngs=nnx.Rngs(0))
    shapes = {".".join(map(str, p)): v.shape for p, v in nnx.to_flat_state(nnx.state(model))}
    assert shapes["layers.attn.wq"] == (3, 64, 4, 24)
    assert shapes["layers.mlp.w_down"] == (3, 96, 64)
    assert shapes["layers.input_norm.scale"] == (3, 64)
    # Every layer got its own random draw.
    wq = np.asarray(model.layers.attn.wq[...])
    assert not np.allclose(wq[0], wq[1])


# Every policy on Llama; on Qwen3 (q/k norms and biases between the named projections) the
# policies that save names.
@pytest.mark.parametrize("config, policies", [
    (TINY, tuple(REMAT)), (QWEN, ("none", "save_attn_out", "save_qkv_attn_out")),
], ids=["llama", "qwen3"])
def test_remat_policies_give_equal_logits_and_gradients(config, policies):
    ids = tokens()
    reference = None
    for policy in policies:
        model = Llama(config.replace(remat=policy), rngs=nnx.Rngs(0))
        loss, grads = loss_and_grads(model, ids)
        if reference is None:
            reference = (loss, grads)
            continue
        np.testing.assert_allclose(loss, reference[0], rtol=1e-6, err_msg=policy)
        for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(reference[1]), strict=True):
            np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-7, err_msg=policy)


@pytest.mark.parametrize("remat", ["none", "full"])
def test_scan_equals_plain_layer_loop(remat):
    scanned_model = Llama(QWEN.replace(remat=remat), rngs=nnx.Rngs(1))
    loop_model = Llama(QWEN.replace(remat=remat, scan_layers=False), rngs=nnx.Rngs(1))
    ids = tokens(seed=1)
    forward = jax.jit(lambda m, x: m(x)[0])
    np.testing.assert_allclose(forward(scanned_model, ids), forward(loop_model, ids), rtol=1e-5, atol=1e-6)
    scanned, loop = loss_and_grads(scanned_model, ids), loss_and_grads(loop_model, ids)
    np.testing.assert_allclose(scanned[0], loop[0], rtol=1e-6)
    for a, b in zip(jax.tree.leaves(scanned[1]), jax.tree.leaves(loop[1]), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_cached_decode_equals_full_forward():
    """Right-padded prompts of different lengths prefilled together, then one token at a time from
    each row's own position: every step's logits equal the full forward over that row's sequence."""
    model = Llama(TINY, rngs=nnx.Rngs(2))
    lengths = np.array([6, 3])
    ids = np.asarray(tokens(seq=10, seed=2))
    prompts = np.where(np.arange(6)[None] < lengths[:, None], ids[:, :6], 0)
    cache = model.init_cache(batch=2, max_len=16)
    assert isinstance(cache, KVCache) and cache.k[0].shape == (3, 2, 16, 2, 24)
    run = jax.jit(lambda m, ids, positions, mask, cache: m(ids, positions, cache=cache, attention_mask=mask)[:2])
    logits, cache = run(model, prompts, np.broadcast_to(np.arange(6), (2, 6)), np.arange(6)[None] < lengths[:, None],
                        cache)
    steps = [logits[np.arange(2), lengths - 1]]
    for t in range(4):
        # Row r continues with its own tokens ids[r, lengths[r] + t], at position lengths[r] + t.
        step_ids = ids[np.arange(2), lengths + t][:, None]
        logits, cache = run(model, step_ids, (lengths + t)[:, None], np.ones((2, 1), bool), cache)
        steps.append(logits[:, 0])
    full = jax.jit(lambda m, x: m(x)[0])(model, jnp.asarray(ids))
    for row in range(2):
        got = np.stack([step[row] for step in steps])
        np.testing.assert_allclose(got, full[row, lengths[row] - 1: lengths[row] + 4], rtol=1e-5, atol=1e-5)
    assert int(cache.index) == 10


@pytest.mark.parametrize("kv_heads, group, dims, length, block, used", [
    (2, 4, (16,), 40, 16, 37),  # three blocks, the last one overlapping the second
    (4, 2, (32,), 128, 128, 64),  # one block (the benchmark's layout)
    (1, 8, (24, 8), 24, 8, 24),  # MLA: one latent "head", two key parts, every slot filled
    (1, 4, (32, 16), 48, 16, 45),  # MLA with wider key parts, the last block partly filled
    (2, 2, (8,), 16, 8, 0),  # an empty cache: only the token itself
])
def test_one_token_cached_attention_equals_a_dense_softmax(kv_heads, group, dims, length, block, used):
    """`cached_attention` of one new token (a decode step) against a plain masked softmax over
    the layer's filled slots and the token itself: rows of different lengths, a padding token
    (key position -1, which still attends but is not attended to), GQA and MLA's two key parts."""
    from podtrain.models.attention import cached_attention

    rng = np.random.default_rng(7)
    batch, layers, layer, e = 3, 3, 1, dims[0]
    heads = kv_heads * group
    normal = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    queries = [normal(batch, 1, heads, d) for d in dims]
    new_keys = [normal(batch, 1, kv_heads, d) for d in dims]
    new_values = normal(batch, 1, kv_heads, e)
    key_caches = [normal(layers, batch, length, kv_heads, d) for d in dims]
    value_cache = normal(layers, batch, length, kv_heads, e)
    filled = np.array([used, used // 2, used])  # slots each row has written
    slots = np.arange(length)
    cache_positions = np.where(slots[None] < filled[:, None], slots[None], -1).astype(np.int32)
    cache_positions[2, 1:used:3] = -1  # padding slots inside row 2's prompt
    positions = filled[:, None].astype(np.int32)
    key_positions = positions.copy()
    key_positions[1] = -1  # row 1's new token is padding
    as_jax = lambda arrays: [jnp.asarray(a) for a in arrays]  # noqa: E731
    got = cached_attention(as_jax(queries), as_jax(new_keys), jnp.asarray(new_values), as_jax(key_caches),
                           jnp.asarray(value_cache), layer=layer, positions_BT=jnp.asarray(positions),
                           key_positions_BT=jnp.asarray(key_positions), cache_positions_BS=jnp.asarray(cache_positions),
                           cache_used=jnp.int32(used), block=block)
    assert got.shape == (batch, 1, heads, e)
    for row in range(batch):
        for head in range(heads):
            kv = head // group
            keys = [np.concatenate([cache[layer, row, :, kv], new[row, :, kv]])
                    for cache, new in zip(key_caches, new_keys, strict=True)]
            values = np.concatenate([value_cache[layer, row, :, kv], new_values[row, :, kv]])
            scores = sum(key @ q[row, 0, head] for key, q in zip(keys, queries, strict=True))
            attended = np.append((cache_positions[row] >= 0) & (slots < used), key_positions[row, 0] >= 0)
            if not attended.any():  # a padding token with nothing before it: zeros, not NaN
                np.testing.assert_array_equal(got[row, 0, head], 0.0)
                continue
            probs = np.where(attended, np.exp(scores - scores[attended].max()), 0.0)
            np.testing.assert_allclose(got[row, 0, head], probs @ values / probs.sum(), rtol=1e-5, atol=1e-5)


def test_padding_and_segments_do_not_leak():
    model = Llama(TINY, rngs=nnx.Rngs(3))
    ids = tokens(batch=1, seq=8, seed=3)
    other = ids.at[:, :4].set((ids[:, :4] + 1) % 97)
    segments = jnp.asarray([[1, 1, 1, 1, 2, 2, 2, 2]])
    positions = jnp.asarray([[0, 1, 2, 3, 0, 1, 2, 3]])
    a = model(ids, positions=positions, segment_ids=segments)[0]
    b = model(other, positions=positions, segment_ids=segments)[0]
    np.testing.assert_allclose(a[:, 4:], b[:, 4:], rtol=1e-6, atol=1e-6)
    assert not np.allclose(a[:, :4], b[:, :4])
    # Right padding: real positions are unaffected by what the padding holds.
    mask = jnp.asarray([[1, 1, 1, 1, 1, 0, 0, 0]])
    pad_a = model(ids, attention_mask=mask)[0]
    pad_b = model(ids.at[:, 5:].set(0), attention_mask=mask)[0]
    np.testing.assert_allclose(pad_a[:, :5], pad_b[:, :5], rtol=1e-6, atol=1e-6)
    assert np.all(np.isfinite(pad_a))


def test_loss_ignores_masked_positions():
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(1, 4, 5)), jnp.float32)
    targets = jnp.asarray([[1, 2, 3, 4]])
    weights = jnp.asarray([[1, 1, 0, 0]])
    loss, count = causal_lm_loss(logits, targets, weights)
    expected = -jnp.mean(jax.nn.log_softmax(logits[0, :2])[jnp.arange(2), targets[0, :2]])
    np.testing.assert_allclose(loss, expected, rtol=1e-6)
    assert int(count) == 2
    loss_bf16, _ = causal_lm_loss(logits.astype(jnp.bfloat16), targets, weights)
    assert loss_bf16.dtype == jnp.float32
    # Ignored positions may hold any target (transformers' -100, or the vocab size): still the same loss.
    outside = jnp.asarray([[1, 2, -100, 5]])
    np.testing.assert_allclose(causal_lm_loss(logits, outside, weights)[0], expected, rtol=1e-6)
    h, head = logits, jnp.eye(5, dtype=jnp.float32)  # h @ head = logits: the chunked loss too
    np.testing.assert_allclose(chunked_causal_lm_loss(h, head, outside, weights, chunk=2)[0], expected, rtol=1e-6)


@pytest.mark.parametrize("sizes", [dict(fsdp=8), dict(fsdp=2, tp=2, ep=2), dict(dp=2, fsdp=2, tp=2)])
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


def test_bf16_compute_runs_and_stays_close():
    model32 = Llama(TINY, rngs=nnx.Rngs(5))
    model16 = Llama(TINY.replace(dtype="bfloat16", param_dtype="bfloat16"), rngs=nnx.Rngs(5))
    nnx.update(model16, jax.tree.map(lambda x: x.astype(jnp.bfloat16), nnx.state(model32)))
    ids = tokens(seed=5)
    out16 = model16(ids)[0]
    assert out16.dtype == jnp.bfloat16
    assert model16.layers.attn.wq[...].dtype == jnp.bfloat16
    np.testing.assert_allclose(out16.astype(jnp.float32), model32(ids)[0], atol=0.05)


def test_chunked_loss_equals_full_loss_and_gradients():
    model = Llama(TINY.replace(tie_word_embeddings=True), rngs=nnx.Rngs(6))
    ids = tokens(batch=2, seq=17, seed=6)
    weights = jnp.ones((2, 16)).at[1, 10:].set(0)
    graphdef, params = nnx.split(model)

    def full(params):
        m = nnx.merge(graphdef, params)
        return causal_lm_loss(m(ids[:, :-1])[0], ids[:, 1:], weights)[0]

    def chunked(params):
        m = nnx.merge(graphdef, params)
        h, _, _ = m.hidden_states(ids[:, :-1])
        return chunked_causal_lm_loss(h, m.head(stored=True), ids[:, 1:], weights, chunk=4)[0]

    (a, ga), (b, gb) = jax.value_and_grad(full)(params), jax.value_and_grad(chunked)(params)
    np.testing.assert_allclose(a, b, rtol=1e-6)
    for x, y in zip(jax.tree.leaves(ga), jax.tree.leaves(gb), strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="must divide the sequence length 16"):
        chunked_causal_lm_loss(jnp.zeros((1, 16, 64)), jnp.zeros((64, 97)), ids[:1, 1:], chunk=5)
