"""The train step: gradient accumulation equals the whole batch; optimizers and schedules."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from podtrain.orchestrator.common.errors import ConfigError
from podtrain.orchestrator.config.compose import load_config
from podtrain.orchestrator.train.build import build_training
from podtrain.orchestrator.train.loop import evaluate
from podtrain.orchestrator.train.optimizer import make_schedule
from podtrain.orchestrator.train.step import make_eval_step
from podtrain.orchestrator.train.synthetic import random_batch

TINY = ["model.num_layers=2", "model.hidden_size=64", "model.intermediate_size=128", "model.vocab_size=256",
        "model.head_dim=16", "train.batch_size=8", "train.seq_len=16", "mesh.fsdp=2", "mesh.tp=2", "mesh.ep=2"]


def run_steps(overrides, steps=2, same_batch=False):
    keys = {o.split("=")[0] for o in overrides}
    training = build_training(load_config("llama3-tiny", [o for o in TINY if o.split("=")[0] not in keys] + overrides))
    state = training.init_state()
    losses = []
    for i in range(steps):
        batch = random_batch(training, seed=0 if same_batch else i)
        batch["weights"] = batch["weights"].at[0, 5:].set(0.0)  # uneven token counts per micro-batch
        state, metrics = training.step(state, batch)
        losses.append(float(metrics["loss"]))
    return losses, state


@pytest.mark.slow
def test_grad_accumulation_equals_full_batch():
    # Plain SGD: the params after a step are the params minus lr times the gradients.
    sgd = ["optimizer.name=sgd", "optimizer.momentum=0", "optimizer.weight_decay=0", "optimizer.schedule=constant",
           "optimizer.learning_rate=1.0", "optimizer.grad_clip=1e9"]
    full_losses, full = run_steps(sgd)
    accum_losses, accum = run_steps(sgd + ["train.grad_accum=2"])  # micro-batches of 4 rows on 4 batch shards
    np.testing.assert_allclose(accum_losses, full_losses, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(accum.params), jax.tree.leaves(full.params), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("extra", [[], ["model.vocab_size=250", "model.tie_word_embeddings=true"]])
def test_chunked_loss_on_a_sharded_mesh_equals_the_whole_loss(extra):
    """fsdp x tp x ep: the loss over 4 vocabulary slices (the head sharded over fsdp and tp; 250 ids
    need 2 padding columns, the tied embedding is the head) gives the same step as the whole logits."""
    sgd = ["optimizer.name=sgd", "optimizer.momentum=0", "optimizer.weight_decay=0", "optimizer.schedule=constant",
           "optimizer.learning_rate=1.0", "optimizer.grad_clip=1e9"]
    full_losses, full = run_steps(sgd + extra)
    chunked_losses, chunked = run_steps(sgd + extra + ["train.loss_chunk=4"])
    np.testing.assert_allclose(chunked_losses, full_losses, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(chunked.params), jax.tree.leaves(full.params), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("name", ["sgd", "adafactor"])
def test_other_optimizers_train(name):
    losses, _ = run_steps([f"optimizer.name={name}", "optimizer.learning_rate=0.05", "optimizer.schedule=constant"],
                          steps=3, same_batch=True)
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]


def test_schedules():
    config = load_config("llama3-tiny", ["optimizer.warmup_steps=10", "train.steps=110", "optimizer.min_lr_ratio=0.1"])
    cosine = make_schedule(config.optimizer, 110)
    assert float(cosine(0)) == 0.0 and float(cosine(10)) == pytest.approx(3e-4)
    assert float(cosine(110)) == pytest.approx(3e-5, rel=1e-3)
    linear = make_schedule(config.optimizer.__class__(schedule="linear", warmup_steps=10), 110)
    assert float(linear(60)) == pytest.approx((3e-4 + 3e-5) / 2, rel=1e-3)
    constant = make_schedule(config.optimizer.__class__(schedule="constant"), 110)
    assert float(constant(50)) == pytest.approx(3e-4)


@pytest.mark.slow
def test_eval_loss_equals_the_train_steps_loss_on_an_expert_parallel_mesh():
    """The eval runs under the mesh and rule table as the train step does: with experts over ep=2 and
    a capacity that drops tokens, the same params and batch give the same loss."""
    config = load_config("deepseek-v3-tiny", ["model.num_layers=2", "train.batch_size=8", "train.seq_len=16",
                                              "mesh.fsdp=4", "mesh.ep=2", "model.moe.capacity_factor=1.0"])
    training = build_training(config)
    state = training.init_state()
    batch = random_batch(training, seed=0)
    local = {k: np.asarray(v) for k, v in batch.items()}
    eval_step = jax.jit(make_eval_step(training.graphdef))
    evaluated = evaluate(training, eval_step, [local], state.params, num_batches=1)
    _, metrics = training.step(state, batch)
    np.testing.assert_allclose(evaluated, float(metrics["loss"]), rtol=1e-5)


@pytest.mark.parametrize("override, needle", [
    ("train.grad_accum=3", "must be >= 1 and divide train.batch_size=8"),
    ("optimizer.name=lion", "optimizer.name: expected one of"),
    ("optimizer.schedule=step", "optimizer.schedule: expected one of"),
])
def test_bad_optimizer_settings(override, needle):
    with pytest.raises(ConfigError, match=None) as info:
        load_config("llama3-tiny", [override])
    assert needle in str(info.value)


def test_micro_batches_must_shard_like_the_batch():
    with pytest.raises(ConfigError, match=r"the micro-batch of train.batch_size / train.grad_accum=4: dimension 0 "
                                          r"\('batch', size 2\) is not divisible by mesh axes \['fsdp', 'ep'\]"):
        build_training(load_config("llama3-tiny", TINY + ["train.grad_accum=4"]))


@pytest.mark.slow
def test_chunked_loss_in_bfloat16_is_as_exact_as_the_unchunked_loss():
    """bfloat16 compute, float32 params, the loss in 128 vocabulary slices: each column of the head's
    gradient comes from one matmul over all tokens, as unchunked, so its error against float32 is
    the unchunked loss's up to rounding (a sum over 128 chunks in bfloat16 would be 4x worse)."""
    from model_fixtures import TINY

    from podtrain.models import Llama

    config = TINY.replace(num_layers=1, vocab_size=512, max_position_embeddings=4096)
    graphdef, params = nnx.split(Llama(config.replace(dtype="bfloat16"), rngs=nnx.Rngs(0)))
    graphdef32, _ = nnx.split(Llama(config, rngs=nnx.Rngs(0)))
    ids = np.minimum(np.random.default_rng(0).zipf(1.3, (1, 2049)) - 1, 511).astype(np.int32)  # text-like
    batch = {"inputs": jnp.asarray(ids[:, :-1]), "targets": jnp.asarray(ids[:, 1:]), "weights": jnp.ones((1, 2048))}

    def head_grad(graphdef, chunk):
        step = make_eval_step(graphdef, loss_chunk=chunk)
        grads = jax.grad(lambda p: step(p, batch)[0])(params)
        return np.asarray((grads["lm_head"] if "lm_head" in grads else grads["embed"])[...], np.float64)

    exact = head_grad(graphdef32, 0)

    def error(grad):
        return np.linalg.norm(grad - exact) / np.linalg.norm(exact)

    assert error(head_grad(graphdef, 16)) <= 1.01 * error(head_grad(graphdef, 0))
