"""The attention backends: splash (Pallas, interpreted on CPU) against the XLA reference, the one
place `auto` is resolved, and the inputs a backend cannot take."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from podtrain.models.attention import make_mask, self_attention
from podtrain.models.kernels.attention import resolve_backend
from podtrain.orchestrator.common.errors import ConfigError
from podtrain.orchestrator.config.compose import load_config
from podtrain.orchestrator.placed.kernels import resolve_kernels
from podtrain.orchestrator.train.build import build_training
from podtrain.orchestrator.train.step import TrainState
from podtrain.sharding.rules import use_rules

pytestmark = pytest.mark.slow


def packed(batch, length, seed=0):
    """Segment ids and positions of rows packing documents of random lengths."""
    rng = np.random.default_rng(seed)
    segments = np.zeros((batch, length), np.int32)
    positions = np.zeros((batch, length), np.int32)
    for row in range(batch):
        start, segment = 0, 1
        while start < length:
            end = min(length, start + int(rng.integers(1, length // 2)))
            segments[row, start:end], positions[row, start:end] = segment, np.arange(end - start)
            start, segment = end, segment + 1
    return jnp.asarray(segments), jnp.asarray(positions)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (4, 1)])
def test_splash_equals_the_xla_reference_with_causal_segments_and_gqa(heads, kv_heads):
    b, t, d = 2, 256, 128
    rng = np.random.default_rng(heads * 10 + kv_heads)
    q = jnp.asarray(rng.normal(size=(b, t, heads, d)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(b, t, kv_heads, d)), jnp.float32) for _ in range(2))
    cotangent = jnp.asarray(rng.normal(size=(b, t, heads, d)), jnp.float32)
    segments, positions = packed(b, t)

    def loss(backend, q, k, v):
        out = self_attention(q, k, v, make_mask(backend, positions, positions, segments, interpret=True), scale=d**-0.5)
        return jnp.sum(out * cotangent), out

    grads = {}
    for backend in ("xla", "splash"):
        grads[backend] = jax.jit(jax.grad(lambda *a, backend=backend: loss(backend, *a), argnums=(0, 1, 2),
                                          has_aux=True))(q, k, v)
    (ref_grads, ref_out), (got_grads, got_out) = grads["xla"], grads["splash"]
    np.testing.assert_allclose(got_out, ref_out, rtol=1e-5, atol=1e-5)
    for got, ref in zip(got_grads, ref_grads, strict=True):
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)


def one_step(attention_backend):
    overrides = ["model.num_layers=2", "model.hidden_size=64", "model.intermediate_size=128", "model.vocab_size=256",
                 "model.num_heads=4", "model.num_kv_heads=2", "model.head_dim=128", "train.batch_size=4",
                 "train.seq_len=128", "mesh.fsdp=2", "mesh.tp=2", "mesh.dp=2", "optimizer.name=sgd",
                 "optimizer.momentum=0", "optimizer.weight_decay=0", "optimizer.schedule=constant",
                 "optimizer.learning_rate=1.0", "optimizer.grad_clip=1e9", f"model.attention={attention_backend}"]
    training = build_training(load_config("llama3-tiny", overrides))
    assert training.config.model.attention == attention_backend
    state = training.init_state()
    t = training.config.train
    segments, positions = packed(t.batch_size, t.seq_len, seed=1)
    tokens = np.random.default_rng(0).integers(0, 256, (t.batch_size, t.seq_len + 1), dtype=np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "weights": np.ones((t.batch_size, t.seq_len),
             np.float32), "positions": np.asarray(positions), "segment_ids": np.asarray(segments)}
    batch = {k: jax.device_put(v, training.batch_sharding) for k, v in batch.items()}
    before = jax.tree.map(np.asarray, state.params)  # the step donates the state
    new_state, metrics = training.step(state, batch)
    return float(metrics["loss"]), before, new_state


def test_a_sharded_train_step_with_splash_equals_xla():
    # dp 2 x fsdp 2 x tp 2: the kernel runs per device on its batch rows and heads (shard_map).
    ref_loss, before, ref = one_step("xla")
    got_loss, _, got = one_step("splash")
    assert got_loss == pytest.approx(ref_loss, rel=1e-6)
    updates = [(a - b, c - b) for a, b, c in zip(jax.tree.leaves(got.params), jax.tree.leaves(before),
                                                  jax.tree.leaves(ref.params), strict=True)]
    assert any(float(jnp.max(jnp.abs(r))) > 0 for _, r in updates)
    for got_update, ref_update in updates:
        np.testing.assert_allclose(got_update, ref_update, rtol=1e-4, atol=1e-6)
    assert isinstance(got, TrainState)


def test_auto_picks_the_kernel_of_the_platform_in_one_place():
    assert resolve_backend("auto", "tpu") == "splash"
    assert resolve_backend("auto", "gpu", "bfloat16") == "cudnn"
    assert resolve_backend("auto", "gpu", "float32") == "xla"
    assert resolve_backend("auto", "cpu") == "xla"
    assert resolve_backend("xla", "tpu") == "xla"
    config = load_config("llama3-tiny", ["train.seq_len=128"])
    tpu, cpu = (resolve_kernels(config.model, platform, config.train.seq_len) for platform in ("tpu", "cpu"))
    assert (tpu.attention, tpu.moe.grouped_matmul, tpu.moe.exchange, tpu.interpret_kernels) == (
        "splash", "megablox", "ragged_all_to_all", False)
    assert (cpu.attention, cpu.moe.grouped_matmul, cpu.moe.exchange, cpu.interpret_kernels) == (
        "xla", "ragged_dot", "all_to_all", True)
    assert resolve_kernels(config.model, "gpu", config.train.seq_len).moe.grouped_matmul == "ragged_dot"
    assert build_training(config).config.model.attention == "xla"


@pytest.mark.parametrize("overrides,message", [
    (["model.attention=cudnn"], "model.attention=cudnn: cuDNN attention needs CUDA GPUs, found cpu devices"),
    (["model.attention=cudnn", "cluster=gpu", "model.dtype=float32"], "needs model.dtype bfloat16 or float16"),
    (["model.attention=splash", "cluster=gpu"], "model.attention=splash: splash attention runs on TPU"),
    (["model.attention=splash", "train.seq_len=200"], "train.seq_len must be a multiple of 128, found 200"),
    (["model.attention=flash"], "model.attention: expected one of ['auto', 'xla', 'splash', 'cudnn'], found 'flash'"),
])
def test_a_backend_that_cannot_run_is_one_line_naming_the_key(overrides, message):
    with pytest.raises(ConfigError, match=None) as error:
        load_config("llama3-tiny", overrides)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_cluster_none_checks_the_backend_against_its_own_devices():
    config = load_config("llama3-tiny", ["cluster=none", "model.attention=cudnn", "model.dtype=bfloat16"])
    with pytest.raises(ConfigError, match="cuDNN attention needs CUDA GPUs, found cpu devices"):
        build_training(config)


@pytest.mark.skipif(not __import__("importlib").util.find_spec("libtpu"), reason="needs podtrain[aot]")
@pytest.mark.filterwarnings("ignore:Error reading persistent compilation cache entry:UserWarning")
def test_splash_compiles_for_tpu_as_a_kernel_that_never_builds_the_score_matrix():
    from podtrain.orchestrator.plan.targets import compile_devices, parse_target

    devices = compile_devices(parse_target("v5p-8"))  # 4 chips
    texts, temps = {}, {}
    for backend in ("xla", "splash"):
        overrides = ["model.num_layers=1", "train.seq_len=768", "train.batch_size=4", "mesh.fsdp=4",
                     "model.dtype=bfloat16", f"model.attention={backend}"]
        training = build_training(load_config("llama3-tiny", overrides), devices)
        compiled = training.step.lower(training.abstract_state(), training.abstract_batch()).compile()
        texts[backend], temps[backend] = compiled.as_text(), compiled.memory_analysis().temp_size_in_bytes
    scores = re.compile(r"\[[0-9,]*768,768\]")  # any (..., queries, keys) array
    assert scores.search(texts["xla"]) and not scores.search(texts["splash"])
    assert "tpu_custom_call" in texts["splash"] and "splash" in texts["splash"]
    assert temps["splash"] < temps["xla"]


@pytest.mark.skipif(not __import__("importlib").util.find_spec("libtpu"), reason="needs podtrain[aot]")
@pytest.mark.filterwarnings("ignore:Error reading persistent compilation cache entry:UserWarning")
def test_splash_compiles_for_rows_the_batch_axes_do_not_divide():
    """A few rows on a larger mesh (a serve step on a pod): the kernel gets padding rows."""
    from podtrain.orchestrator.plan.targets import compile_devices, parse_target

    devices = compile_devices(parse_target("v5p-8"))  # 4 chips
    overrides = ["model.num_layers=1", "train.seq_len=256", "train.batch_size=4", "mesh.fsdp=4",
                 "model.dtype=bfloat16", "model.attention=splash"]
    training = build_training(load_config("llama3-tiny", overrides), devices)
    rules = training.config.sharding.rules

    def logits(params, tokens):
        with use_rules(rules):
            return training.model(params, None)(tokens)[0]

    params = training.abstract_state().params
    tokens = jax.ShapeDtypeStruct((2, 256), jnp.int32, sharding=NamedSharding(training.mesh, PartitionSpec()))
    with jax.set_mesh(training.mesh):
        text = jax.jit(logits).lower(params, tokens).compile().as_text()
    assert "tpu_custom_call" in text and "splash" in text
