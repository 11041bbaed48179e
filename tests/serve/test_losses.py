"""The service's losses against float64 NumPy references: each loss's value and its gradient with
respect to the target logprobs, rows of every loss in one batch; and its config checked by name."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from podtrain.orchestrator.serve.losses import NAMES, loss_config
from podtrain.orchestrator.serve.programs import token_losses
from podtrain.orchestrator.serve.work import ServeError

LOW, HIGH, BETA = 0.8, 1.2, 0.3


def _reference(name, lp, w, q, adv):
    """(elementwise loss, d loss / d lp) in float64, written from each loss's formula."""
    r = np.exp(lp - q)
    c = np.clip(r, LOW, HIGH)
    if name == "cross_entropy":
        return -w * lp, -w
    if name == "importance_sampling":
        return -r * adv, -r * adv
    if name == "ppo":
        unclipped = r * adv <= c * adv
        inside = (r > LOW) & (r < HIGH)
        return -np.minimum(r * adv, c * adv), np.where(unclipped | inside, -r * adv, 0.0)
    if name == "cispo":
        return -c * lp * adv, -c * adv
    return -(lp * adv - 0.5 * BETA * (lp - q) ** 2), -(adv - BETA * (lp - q))


def test_each_loss_and_its_gradient_match_float64_references():
    rng = np.random.default_rng(0)
    rows, tokens = 10, 7
    lp = -rng.uniform(0.1, 3.0, (rows, tokens))
    # Ratios well inside and well outside the clip range, never on its bounds.
    ratio = rng.choice([0.5, 0.9, 1.05, 1.5], (rows, tokens)) * rng.uniform(0.97, 1.03, (rows, tokens))
    q = lp - np.log(ratio)
    w = rng.uniform(0, 1, (rows, tokens))
    adv = rng.normal(size=(rows, tokens))
    index = np.arange(rows) % len(NAMES)
    low, high, beta = (np.full(rows, v, np.float32) for v in (LOW, HIGH, BETA))
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731

    def total(lp):
        return jnp.sum(token_losses(lp, f32(w), f32(q), f32(adv), jnp.asarray(index), low, high, beta))

    got_loss = np.asarray(token_losses(f32(lp), f32(w), f32(q), f32(adv), jnp.asarray(index), low, high, beta))
    got_grad = np.asarray(jax.grad(total)(f32(lp)))
    for row in range(rows):
        want_loss, want_grad = _reference(NAMES[index[row]], lp[row], w[row], q[row], adv[row])
        np.testing.assert_allclose(got_loss[row], want_loss, rtol=1e-5, atol=1e-6, err_msg=NAMES[index[row]])
        np.testing.assert_allclose(got_grad[row], want_grad, rtol=1e-5, atol=1e-6, err_msg=NAMES[index[row]])


def test_rows_without_sampling_logprobs_make_no_nans():
    lp = jnp.asarray([[-1.0, -2.0]])
    absent = jnp.asarray([[-1e4, 0.0]])  # a cross-entropy row's unused inputs
    loss = token_losses(lp, jnp.ones((1, 2)), absent, jnp.zeros((1, 2)), jnp.asarray([0]), jnp.asarray([0.8]),
                        jnp.asarray([1.2]), jnp.asarray([0.0]))
    grad = jax.grad(lambda lp: jnp.sum(token_losses(lp, jnp.ones((1, 2)), absent, jnp.zeros((1, 2)),
                                                    jnp.asarray([0]), jnp.asarray([0.8]), jnp.asarray([1.2]),
                                                    jnp.asarray([0.0]))))(lp)
    np.testing.assert_array_equal(np.asarray(loss), [[1.0, 2.0]])
    np.testing.assert_array_equal(np.asarray(grad), [[-1.0, -1.0]])


def test_loss_configs_are_checked_by_name():
    assert loss_config("ppo", None) == {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    assert loss_config("dro", {"beta": 0.1}) == {"beta": 0.1}
    for name, given, match in [("nope", None, "loss_fn: expected one of"),
                               ("gspo", None, "not supported by podtrain serve"),
                               ("ppo", {"clip": 1.0}, r"loss_fn_config.clip: ppo takes"),
                               ("ppo", {"clip_low_threshold": 1.5}, "clip_low_threshold <= clip_high_threshold"),
                               ("dro", {"beta": "x"}, "loss_fn_config.beta: expected a number"),
                               ("cross_entropy", {"beta": 1.0}, "takes no config")]:
        with pytest.raises(ServeError, match=match):
            loss_config(name, given)
