"""The layer runner: layers stacked at creation, remat policies, scan against a plain layer loop."""

import jax
import numpy as np
import pytest
from flax import nnx
from model_fixtures import QWEN, TINY, tokens

from podtrain.models import Llama, causal_lm_loss
from podtrain.models.runner import REMAT


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
    pytest.param(TINY, tuple(REMAT), id="llama"),
    pytest.param(QWEN, ("none", "save_attn_out", "save_qkv_attn_out"), id="qwen3", marks=pytest.mark.slow),
])
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
