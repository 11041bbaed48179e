"""The decoder layers in bfloat16: params and compute in the configured dtype, close to float32."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from model_fixtures import TINY, tokens

from podtrain.models import Llama


def test_bf16_compute_runs_and_stays_close():
    model32 = Llama(TINY, rngs=nnx.Rngs(5))
    model16 = Llama(TINY.replace(dtype="bfloat16", param_dtype="bfloat16"), rngs=nnx.Rngs(5))
    nnx.update(model16, jax.tree.map(lambda x: x.astype(jnp.bfloat16), nnx.state(model32)))
    ids = tokens(seed=5)
    out16 = model16(ids)[0]
    assert out16.dtype == jnp.bfloat16
    assert model16.layers.attn.wq[...].dtype == jnp.bfloat16
    np.testing.assert_allclose(out16.astype(jnp.float32), model32(ids)[0], atol=0.05)
