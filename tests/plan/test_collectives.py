"""The collectives of the real train step compiled for 8 TPU v5p chips (compile-only devices, no TPU needed).

Each test lowers and compiles `Training.step` for a 2x2x2 v5p slice and reads the collectives of its
optimized HLO (`orchestrator/plan/hlo_comm.py`): their arrays, the mesh axes their groups span, the op.
"""

from __future__ import annotations

import functools
import math

import pytest

pytest.importorskip("libtpu")

from flax import nnx  # noqa: E402

from podtrain.orchestrator.config.compose import load_config  # noqa: E402
from podtrain.orchestrator.plan.hlo_comm import arrays, collectives  # noqa: E402
from podtrain.orchestrator.plan.targets import compile_devices, parse_target  # noqa: E402
from podtrain.orchestrator.train.build import build_training  # noqa: E402
from podtrain.sharding.rules import axes_of, logical_to_spec  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    # The session's persistent compilation cache stores these executables but cannot load one without a
    # TPU client: each run compiles again.
    pytest.mark.filterwarnings("ignore:Error reading persistent compilation cache entry:UserWarning"),
]


@functools.cache
def compiled(preset: str, *overrides: str):
    """(training, collectives) of the train step of `preset` with `overrides`, compiled for 8 v5p chips."""
    training = build_training(load_config(preset, list(overrides)), compile_devices(parse_target("v5p-16")))
    step = training.step.lower(training.abstract_state(), training.abstract_batch()).compile()
    return training, collectives(step.as_text(), training.mesh.devices.shape, training.mesh.axis_names)


def floats(c):
    return [(dtype, dims) for dtype, dims in arrays(c.shape) if dtype in ("f32", "bf16", "f16")]


@pytest.mark.parametrize("preset", ["llama3-tiny", "deepseek-v3-tiny"])
def test_pure_fsdp_embedding_rows_travel_in_the_compute_dtype(preset):
    """On a pure-FSDP mesh the embedding table stays sharded over its hidden dimension (gathering it
    would move the whole table to every device each step): rows looked up in each shard reach their
    tokens' devices through one all-to-all, and the cotangent goes back through its transpose, both in
    the compute dtype."""
    _, found = compiled(preset, "mesh.fsdp=8", "model.dtype=bfloat16")
    all_to_all = [c for c in found if c.kind == "all-to-all"]
    assert all_to_all
    wider = [c for c in all_to_all if any(dtype != "bf16" for dtype, _ in arrays(c.shape))]
    assert not wider, f"all-to-alls not in bfloat16: {wider}"


def test_embedding_lookup_gathers_no_whole_batch_and_sums_nothing_over_tp():
    """With dp, fsdp and tp the lookup keeps the batch sharded over dp (no device ever holds the hidden
    states of the whole batch), and the table's gradient is summed over dp only: the tp devices hold
    the same tokens, so each already has the whole gradient of its shard."""
    training, found = compiled("llama3-tiny", "mesh.dp=2", "mesh.fsdp=2", "mesh.tp=2", "model.dtype=bfloat16")
    c, t = training.config.model, training.config.train
    whole_batch = (t.batch_size, t.seq_len, c.hidden_size)
    gathered = [x for x in found if any(tuple(d for d in dims if d > 1) == whole_batch for _, dims in floats(x))]
    assert not gathered, f"collectives holding the whole batch's hidden states: {gathered}"
    reductions = [x for x in found if x.kind in ("all-reduce", "reduce-scatter")
                  and any(c.vocab_size in dims for _, dims in floats(x))]
    assert reductions  # the dp sum of the table's gradient
    over_tp = [x for x in reductions if "tp" in x.axes]
    assert not over_tp, f"vocabulary-sized reductions over tp: {over_tp}"


def _whole_weight_sizes(training) -> dict[int, frozenset[str]]:
    """Elements of one layer's slice of each parameter sharded over batch axes, with those axes'
    shards put back together (the size its gradient has before it is reduce-scattered), and the axes."""
    sizes = dict(training.mesh.shape)
    batch = set(axes_of(logical_to_spec(("batch",), sizes, rules=training.config.sharding.rules)[0]))
    whole = {}
    for _, var in nnx.to_flat_state(training.abstract_params):
        value, names = var.get_value(), var.get_metadata().get("out_sharding") or ()
        over = frozenset(a for entry in value.sharding.spec for a in axes_of(entry) if a in batch)
        if over:
            shard = value.sharding.shard_shape(value.shape)
            layer = shard[1:] if names[:1] == ("layers",) else shard
            whole[math.prod(layer) * math.prod(sizes[a] for a in over)] = over
    return whole


def test_weight_gradients_are_reduce_scattered():
    """No weight's gradient is all-reduced whole over the axes that shard it, to be sliced afterwards.

    The mesh puts fsdp on one plane of the slice and the weights' shards are at least a vector
    register's 128 lanes wide: there the TPU compiler reduce-scatters. (Over all three axes of the
    2x2x2 slice it lowers every reduce-scatter, even an explicit `psum_scatter`, as an all-reduce and
    a slice; and for narrower shards it may prefer the all-reduce too.)
    """
    training, found = compiled("llama3-tiny", "mesh.fsdp=4", "mesh.tp=2", "model.hidden_size=1024")
    whole = _whole_weight_sizes(training)
    assert whole
    backward = [c for c in found if "transpose(jvp())" in c.op_name]
    assert any(c.kind == "reduce-scatter" for c in backward)
    all_reduced = [(c, dims) for c in backward if c.kind == "all-reduce" for _, dims in floats(c)
                   if math.prod(dims) in whole and whole[math.prod(dims)] <= set(c.axes)]
    assert not all_reduced, f"weight gradients all-reduced whole: {all_reduced}"


def _layer_weight_elements(training) -> int:
    """Elements one device holds of one layer's weights once they are gathered along the batch axes
    (the stacked weights sharded over one of them)."""
    sizes = dict(training.mesh.shape)
    batch = set(axes_of(logical_to_spec(("batch",), sizes, rules=training.config.sharding.rules)[0]))
    total = 0
    for _, var in nnx.to_flat_state(training.abstract_params):
        value, names = var.get_value(), var.get_metadata().get("out_sharding") or ()
        over = [a for entry in value.sharding.spec for a in axes_of(entry) if a in batch]
        if names[:1] == ("layers",) and over:
            total += math.prod(value.sharding.shard_shape(value.shape)[1:]) * math.prod(sizes[a] for a in over)
    return total


@pytest.mark.parametrize("overrides", [("mesh.fsdp=4", "mesh.tp=2", "model.hidden_size=1024"),
                                       ("mesh.fsdp=8", "model.dtype=bfloat16")])
def test_full_remat_gathers_each_layer_weight_twice(overrides):
    """With full remat a layer's weights are gathered once for its forward pass and once for its
    backward pass: the recomputed forward matmuls and the backward ones read the same gathered weight
    (GSPMD would otherwise gather it again at each matmul that reads it). Counted in elements: the
    TPU compiler may gather a float32 weight in bfloat16."""
    training, found = compiled("llama3-tiny", *overrides)
    assert training.config.model.remat == "full"
    layers = training.config.model.num_layers
    in_loop = [c for c in found if c.kind == "all-gather" and "while/body" in c.op_name and c.executions == layers]
    assert in_loop
    gathered = sum(math.prod(dims) for c in in_loop for _, dims in floats(c))
    weights = _layer_weight_elements(training)
    assert gathered <= 2 * weights, (
        f"{gathered} elements gathered per layer, {weights} in its gathered weights: "
        + "; ".join(f"{c.shape} {c.op_name}" for c in in_loop))


def test_deepseek_over_a_split_sequence_gathers_its_latent_not_its_keys_and_values():
    """Under `mesh.cp` MLA gathers each token's latent and rotary key (kv_lora_rank + qk_rope_head_dim
    values) and every device builds the keys and values from them: the per-head keys and values
    never travel, and the gathers' gradients are reduce-scattered back."""
    training, found = compiled("deepseek-v3-tiny", "mesh.fsdp=2", "mesh.cp=4", "train.seq_len=1024",
                               "model.dtype=bfloat16")
    mla, t = training.config.model.mla, training.config.train
    attention = [c for c in found if "models/attention.py" in c.source]
    assert {c.kind for c in attention} == {"all-gather", "reduce-scatter"}
    assert all(c.axes == ("cp",) for c in attention)
    rows = t.batch_size // 2  # each fsdp shard's rows
    gathered = {arrays(c.shape)[0] for c in attention if c.kind == "all-gather"}
    assert gathered == {("bf16", (rows, t.seq_len, mla.kv_lora_rank)),
                        ("bf16", (rows, t.seq_len, mla.qk_rope_head_dim))}
