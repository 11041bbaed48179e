"""`podtrain plan`'s report: each module once, the JSON fields, a real size compiled without allocating."""

import json

from podtrain.orchestrator.config.compose import load_config
from podtrain.orchestrator.plan.report import format_plan, make_plan
from podtrain.orchestrator.train.build import build_training


def test_plan_lists_each_module_once():
    for preset in ("llama3-tiny", "deepseek-v3-tiny"):
        text = format_plan(make_plan(build_training(load_config(preset)), compile_step=False))
        groups = [line for line in text.splitlines() if line.startswith("[")]
        assert len(groups) == len(set(groups)) and "[(top)]" in groups, groups


def test_plan_json_has_the_promised_fields(capsys):
    from podtrain.launch.cli import main

    assert main(["plan", "-c", "llama3-tiny", "--json", "mesh.tp=2", "model.num_layers=2"]) == 0
    plan = json.loads(capsys.readouterr().out)
    for key in ("param_count", "flops_per_token", "mesh"):
        assert key in plan
    for key in ("argument_bytes", "output_bytes", "temp_bytes"):
        assert plan["memory"][key] > 0
    assert plan["mesh"]["axes"] == {"dp": 1, "fsdp": 4, "ep": 1, "cp": 1, "tp": 2}
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
