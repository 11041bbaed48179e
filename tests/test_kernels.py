"""The C++ decode-attention kernel (`models.kernels`): its results, its threads, its build."""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from podtrain.models import kernels


def _problem(rng, *, batch, layers, length, kv_heads, group, dims, value_dim, used):
    normal = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    queries = [normal(batch, kv_heads, group, d) for d in dims]
    new_keys = [normal(batch, kv_heads, d) for d in dims]
    new_values = normal(batch, kv_heads, value_dim)
    key_caches = [normal(layers, batch, length, kv_heads, d) for d in dims]
    value_cache = normal(layers, batch, length, kv_heads, value_dim)
    slots = np.arange(length)
    filled = np.array([used, used // 2, used, 0, 0][:batch])
    cache_positions = np.where(slots[None] < filled[:, None], slots[None], -1).astype(np.int32)
    cache_positions[0, 2:used:5] = -1  # padding inside row 0's prompt
    positions = np.maximum(filled, 1).astype(np.int32)
    positions[2] = used // 3  # row 2 attends only to slots holding positions up to its own
    attended = np.array([True, False, True, True, False][:batch])  # row 1: a padding token; row 4: nothing at all
    return queries, new_keys, new_values, key_caches, value_cache, cache_positions, positions, attended


def _expected(queries, new_keys, new_values, key_caches, value_cache, cache_positions, positions, attended, layer,
              used):
    """Numpy: the softmax over the new token (where attended) and the qualifying slots, applied to the values."""
    scores = sum(np.einsum("bkgd,bskd->bkgs", q, c[layer]) for q, c in zip(queries, key_caches, strict=True))
    own = sum(np.einsum("bkgd,bkd->bkg", q, n) for q, n in zip(queries, new_keys, strict=True))
    scores = np.concatenate([scores, own[..., None]], axis=-1)
    values = np.concatenate([value_cache[layer], new_values[:, None]], axis=1)
    slots = np.arange(value_cache.shape[2])
    valid = (cache_positions >= 0) & (cache_positions <= positions[:, None]) & (slots < used)[None]
    valid = np.concatenate([valid, attended[:, None]], axis=-1)
    scores = np.where(valid[:, None, None], scores, -np.inf)
    top = scores.max(-1, keepdims=True)
    probs = np.where(valid[:, None, None], np.exp(scores - np.where(np.isinf(top), 0, top)), 0)
    total = probs.sum(-1, keepdims=True)
    return np.einsum("bkgs,bske->bkge", probs / np.where(total > 0, total, 1), values)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kv_heads, group, dims, value_dim, length, used", [
    (4, 2, (32,), 32, 128, 100),  # the benchmark's GQA layout, 16-float vectors throughout
    (2, 3, (16,), 16, 40, 37),  # the last chunk of 16 slots would pass the cache's end
    (2, 2, (16,), 16, 40, 37),  # the same with queries taken in pairs (an even group)
    (1, 8, (32, 16), 32, 48, 45),  # MLA: two key parts, the latent also the value
    (2, 2, (24,), 12, 20, 20),  # dims that are not whole vectors
    (2, 2, (16,), 16, 32, 0),  # nothing filled: only the new tokens themselves
])
def test_decode_attention_matches_a_numpy_softmax(threads, kv_heads, group, dims, value_dim, length, used):
    """The attention of one new token per row to itself and to the qualifying slots (filled, below
    `cache_used`, holding a position in [0, the new token's]) equals numpy's, for GQA and MLA
    shapes, rows with padding slots, a cut-off position, a padding new token, nothing filled;
    zeros for a row with nothing to attend to."""
    rng = np.random.default_rng(11)
    problem = _problem(rng, batch=5, layers=3, length=length, kv_heads=kv_heads, group=group, dims=dims,
                       value_dim=value_dim, used=used)
    queries, new_keys, new_values, key_caches, value_cache, cache_positions, positions, attended = problem
    if len(dims) == 2:  # MLA reads its latent as the values
        value_cache, new_values = key_caches[0], new_keys[0]

    def run(queries, new_keys, new_values, key_caches, value_cache, cache_positions, positions, attended, layer):
        return kernels.decode_attention(queries, new_keys, new_values, key_caches, value_cache, layer=layer,
                                        positions_B=positions, attended_B=attended, cache_positions_BS=cache_positions,
                                        cache_used=used, threads=threads)

    got = np.asarray(jax.jit(run)(queries, new_keys, new_values, key_caches, value_cache, cache_positions, positions,
                                  attended, 1))
    expected = _expected(queries, new_keys, new_values, key_caches, value_cache, cache_positions, positions, attended,
                         1, used)
    assert got.shape == expected.shape == (5, kv_heads, group, value_dim)
    np.testing.assert_allclose(got, expected, rtol=2e-5, atol=2e-6)
    assert not np.any(got[4])  # row 4: a padding token with nothing before it


def test_decode_attention_rejects_other_dtypes_and_part_counts():
    cache = jnp.zeros((2, 1, 16, 1, 16), jnp.bfloat16)
    query, new = jnp.zeros((1, 1, 2, 16), jnp.bfloat16), jnp.zeros((1, 1, 16), jnp.bfloat16)
    args = dict(layer=0, positions_B=jnp.zeros((1,), jnp.int32), attended_B=jnp.ones((1,), bool),
                cache_positions_BS=jnp.zeros((1, 16), jnp.int32), cache_used=1)
    with pytest.raises(ValueError, match=r"expected float32 queries, keys, values and caches, found \['bfloat16'\]"):
        kernels.decode_attention([query], [new], new, [cache], cache, **args)
    with pytest.raises(ValueError, match="expected 1 to 4 .* found 2 queries, 1 new keys and 1 key caches"):
        kernels.decode_attention([query, query], [new], new, [cache], cache, **args)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows, depth, width", [
    (4, 256, 1024), (1, 256, 100), (7, 1024, 256), (3, 32, 200), (8, 64, 64),
])
def test_matmul_matches_numpy(threads, rows, depth, width):
    """A few rows times a weight: groups of 4 rows and fewer, widths with and without a partial
    64-column tile and task, one and two threads."""
    rng = np.random.default_rng(rows + width)
    x = rng.standard_normal((rows, depth)).astype(np.float32)
    w = rng.standard_normal((depth, width)).astype(np.float32)
    got = np.asarray(jax.jit(lambda x, w: kernels.matmul(x, w, threads=threads))(x, w))
    np.testing.assert_allclose(got, x.astype(np.float64) @ w, rtol=1e-5, atol=1e-4)


def test_matmul_rejects_other_dtypes_and_shapes():
    with pytest.raises(ValueError, match=r"expected float32 x \(M, K\) and w \(K, N\), found bfloat16\[2, 8\]"):
        kernels.matmul(jnp.zeros((2, 8), jnp.bfloat16), jnp.zeros((8, 4), jnp.float32))
    with pytest.raises(ValueError, match=r"found float32\[2, 8\] and float32\[9, 4\]"):
        kernels.matmul(jnp.zeros((2, 8)), jnp.zeros((9, 4)))


def test_dense_uses_the_matmul_kernel_only_for_a_few_float32_rows_inside_small_matmuls():
    """`models.layers.dense` sends a product to the kernel inside `small_matmuls()` when it has at
    most SMALL_MATMUL_ROWS rows and is float32; the result equals XLA's."""
    from podtrain.models.layers import dense

    rng = np.random.default_rng(5)
    w = jnp.asarray(rng.standard_normal((16, 4, 8)).astype(np.float32))

    def program(x, w, inside, n_in=1):
        with kernels.small_matmuls() if inside else contextlib.nullcontext():
            return jax.jit(lambda x, w: dense(x, w, n_in)).lower(x, w).compile().as_text()

    few = jnp.asarray(rng.standard_normal((2, 1, 16)).astype(np.float32))
    many = jnp.asarray(rng.standard_normal((3, 3, 16)).astype(np.float32))  # 9 rows
    assert "podtrain_decode_matmul" in program(few, w, inside=True)
    assert "podtrain_decode_matmul" not in program(few, w, inside=False)
    assert "podtrain_decode_matmul" not in program(many, w, inside=True)
    assert "podtrain_decode_matmul" not in program(few.astype(jnp.bfloat16), w.astype(jnp.bfloat16), inside=True)
    with kernels.small_matmuls():
        got = jax.jit(dense)(few, w)
    np.testing.assert_allclose(np.asarray(got), np.asarray(dense(few, w)), rtol=1e-5, atol=1e-5)
    assert got.shape == (2, 1, 4, 8)


def test_build_is_cached_and_a_failed_build_leaves_nothing(tmp_path, monkeypatch):
    """The library is built once per (source, flags, compiler, jaxlib, CPU) into the cache
    directory and reused; a source that does not compile raises an error naming the file and the
    compiler's message, and leaves no library behind; no compiler: an error naming it."""
    monkeypatch.setenv("PODTRAIN_KERNEL_CACHE", str(tmp_path / "built"))
    library = kernels._build()
    assert library.parent == tmp_path / "built" and library.suffix == ".so"
    built_at = library.stat().st_mtime_ns
    assert kernels._build() == library and library.stat().st_mtime_ns == built_at
    broken = tmp_path / "broken.cc"
    broken.write_text("this is not C++;\n")
    monkeypatch.setattr(kernels, "SOURCES", (broken,))
    with pytest.raises(RuntimeError, match=r"(?s)building broken\.cc failed .*error"):
        kernels._build()
    assert sorted(p.name for p in (tmp_path / "built").iterdir()) == [library.name]
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with pytest.raises(RuntimeError, match="no working C\\+\\+ compiler .*no-such-compiler.*set \\$CXX"):
        kernels._build()
