"""The causal LM loss: masked positions ignored, the chunked loss equal to the full one with its gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from model_fixtures import TINY, tokens

from podtrain.models import Llama, causal_lm_loss
from podtrain.models.loss import chunked_causal_lm_loss, sliced_target_logprobs


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


@pytest.mark.parametrize("slices", [1, 3, 8])
def test_sliced_target_logprobs_with_row_adapters_equal_the_whole_logits_and_their_gradients(slices):
    """Each row's low-rank head term `low[b] @ B[b]` included; a vocabulary of 29 that 3 and 8 do not divide."""
    rng = np.random.default_rng(3)
    h, head = (jnp.asarray(rng.normal(size=shape), jnp.float32) for shape in ((2, 5, 6), (6, 29)))
    low, b = (jnp.asarray(rng.normal(size=shape), jnp.float32) for shape in ((2, 5, 4), (2, 4, 29)))
    targets = jnp.asarray(rng.integers(0, 29, (2, 5)))
    d_lp = jnp.asarray(rng.normal(size=(2, 5)), jnp.float32)  # any upstream gradient

    def whole(h, low, b):
        logits = h @ head + jnp.einsum("btr,brv->btv", low, b)
        return jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], axis=-1)[..., 0]

    def sliced(h, low, b):
        return sliced_target_logprobs(h, head, targets, slices=slices, low_BTR=low, b_BRV=b)

    np.testing.assert_allclose(sliced(h, low, b), whole(h, low, b), rtol=1e-5, atol=1e-6)
    want = jax.grad(lambda *x: jnp.sum(whole(*x) * d_lp), argnums=(0, 1, 2))(h, low, b)
    got = jax.grad(lambda *x: jnp.sum(sliced(*x) * d_lp), argnums=(0, 1, 2))(h, low, b)
    for x, y in zip(got, want, strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)
    # Without row adapters, the head differentiated too.
    plain = jax.grad(lambda h, w: jnp.sum(sliced_target_logprobs(h, w, targets, slices=slices) * d_lp), (0, 1))

    def whole_plain(h, w):
        return jnp.take_along_axis(jax.nn.log_softmax(h @ w), targets[..., None], axis=-1)[..., 0]

    want = jax.grad(lambda h, w: jnp.sum(whole_plain(h, w) * d_lp), (0, 1))(h, head)
    for x, y in zip(plain(h, head), want, strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


def test_a_frozen_head_costs_no_backward_matmul():
    """Differentiated for `h` alone, the backward pass leaves out the head's gradient: one
    (B*T, D) x (B*T, V/n) matmul per slice fewer than with the head differentiated."""
    b, t, d, v, n = 2, 8, 16, 64, 4
    h, head = jnp.ones((b, t, d), jnp.float32), jnp.ones((d, v), jnp.float32)
    targets = jnp.zeros((b, t), jnp.int32)

    def flops(argnums):
        def loss(h, head):
            return jnp.sum(sliced_target_logprobs(h, head, targets, slices=n))

        compiled = jax.jit(jax.grad(loss, argnums)).lower(h, head).compile()
        cost = compiled.cost_analysis()
        return (cost[0] if isinstance(cost, list | tuple) else cost)["flops"]

    # cost_analysis counts a scan's body once: the difference is one slice's head gradient.
    assert flops((0, 1)) - flops(0) >= 2 * b * t * d * (v // n)
