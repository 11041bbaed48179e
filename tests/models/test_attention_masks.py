"""The attention mask: packed segments and right padding do not leak into other tokens."""

import jax.numpy as jnp
import numpy as np
from flax import nnx
from model_fixtures import TINY, tokens

from podtrain.models import Llama


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
