"""Attention to the stacked KV cache: cached decode equals the full forward, one token against a dense softmax."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from model_fixtures import TINY, tokens

from podtrain.models import KVCache, Llama


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
