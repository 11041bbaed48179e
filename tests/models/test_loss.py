"""The causal LM loss: masked positions ignored, the chunked loss equal to the full one with its gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from model_fixtures import TINY, tokens

from podtrain.models import Llama, causal_lm_loss
from podtrain.models.loss import chunked_causal_lm_loss


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
