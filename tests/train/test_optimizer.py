"""The optimizers: `optimizer.grad_clip` (a global norm, or 0 for no clipping) and weight decay."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from podtrain.orchestrator.config.schema import OptimizerConfig
from podtrain.orchestrator.train.optimizer import make_optimizer

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


@pytest.mark.parametrize("name", ["adamw", "sgd", "adafactor"])
def test_weight_decay_is_lr_times_decay_on_matrices_and_spares_norms_and_biases(name):
    """With zero gradients an update is the decay alone: -lr * weight_decay * w on every matrix
    (embedding included), nothing on norm scales and biases. The params are an nnx.State, as in a
    train step, whose leaves sit under `.value`."""
    from flax import nnx

    class Block(nnx.Module):
        def __init__(self):
            self.embed = nnx.Param(jnp.ones((256, 128)))
            self.w_up = nnx.Param(jnp.ones((128, 256)))
            self.b_up = nnx.Param(jnp.ones(256))
            self.norm = nnx.Module()
            self.norm.scale = nnx.Param(jnp.ones(128))
            self.router_bias = nnx.Param(jnp.ones(8))

    params = nnx.state(Block(), nnx.Param)
    lr, decay = 1e-3, 0.1
    tx = make_optimizer(OptimizerConfig(name=name, weight_decay=decay, momentum=0.0), optax.constant_schedule(lr))
    grads = jax.tree.map(jnp.zeros_like, params)
    updates = dict(nnx.to_flat_state(tx.update(grads, tx.init(params), params)[0]))
    for path, update in updates.items():
        value = np.asarray(update.get_value())
        want = -lr * decay if path[-1] in ("embed", "w_up") else 0.0
        np.testing.assert_allclose(value, np.full(value.shape, want), rtol=1e-5, atol=1e-12, err_msg=str(path))
