"""LoRA runs in the train step: only the adapters train and the base is kept, the plan counts what
is trained, expert adapters over ep=2 train as over ep=1, and dropout applies from the second step."""

import jax
import numpy as np
import pytest
from flax import nnx

from podtrain.models.lora import LoRAParam
from podtrain.orchestrator.config.compose import load_config

STEP_TINY = ["model.num_layers=2", "model.hidden_size=64", "model.intermediate_size=128", "model.vocab_size=256",
             "model.head_dim=16", "train.batch_size=8", "train.seq_len=16", "mesh.fsdp=-1", "mesh.tp=2",
             "optimizer.learning_rate=0.01", "optimizer.schedule=constant"]


@pytest.mark.parametrize("preset, extra", [
    ("llama3-tiny", ["lora.targets=[q_proj,v_proj,o_proj,gate_proj,down_proj,lm_head,embed_tokens]"]),
    pytest.param("deepseek-v3-tiny", ["lora.targets=[q_a_proj,q_b_proj,kv_a_proj_with_mqa,kv_b_proj,o_proj,up_proj,"
                                      "experts]", "mesh.tp=1", "mesh.ep=2"], marks=pytest.mark.slow),
])
def test_a_lora_run_trains_only_the_adapters_and_keeps_the_base(preset, extra):
    from podtrain.orchestrator.config.compose import load_config as load
    from podtrain.orchestrator.train.build import build_training
    from podtrain.orchestrator.train.synthetic import random_batch

    keys = {o.split("=")[0] for o in extra}
    overrides = [o for o in STEP_TINY if o.split("=")[0] not in keys] + extra + ["lora.rank=4"]
    training = build_training(load(preset, overrides))
    state, frozen = training.init_state(), training.init_frozen()
    base_before = [np.asarray(a) for a in jax.tree.leaves(frozen)]
    trained = nnx.to_flat_state(state.params)
    # Only the adapters (and DeepSeek's router biases, which balancing moves) are trained params,
    # and the optimizer state is theirs alone.
    assert all(isinstance(v, LoRAParam) or path[-1] == "router_bias" for path, v in trained)
    assert any(isinstance(v, LoRAParam) for _, v in trained)
    assert not any(isinstance(v, LoRAParam) for _, v in nnx.to_flat_state(frozen))
    trained_size = sum(v.size for v in jax.tree.leaves(state.params))
    moments = sum(v.size for v in jax.tree.leaves(state.opt_state) if v.ndim)
    assert moments == 2 * trained_size  # AdamW: two moments per trained parameter
    b_before = [np.asarray(v.get_value()) for path, v in trained if path[-1] == "lora_b"]
    losses = []
    for _ in range(3):
        state, metrics = training.step(state, random_batch(training, seed=0), frozen)
        losses.append(float(metrics["loss"]))
    assert losses[-1] < losses[0], losses
    for got, want in zip(jax.tree.leaves(frozen), base_before, strict=True):
        np.testing.assert_array_equal(np.asarray(got), want)
    b_after = [np.asarray(v.get_value()) for path, v in nnx.to_flat_state(state.params) if path[-1] == "lora_b"]
    assert all(np.abs(a - b).max() > 0 for a, b in zip(b_after, b_before, strict=True))
    fresh = jax.tree.leaves(training.init_frozen())
    for got, want in zip(fresh, base_before, strict=True):  # the base is the one train.seed makes
        np.testing.assert_array_equal(np.asarray(got), want)


def test_the_plan_counts_the_trained_params_and_only_their_optimizer_state():
    from podtrain.orchestrator.config.compose import load_config as load
    from podtrain.orchestrator.plan.report import format_plan, make_plan
    from podtrain.orchestrator.train.build import build_training

    overrides = [*STEP_TINY, "lora.targets=[q_proj,v_proj]"]
    full = make_plan(build_training(load("llama3-tiny", overrides)))
    lora = make_plan(build_training(load("llama3-tiny", [*overrides, "lora.rank=4"])))
    config = load_config("llama3-tiny", overrides).model
    adapters = config.num_layers * 4 * (config.hidden_size + config.num_heads * config.head_dim
                                        + config.hidden_size + config.num_kv_heads * config.head_dim)
    assert full["trainable_param_count"] == full["param_count"]
    assert lora["trainable_param_count"] == adapters and lora["param_count"] == full["param_count"] + adapters
    assert "lora       rank 4 on q_proj, v_proj: " in format_plan(lora) and "lora " not in format_plan(full)
    # Per device, the step reads the weights and AdamW's two moments of what it trains (a third of
    # the full run's state, with the adapters') and writes back only the trained params and moments.
    full_memory, lora_memory = full["memory"], lora["memory"]
    assert lora_memory["argument_bytes"] < 0.5 * full_memory["argument_bytes"], (full_memory, lora_memory)
    assert lora_memory["output_bytes"] * 10 < full_memory["output_bytes"], (full_memory, lora_memory)


@pytest.mark.slow
def test_lora_on_the_experts_trains_the_same_with_ep2_as_with_ep1():
    """Expert adapters sharded over ep=2 with their experts train as with every expert on every
    device (ep=1, the batch over fsdp=2): same losses, same adapters after three steps (SGD, so
    that the optimizer does not amplify rounding in near-zero gradients)."""
    from podtrain.orchestrator.config.compose import load_config as load
    from podtrain.orchestrator.train.build import build_training
    from podtrain.orchestrator.train.synthetic import random_batch

    overrides = [o for o in STEP_TINY if not o.startswith(("mesh.", "optimizer."))] + [
        "lora.rank=4", "lora.targets=[experts,q_b_proj]", "optimizer.name=sgd", "optimizer.learning_rate=0.5",
        "optimizer.schedule=constant"]
    runs = {}
    for name, mesh in {"ep2": ["mesh.ep=2", "mesh.fsdp=1"], "ep1": ["mesh.ep=1", "mesh.fsdp=2"]}.items():
        training = build_training(load("deepseek-v3-tiny", overrides + mesh), jax.devices()[:2])
        state, frozen = training.init_state(), training.init_frozen()
        expert_a = state.params["moe_layers"]["mlp"]["gate_up"]["lora_a"].get_value()
        assert tuple(expert_a.sharding.spec)[:2] == (None, "ep" if name == "ep2" else None)
        losses = []
        for step in range(3):
            state, metrics = training.step(state, random_batch(training, seed=step), frozen)
            losses.append(float(metrics["loss"]))
        runs[name] = losses, {path: np.asarray(v.get_value()) for path, v in nnx.to_flat_state(state.params)}
    np.testing.assert_allclose(runs["ep2"][0], runs["ep1"][0], rtol=1e-5)
    assert runs["ep2"][0][-1] < runs["ep2"][0][0]
    experts = [path for path in runs["ep1"][1] if "gate_up" in path or "down" in path]
    assert len(experts) == 4
    for path, want in runs["ep1"][1].items():
        np.testing.assert_allclose(runs["ep2"][1][path], want, rtol=1e-5, atol=1e-6, err_msg=str(path))


@pytest.mark.slow
def test_a_lora_run_with_dropout_drops_from_its_second_step_on():
    """B starts at zero, so the first loss is dropout's too; then the dropped inputs change it."""
    from podtrain.orchestrator.config.compose import load_config as load
    from podtrain.orchestrator.train.build import build_training
    from podtrain.orchestrator.train.synthetic import random_batch

    losses = {}
    for rate in (0.0, 0.3):
        training = build_training(load("llama3-tiny", [*STEP_TINY, "lora.rank=4", f"lora.dropout={rate}",
                                                       "train.grad_accum=2"]))
        state, frozen = training.init_state(), training.init_frozen()
        losses[rate] = []
        for step in range(2):
            state, metrics = training.step(state, random_batch(training, seed=step), frozen)
            losses[rate].append(float(metrics["loss"]))
    assert losses[0.0][0] == losses[0.3][0] and losses[0.0][1] != losses[0.3][1], losses
