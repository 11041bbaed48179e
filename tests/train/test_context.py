"""Context parallelism (`mesh.cp`): a sequence split over devices in the balanced order trains as one
device would, its causal work is even, a resume is bit-exact, and bad combinations are one line."""

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from train_fixtures import losses, train

from podtrain.models.context import balanced_order, chunk_order, to_balanced, to_natural
from podtrain.models.kernels.attention import check_backend, resolve_backend, splash_kernel
from podtrain.models.runner import REMAT
from podtrain.orchestrator.common.errors import ConfigError
from podtrain.orchestrator.config.compose import load_config
from podtrain.orchestrator.config.validate import validate
from podtrain.orchestrator.inference.load import load_model
from podtrain.orchestrator.train.build import build_training
from podtrain.orchestrator.train.synthetic import random_batch

TINY = ["model.num_layers=2", "model.hidden_size=64", "model.intermediate_size=128", "model.vocab_size=256",
        "model.head_dim=16", "train.batch_size=8", "optimizer.name=sgd", "optimizer.momentum=0",
        "optimizer.weight_decay=0", "optimizer.schedule=constant", "optimizer.learning_rate=1.0",
        "optimizer.grad_clip=1e9"]


def test_the_balanced_order_gives_each_device_an_early_and_a_late_chunk():
    assert chunk_order(2).tolist() == [0, 3, 1, 2]
    assert balanced_order(8, 2).tolist() == [0, 1, 6, 7, 2, 3, 4, 5]
    x = jnp.arange(2 * 24).reshape(2, 24)
    assert to_balanced(x, 3)[0].tolist() == balanced_order(24, 3).tolist()
    np.testing.assert_array_equal(to_natural(to_balanced(x, 3), 3), x)


def packed_step(model: str, seq_len: int, mesh: list[str], *extra: str):
    """One SGD step of a batch of two packed documents per row (the first row half weighted):
    (loss, grad norm, trained params after the step)."""
    training = build_training(load_config(model, TINY + [f"train.seq_len={seq_len}", *mesh, *extra]))
    batch = {k: np.array(v) for k, v in random_batch(training).items()}
    split = 5 * seq_len // 16
    t = np.arange(seq_len)
    batch["segment_ids"] = np.broadcast_to(np.where(t < split, 1, 2), batch["inputs"].shape).astype(np.int32)
    batch["positions"] = np.broadcast_to(np.where(t < split, t, t - split), batch["inputs"].shape).astype(np.int32)
    batch["weights"][0, seq_len // 2:] = 0
    placed = {k: jax.make_array_from_callback(v.shape, training.batch_sharding, lambda i, v=v: v[i])
              for k, v in batch.items()}
    state, metrics = training.step(training.init_state(), placed, training.init_frozen())
    return float(metrics["loss"]), float(metrics["grad_norm"]), jax.tree.leaves(state.params)


def assert_same_step(got, want):
    np.testing.assert_allclose(got[:2], want[:2], rtol=1e-6)
    for a, b in zip(got[2], want[2], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("model, meshes", [
    ("llama3-tiny", [["mesh.fsdp=4", "mesh.cp=2"], ["mesh.fsdp=2", "mesh.cp=2", "mesh.tp=2"]]),
    pytest.param("llama3-tiny", [["mesh.fsdp=2", "mesh.cp=4"]], marks=pytest.mark.slow),
    ("deepseek-v3-tiny", [["mesh.fsdp=2", "mesh.ep=2", "mesh.cp=2"]]),
    pytest.param("deepseek-v3-tiny", [["mesh.fsdp=1", "mesh.ep=2", "mesh.cp=4"],
                                      ["mesh.fsdp=1", "mesh.ep=2", "mesh.cp=2", "mesh.tp=2"]], marks=pytest.mark.slow),
])
def test_a_split_sequence_gives_the_loss_and_gradients_of_a_whole_one(model, meshes):
    """Packed documents, xla attention: cp = 2 and 4, with fsdp, tp and ep, against cp = 1."""
    whole = packed_step(model, 16, ["mesh.fsdp=4", "mesh.ep=2"] if "deepseek" in model else ["mesh.fsdp=8"])
    for mesh in meshes:
        assert_same_step(packed_step(model, 16, mesh, "model.attention=xla"), whole)


@pytest.mark.slow
def test_an_adapter_on_mlas_up_projection_trains_the_same_when_each_device_builds_keys_from_the_latent():
    """Under cp MLA gathers the latent and up-projects it on each device with kv_b_proj's weight,
    its adapter merged in: the step equals the whole sequence's, adapters included."""
    lora = ["lora.rank=4", "lora.targets=[kv_b_proj,q_b_proj]"]
    whole = packed_step("deepseek-v3-tiny", 16, ["mesh.fsdp=4", "mesh.ep=2"], *lora)
    assert_same_step(packed_step("deepseek-v3-tiny", 16, ["mesh.fsdp=2", "mesh.ep=2", "mesh.cp=2"], *lora), whole)


@pytest.mark.slow
def test_every_remat_policy_takes_a_split_sequence():
    whole = packed_step("llama3-tiny", 16, ["mesh.fsdp=8"])
    for policy in REMAT:
        assert_same_step(packed_step("llama3-tiny", 16, ["mesh.fsdp=4", "mesh.cp=2"], f"model.remat={policy}"), whole)


@pytest.mark.slow
def test_splash_over_a_split_sequence_gives_the_loss_and_gradients_of_a_whole_one():
    """The splash kernel (interpreted) with each device's mask rows at its queries' natural indices."""
    whole = packed_step("llama3-tiny", 512, ["mesh.fsdp=8"], "model.attention=splash")
    for mesh in (["mesh.fsdp=4", "mesh.cp=2"], ["mesh.fsdp=2", "mesh.cp=2", "mesh.tp=2"]):
        assert_same_step(packed_step("llama3-tiny", 512, mesh, "model.attention=splash"), whole)


def blocks_per_device(q_sequence, length: int, shards: int) -> list[int]:
    """The (query block, key block) pairs splash computes for each device's queries."""
    kernel = splash_kernel(1, length, length, shards=shards, q_sequence=q_sequence)
    visited = np.asarray(kernel.fwd_mask_info.block_mask)[0] > 0  # (query blocks, key blocks)
    return [int(rows.sum()) for rows in np.split(visited, shards)]


@pytest.mark.parametrize("length, shards", [(2048, 1), (2048, 4), (4096, 8)])
def test_the_kernels_block_map_is_the_one_splash_builds_from_its_own_causal_mask(length, shards):
    """podtrain's mask answers wholly seen and wholly hidden blocks without building them: the
    kernel's forward, dq and dkv block maps, their next-block indices and partial blocks are
    those of splash's CausalMask, in the balanced order and the natural one."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    for order in (None, balanced_order(length, shards)):
        ours = splash_kernel(2, length, length, shards=shards, q_sequence=order)
        reference = splash.CausalMask((length, length), shard_count=shards)
        if order is not None:
            reference.q_sequence = np.asarray(order, np.int32)
        theirs = splash.make_splash_mha(splash.MultiHeadMask([reference] * 2), block_sizes=ours.kwargs["block_sizes"],
                                        head_shards=1, q_seq_shards=shards)
        for name in ("fwd_mask_info", "dq_mask_info", "dkv_mask_info"):
            got, want = getattr(ours, name), getattr(theirs, name)
            for field in want._fields:
                a, b = getattr(got, field), getattr(want, field)
                assert (a is None) == (b is None), (name, field)
                if b is not None and not callable(b):
                    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"{name}.{field}")


def test_causal_work_is_even_over_the_devices():
    """8 devices, 16 chunks of 128 queries: in the natural order the last device visits 31 blocks and
    the first 3; in the balanced order every device visits 17."""
    length, shards = 2048, 8
    assert blocks_per_device(balanced_order(length, shards), length, shards) == [17] * shards
    natural = blocks_per_device(None, length, shards)
    assert natural == [3 + 4 * r for r in range(shards)] and sum(natural) == 17 * shards


@pytest.mark.slow
def test_a_resume_under_cp_is_bit_exact_and_restores_across_cp_sizes(tmp_path):
    # A constant learning rate: a run of 2 steps resumed to 4 follows the schedule of a run of 4.
    cp = ["mesh.fsdp=1", "mesh.cp=2", "optimizer.schedule=constant", "optimizer.warmup_steps=0"]
    reference = tmp_path / "reference"
    train(reference, 4, *cp)
    resumed, other = tmp_path / "resumed", tmp_path / "other"
    train(resumed, 2, *cp)
    shutil.copytree(resumed, other)  # the cp=2 checkpoint of step 2, continued below with the sequence whole
    train(resumed, 4, *cp)
    assert losses(resumed) == losses(reference)
    out = train(other, 4, *cp[2:], "mesh.fsdp=2", "mesh.cp=1")
    assert "steps 2 -> 4" in out.stdout
    np.testing.assert_allclose([losses(other)[s] for s in (3, 4)], [losses(reference)[s] for s in (3, 4)], rtol=1e-5)


def test_bad_combinations_are_one_line_naming_the_keys(tmp_path):
    with pytest.raises(ConfigError, match=r"train.seq_len=20 must be divisible by 2 \* mesh.cp = 8"):
        validate(load_config("llama3-tiny", ["train.seq_len=20", "mesh.cp=4"]))
    with pytest.raises(ConfigError, match=r"train.seq_len=20 must be divisible by 2 \* mesh.cp = 8"):
        validate(load_config("llama3-tiny", ["train.seq_len=20", "mesh.cp=-1", "mesh.fsdp=2"]), num_devices=8)
    with pytest.raises(ConfigError, match="mesh.cp=2: podtrain serve samples token by token"):
        validate(load_config(None, ["mesh.cp=2"], serving=True), serving=True)
    with pytest.raises(ConfigError, match="mesh.cp=2: podtrain generate samples token by token"):
        load_model(load_config("llama3-tiny", ["mesh.cp=2"]), str(tmp_path))
    with pytest.raises(ValueError, match="model.attention=cudnn: cuDNN attention cannot take a sequence split over "
                                         "devices, found mesh.cp=2"):
        check_backend("cudnn", "gpu", "bfloat16", 4096, context=2)
    with pytest.raises(ValueError, match=r"model.attention=splash: train.seq_len must be a multiple of 1024 \(128 per "
                                         r"chunk, 2 chunks per device of mesh.cp=4\), found 1536"):
        check_backend("splash", "tpu", "bfloat16", 1536, context=4)
    assert resolve_backend("auto", "tpu", "bfloat16", 4096, context=8) == "splash"
    assert resolve_backend("auto", "tpu", "bfloat16", 4096 + 1024, context=8) == "xla"
    assert resolve_backend("auto", "gpu", "bfloat16", 4096, context=2) == "xla"
