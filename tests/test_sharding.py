"""Meshes, the rule table, the golden sharding of every parameter, no drift, params born sharded."""

import json
import os
import types
from pathlib import Path

import jax
import numpy as np
import pytest

from podtrain.models.runner import only_layer
from podtrain.orchestrator.config.compose import load_config
from podtrain.orchestrator.plan.report import format_plan, make_plan, sharding_table
from podtrain.orchestrator.train.build import build_training, model_factory
from podtrain.orchestrator.train.synthetic import random_batch
from podtrain.sharding import DEFAULT_RULES, build_mesh, logical_to_spec, resolve_axis_sizes
from podtrain.sharding.mesh import device_grid, device_slices
from podtrain.sharding.place import init_peak_bytes
from podtrain.sharding.rules import check_rules

GOLDEN = Path(__file__).parent / "golden" / "sharding.json"
GOLDEN_MESH = ["mesh.dp=1", "mesh.fsdp=2", "mesh.tp=2", "mesh.ep=2"]


def golden_table(preset):
    training = build_training(load_config(preset, GOLDEN_MESH))
    return {row["path"]: {"shape": row["shape"], "spec": row["spec"]} for row in sharding_table(training)}


def test_golden_sharding_file():
    """Every parameter's path, shape and PartitionSpec on a (dp=1, fsdp=2, tp=2, ep=2) mesh.

    After a deliberate change, rewrite it with PODTRAIN_UPDATE_GOLDEN=1 and review the diff.
    """
    actual = {preset: golden_table(preset) for preset in ("llama3-tiny", "qwen3-tiny", "deepseek-v3-tiny")}
    if os.environ.get("PODTRAIN_UPDATE_GOLDEN"):
        GOLDEN.write_text(json.dumps(actual, indent=1, sort_keys=True) + "\n")
    assert actual == json.loads(GOLDEN.read_text())


def test_no_sharding_drift_after_train_steps():
    training = build_training(load_config("qwen3-tiny", GOLDEN_MESH + ["model.num_layers=2"]))
    state = training.init_state()
    batch = random_batch(training)
    for _ in range(2):
        state, metrics = training.step(state, batch)
    assert np.isfinite(float(metrics["loss"]))
    leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    expected = jax.tree.leaves(training.state_shardings)
    assert len(leaves) == len(expected)
    for (path, leaf), sharding in zip(leaves, expected, strict=True):
        assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim), jax.tree_util.keystr(path)
    # The optimizer moments are sharded like their params, not replicated.
    mu = state.opt_state[1][0].mu
    param_spec = state.params["layers"]["mlp"]["w_up"].get_value().sharding.spec
    assert mu["layers"]["mlp"]["w_up"].get_value().sharding.spec == param_spec != ()


@pytest.mark.parametrize(
    "preset, mesh", [("llama3-tiny", ["mesh.fsdp=4", "mesh.tp=2"]), ("qwen3-tiny", ["mesh.fsdp=8"])]
)
def test_params_are_born_sharded_within_budget(preset, mesh):
    """The compiled init holds at most 1.25x the sharded parameter bytes per device, at any time."""
    config = load_config(preset, mesh)
    training = build_training(config)
    param_bytes = sum(row["bytes_per_device"] for row in sharding_table(training))
    init = init_peak_bytes(model_factory(config.model), training.mesh, config.sharding.rules, layer_slice=only_layer)
    assert init["param_bytes"] == pytest.approx(param_bytes, rel=0.001)
    assert init["peak_bytes"] <= 1.25 * param_bytes, (init, param_bytes)


def test_resolve_axis_sizes():
    assert resolve_axis_sizes({"fsdp": -1, "tp": 2}, 8) == {"dp": 1, "fsdp": 4, "ep": 1, "tp": 2}
    with pytest.raises(ValueError, match="at most one axis may be -1"):
        resolve_axis_sizes({"fsdp": -1, "tp": -1}, 8)
    with pytest.raises(ValueError, match="does not divide the 8 devices"):
        resolve_axis_sizes({"fsdp": -1, "tp": 3}, 8)
    with pytest.raises(ValueError, match="unknown mesh axes"):
        resolve_axis_sizes({"model": 2}, 8)


def test_mesh_axes_and_order():
    mesh = build_mesh({"dp": 2, "fsdp": 2, "tp": 2})
    assert mesh.axis_names == ("dp", "fsdp", "ep", "tp")
    assert dict(mesh.shape) == {"dp": 2, "fsdp": 2, "ep": 1, "tp": 2}
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)


def test_multislice_dp_spans_slices():
    """With devices on two slices, each slice holds half of dp and all of the other axes."""
    devices = [  # two slices of 2x2 chips (one core each)
        types.SimpleNamespace(id=i, slice_index=i // 4, process_index=i // 2, platform="tpu",
                              device_kind="fake", coords=(i % 2, i // 2 % 2, 0), core_on_chip=0)
        for i in range(8)
    ]
    grid = device_grid({"dp": 2, "fsdp": 2, "tp": 2}, devices)
    assert grid.shape == (2, 2, 1, 2)
    slices = np.vectorize(lambda d: d.slice_index)(grid)
    assert (slices[0] == 0).all() and (slices[1] == 1).all()
    with pytest.raises(ValueError, match="multiple of the number of slices"):
        device_grid({"dp": 1, "fsdp": 8}, devices)


def test_gpu_nodes_are_one_slice_whatever_their_slice_index():
    """XLA gives each GPU host its own slice_index: two nodes must not force dp to span "slices"."""
    devices = [types.SimpleNamespace(id=i, slice_index=i // 4, process_index=i // 4, platform="gpu",
                                     device_kind="fake") for i in range(8)]
    assert device_slices(devices) == [0] * 8
    assert device_slices(devices, num_slices=2) == [0] * 4 + [1] * 4  # asked for: blocks of processes


def test_rules_map_logical_names():
    sizes = {"dp": 2, "fsdp": 2, "ep": 1, "tp": 2}
    spec = logical_to_spec(("layers", "embed", "mlp"), sizes, rules=DEFAULT_RULES)
    assert tuple(spec) == (None, "fsdp", "tp")
    assert tuple(logical_to_spec(("batch", None), sizes, rules=DEFAULT_RULES)) == (("dp", "fsdp"), None)
    with pytest.raises(ValueError, match="not divisible"):
        logical_to_spec(("heads",), sizes, shape=(3,), rules=DEFAULT_RULES, what="wq")
    with pytest.raises(ValueError, match="has no rule"):
        logical_to_spec(("nope",), sizes, rules=DEFAULT_RULES)


def test_a_rule_for_an_unknown_logical_axis_is_an_error():
    """A rule no model uses would never apply: `mpl` is a typo of `mlp`, not a new axis."""
    with pytest.raises(ValueError) as info:
        check_rules({**DEFAULT_RULES, "mpl": None})
    assert str(info.value).startswith("sharding.rules.mpl: unknown logical axis 'mpl'; expected one of ['layers', ")
    assert str(info.value).endswith("; did you mean sharding.rules.mlp?")
    check_rules(DEFAULT_RULES)


def test_plan_lists_each_module_once():
    for preset in ("llama3-tiny", "deepseek-v3-tiny"):
        text = format_plan(make_plan(build_training(load_config(preset)), compile_step=False))
        groups = [line for line in text.splitlines() if line.startswith("[")]
        assert len(groups) == len(set(groups)) and "[(top)]" in groups, groups


def test_check_runs_the_configured_optimizer(capsys):
    from podtrain.launch.cli import main

    tiny = ["model.num_layers=1", "model.hidden_size=64", "model.intermediate_size=128", "model.vocab_size=384",
            "model.head_dim=16", "train.seq_len=16", "optimizer.name=sgd"]
    assert main(["check", "-c", "llama3-tiny", *tiny, "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "running 2 train steps (forward, loss, backward, sgd update) on random tokens" in out
    steps = [line for line in out.splitlines() if line.startswith("step ")]
    assert len(steps) == 2 and "(includes compilation)" in steps[0] and "compilation" not in steps[1]


def test_plan_json_has_the_promised_fields(capsys):
    from podtrain.launch.cli import main

    assert main(["plan", "-c", "llama3-tiny", "--json", "mesh.tp=2", "model.num_layers=2"]) == 0
    plan = json.loads(capsys.readouterr().out)
    for key in ("param_count", "flops_per_token", "mesh"):
        assert key in plan
    for key in ("argument_bytes", "output_bytes", "temp_bytes"):
        assert plan["memory"][key] > 0
    assert plan["mesh"]["axes"] == {"dp": 1, "fsdp": 4, "ep": 1, "tp": 2}
    c = load_config("llama3-tiny", ["model.num_layers=2"]).model
    expected_params = c.vocab_size * c.hidden_size * 2 + c.hidden_size + 2 * (
        2 * c.hidden_size + c.hidden_size * c.head_dim * (2 * c.num_heads + 2 * c.num_kv_heads)
        + 3 * c.hidden_size * c.intermediate_size)
    assert plan["param_count"] == expected_params
    assert "note" not in plan["memory"]
    # XLA:CPU computes bfloat16 matmuls in float32: the plan says its temp bytes overstate bf16 memory.
    assert main(["plan", "-c", "llama3-tiny", "--json", "mesh.tp=2", "model.num_layers=2",
                 "model.dtype=bfloat16"]) == 0
    note = json.loads(capsys.readouterr().out)["memory"]["note"]
    assert note.startswith("compiled for CPU devices, where XLA computes bfloat16 matmuls in float32")


def test_plan_of_a_real_size_compiles_without_allocating():
    config = load_config("llama3-8b", ["train.batch_size=8", "train.seq_len=512", "train.loss_chunk=256"])
    plan = make_plan(build_training(config))
    assert 8.0e9 < plan["param_count"] < 8.1e9
    assert plan["memory"]["argument_bytes"] > plan["param_bytes_per_device"]


def test_a_mesh_axis_may_split_a_physical_tpu_axis_when_it_must():
    """mesh_utils keeps each mesh axis within whole torus axes unless told otherwise, and some
    shapes (fsdp=8 x tp=2 on a 4x4 slice) then have no layout: those retry allowing a split."""
    from podtrain.sharding.mesh import _physical_mesh

    calls = []

    def create(shape, devices, allow_split_physical_axes=False):
        calls.append(allow_split_physical_axes)
        if not allow_split_physical_axes:
            raise NotImplementedError("Failed to find assignment for logical_axis_index 1")
        return np.arange(16).reshape(shape)

    assert _physical_mesh(create, (8, 2), None, what="mesh.fsdp=8 * mesh.tp=2").shape == (8, 2)
    assert calls == [False, True]

    def never(shape, devices, allow_split_physical_axes=False):
        raise NotImplementedError("Failed to find assignment")

    with pytest.raises(ValueError, match=r"mesh: mesh.fsdp=8 \* mesh.tp=2 cannot be laid out on these devices' "
                                         r"physical topology: Failed to find assignment"):
        _physical_mesh(never, (8, 2), None, what="mesh.fsdp=8 * mesh.tp=2")
