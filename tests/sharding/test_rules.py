"""The rule table: logical names to mesh axes, the golden sharding of every parameter, no drift in the train step."""

import json
import os
from pathlib import Path

import jax
import numpy as np
import pytest

from podtrain.orchestrator.config.compose import load_config
from podtrain.orchestrator.plan.report import sharding_table
from podtrain.orchestrator.train.build import build_training
from podtrain.orchestrator.train.synthetic import random_batch
from podtrain.sharding import DEFAULT_RULES, logical_to_spec
from podtrain.sharding.rules import check_rules

GOLDEN = Path(__file__).parent.parent / "golden" / "sharding.json"
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
