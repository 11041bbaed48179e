"""`optimizer.grad_clip`: a global norm to clip to, or 0 for no clipping."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from orchestrator.config import OptimizerConfig
from orchestrator.step import make_optimizer

PLAIN_SGD = dict(name="sgd", momentum=0.0, weight_decay=0.0)


@pytest.mark.parametrize("grad_clip, expected", [(0.0, -2.0), (1.0, -0.5), (1e9, -2.0)])
def test_grad_clip_zero_means_no_clipping(grad_clip, expected):
    tx = make_optimizer(OptimizerConfig(**PLAIN_SGD, grad_clip=grad_clip), optax.constant_schedule(1.0))
    params = {"w": jnp.zeros(4)}
    grads = {"w": jnp.full(4, 2.0)}  # global norm 4
    updates, _ = tx.update(grads, tx.init(params), params)
    np.testing.assert_allclose(updates["w"], np.full(4, expected))


def test_grad_clip_zero_keeps_the_optimizer_state_structure():
    """A checkpoint trained with clipping resumes without it, and the other way round."""
    params = {"w": jnp.zeros(4)}
    states = [make_optimizer(OptimizerConfig(grad_clip=clip), optax.constant_schedule(1.0)).init(params)
              for clip in (0.0, 1.0)]
    assert jax.tree.structure(states[0]) == jax.tree.structure(states[1])
