"""Presets load; every kind of bad input is one clear error (and exit code 2 from the CLI)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from podtrain.launch.cli import main
from podtrain.orchestrator.common.errors import ConfigError
from podtrain.orchestrator.common.platforms import has_accelerator
from podtrain.orchestrator.config.compose import closest_key, list_presets, load_config, override_keys, parse_overrides
from podtrain.orchestrator.config.validate import validate

REQUIRED_PRESETS = {
    "llama3-tiny", "qwen3-tiny", "llama3-8b", "llama3-70b", "qwen3-8b", "qwen3-32b", "deepseek-v3-tiny",
    "deepseek-v3-671b",
}


def test_required_presets_exist():
    assert set(list_presets()) >= REQUIRED_PRESETS


@pytest.mark.parametrize("preset", list_presets())
def test_every_preset_loads_and_validates(preset):
    config = load_config(preset)
    config.model.validate()
    assert config.model.num_layers > 0


def test_real_sizes_match_public_configs():
    l8 = load_config("llama3-8b").model
    assert (l8.vocab_size, l8.hidden_size, l8.intermediate_size, l8.num_layers, l8.num_heads, l8.num_kv_heads) == (
        128256, 4096, 14336, 32, 32, 8)
    assert (l8.rope.rope_type, l8.rope.factor, l8.rope.theta) == ("llama3", 8.0, 500000.0)
    l70 = load_config("llama3-70b").model
    assert (l70.hidden_size, l70.intermediate_size, l70.num_layers, l70.num_heads) == (8192, 28672, 80, 64)
    q8 = load_config("qwen3-8b").model
    assert (q8.vocab_size, q8.intermediate_size, q8.num_layers, q8.qk_norm) == (151936, 12288, 36, True)
    q32 = load_config("qwen3-32b").model
    assert (q32.hidden_size, q32.intermediate_size, q32.num_layers, q32.num_heads, q32.head_dim) == (
        5120, 25600, 64, 64, 128)
    ds = load_config("deepseek-v3-671b").model
    assert (ds.vocab_size, ds.hidden_size, ds.intermediate_size, ds.num_layers, ds.num_heads) == (
        129280, 7168, 18432, 61, 128)
    assert (ds.mla.q_lora_rank, ds.mla.kv_lora_rank, ds.mla.qk_nope_head_dim, ds.mla.qk_rope_head_dim,
            ds.mla.v_head_dim) == (1536, 512, 128, 64, 128)
    m = ds.moe
    assert (m.num_experts, m.num_experts_per_tok, m.moe_intermediate_size, m.num_shared_experts, m.n_group,
            m.topk_group, m.routed_scaling_factor, m.first_k_dense_replace) == (256, 8, 2048, 1, 8, 4, 2.5, 3)
    assert (ds.rope.rope_type, ds.rope.factor, ds.rope.original_max_position_embeddings) == ("yarn", 40.0, 4096)


def test_overrides_apply_in_order_and_parse_types():
    config = load_config("llama3-tiny", ["model.num_layers=3", "model.rope.theta=1e6", "sharding.rules.mlp=null"])
    assert config.model.num_layers == 3
    assert config.model.rope.theta == 1e6
    assert config.sharding.rules["mlp"] is None


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["model.num_layer=3"], "unknown key 'model.num_layer'; did you mean 'model.num_layers'"),
        (["train.steps=abc"], "'train.steps' expects int, found 'abc'"),
        (["model.remat=fast"], "valid policies: none, full, dots"),
        (["mesh.tp=3"], "model.num_heads=8 is not divisible by mesh.tp=3"),
        (["model.num_kv_heads=2", "mesh.tp=4"], "model.num_kv_heads=2 is not divisible by mesh.tp=4"),
        (["model.num_layers=1", "model.num_layers=2"], "given twice"),
        (["sharding.rules.mlp=xp"], "mesh axis 'xp' does not exist"),
        (["model.num_layers"], "expected key=value"),
        (["model=3"], "key 'model' is a section: expected a mapping of its keys (such as 'model.model_type'), found 3"),
        (["mesh=3"], "key 'mesh' is a section: expected a mapping of its keys (such as 'mesh.dp'), found 3"),
        (["optimizer=adam"], "key 'optimizer' is a section: expected a mapping of its keys"),
        (["sharding.rules=3"], "key 'sharding.rules' is a section: expected a mapping of its keys"),
        (["optimizer.grad_clip=-1"], "optimizer.grad_clip: expected a global gradient norm > 0, or 0 for no clipping"),
        (["optimizer.lr=abc"], "unknown key 'optimizer.lr'; did you mean 'optimizer.learning_rate'?"),
        (["sharding.rules.mpl=null"], "sharding.rules.mpl: unknown logical axis 'mpl'; expected one of ['layers'"),
        (["train.seq_len=4096"], "train.seq_len=4096 is longer than model.max_position_embeddings=2048"),
    ],
)
def test_bad_overrides_name_the_key(overrides, needle):
    with pytest.raises(ConfigError, match=None) as info:
        load_config("llama3-tiny", overrides)
    assert needle in str(info.value)


@pytest.mark.parametrize(
    "override, needle",
    [
        ("optimizer.learning_rate=-0.001", "optimizer.learning_rate: expected a number > 0, found -0.001"),
        ("optimizer.learning_rate=0", "optimizer.learning_rate: expected a number > 0, found 0"),
        ("optimizer.learning_rate=.nan", "optimizer.learning_rate: expected a number > 0, found nan"),
        ("optimizer.eps=0", "optimizer.eps: expected a number > 0, found 0"),
        ("optimizer.weight_decay=-0.1", "optimizer.weight_decay: expected a number >= 0 (0: no decay), found -0.1"),
        ("optimizer.min_lr_ratio=1.5", "optimizer.min_lr_ratio: expected the final share of optimizer.learning_rate, "
                                       "in [0, 1], found 1.5"),
        ("optimizer.min_lr_ratio=-0.1", "optimizer.min_lr_ratio: expected the final share"),
        ("optimizer.b1=1", "optimizer.b1: expected a decay rate in [0, 1), found 1"),
        ("optimizer.b2=-0.5", "optimizer.b2: expected a decay rate in [0, 1), found -0.5"),
        ("optimizer.momentum=1.5", "optimizer.momentum: expected a decay rate in [0, 1), found 1.5"),
        ("optimizer.warmup_steps=301", "optimizer.warmup_steps=301 must be in [0, train.steps=300]"),
        ("train.eval_every=-1", "train.eval_every: expected a number of steps >= 0 (0: no evals), found -1"),
        ("train.eval_batches=0", "train.eval_batches: expected a positive integer, found 0"),
        ("train.peak_flops_per_device=-1", "train.peak_flops_per_device: expected FLOP/s > 0, or 0 to look"),
        ("train.seed=-1", "train.seed: expected an integer in [0, 2**63), found -1"),
        ("train.seed=9223372036854775808", "train.seed: expected an integer in [0, 2**63)"),
        ("data.seed=-3", "data.seed: expected an integer >= 0, found -3"),
        ("data.window_bytes=1024", "data.window_bytes=1024: only data.source='text' files are cut into documents, "
                                   "data.source='stdlib' has its own; unset data.window_bytes"),
        ("model.rms_norm_eps=0", "model.rms_norm_eps: expected a number > 0, found 0"),
        ("model.initializer_range=-0.02", "model.initializer_range: expected a number > 0, found -0.02"),
        ("model.rope.theta=0", "model.rope.theta: expected a base > 1 (such as 10000.0), found 0"),
        ("model.rope.factor=0", "model.rope.factor: expected a number > 0, found 0"),
        ("model.rope.original_max_position_embeddings=0",
         "model.rope.original_max_position_embeddings: expected a positive integer, found 0"),
        ("model.rope.low_freq_factor=4", "model.rope.low_freq_factor=4.0, model.rope.high_freq_factor=4.0: expected "
                                         "0 < low_freq_factor < high_freq_factor"),
    ],
)
def test_values_outside_their_meaning_name_the_key(override, needle):
    with pytest.raises(ConfigError) as info:
        load_config("llama3-tiny", [override])
    assert needle in str(info.value)


@pytest.mark.parametrize(
    "overrides",
    [
        ["optimizer.name=sgd", "optimizer.momentum=0", "optimizer.weight_decay=0", "optimizer.min_lr_ratio=0"],
        ["optimizer.b1=0", "optimizer.b2=0.999", "optimizer.min_lr_ratio=1", "optimizer.learning_rate=1e-6"],
        ["train.eval_every=0", "train.seed=0", "data.seed=0", "data.eval_fraction=0", "train.eval_batches=1"],
        ["data.source=text", "data.path=book.txt", "data.documents=windows", "data.window_bytes=4"],
        ["model.rope.rope_type=default", "model.rope.theta=1e6", "train.peak_flops_per_device=0"],
    ],
)
def test_edge_values_with_a_meaning_load(overrides):
    load_config("llama3-tiny", overrides)


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["model.moe.num_experts_per_tok=5"], "model.moe.num_experts_per_tok=5 exceeds the 4 experts"),
        (["model.moe.n_group=3"], "model.moe.n_group=3 must divide model.moe.num_experts=8"),
        (["model.num_kv_heads=2"], "MLA has one key/value per query head"),
        (["model.moe.first_k_dense_replace=9"], "model.moe.first_k_dense_replace: expected 0..model.num_layers"),
        (["model.moe.capacity_factor=-1"], "model.moe.capacity_factor: expected a number >= 0"),
        (["model.moe.routed_scaling_factor=0"], "model.moe.routed_scaling_factor: expected a number > 0, found 0"),
        (["model.rope.beta_slow=0"], "model.rope.beta_fast=32.0, model.rope.beta_slow=0.0: expected 0 < beta_slow "
                                     "<= beta_fast"),
        (["model.rope.beta_fast=0.5"], "expected 0 < beta_slow <= beta_fast (rotations; 1 and 32 in DeepSeek-V3)"),
        (["model.rope.mscale=-1"], "model.rope.mscale: expected a number >= 0 (0: unset), found -1.0"),
    ],
)
def test_bad_deepseek_settings_name_the_key(overrides, needle):
    with pytest.raises(ConfigError) as info:
        load_config("deepseek-v3-tiny", overrides)
    assert needle in str(info.value)


@pytest.mark.parametrize(
    "key, meant",
    [
        ("optimizer.lr", "optimizer.learning_rate"),  # the initials of a key in the same section
        ("train.learning_rate", "optimizer.learning_rate"),  # the same name in another section
        ("modle.num_layers", "model.num_layers"),
        ("model.rope_theta", "model.rope.theta"),
        ("data.eos", "data.eos_token"),
        ("model.num_layer", "model.num_layers"),
        ("max_new_token", "generate.max_new_tokens"),  # a command's setting is a section of the schema
        ("warp_speed", None),  # nothing close in the config: no hint rather than a wrong one
    ],
)
def test_closest_key_prefers_the_same_section_and_the_last_part(key, meant):
    from podtrain.orchestrator.config.compose import _schema_keys
    from podtrain.orchestrator.config.schema import Config

    assert closest_key(key, _schema_keys(Config)) == meant


def test_command_keys_are_hinted_for_unknown_overrides():
    with pytest.raises(ConfigError, match="unknown key 'max_new_token'; did you mean 'max_new_tokens'"):
        load_config("llama3-tiny", ["max_new_token=3"], hint_keys=["checkpoint", "max_new_tokens"])


def test_mesh_product_must_match_devices():
    config = load_config("llama3-tiny", ["mesh.fsdp=2", "mesh.tp=2"])
    with pytest.raises(ConfigError) as info:
        validate(config, num_devices=8)
    assert "= 4 devices, but 8 devices are present" in str(info.value)
    assert validate(config, num_devices=4) == {"dp": 1, "fsdp": 2, "ep": 1, "cp": 1, "tp": 2}
    assert validate(load_config("llama3-tiny", ["mesh.tp=2"]), num_devices=8)["fsdp"] == 4
    with pytest.raises(ConfigError) as info:  # mesh.tp=8 comes from the preset: the error names it
        validate(load_config("llama3-70b"), num_devices=1)
    fixed = "the fixed axes mesh.dp=1 * mesh.ep=1 * mesh.cp=1 * mesh.tp=8 = 8, which does not divide the 1 devices"
    assert fixed in str(info.value)


def test_unknown_preset_and_bad_file(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="did you mean 'llama3-tiny'"):
        load_config("llama3-tny")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  hidden_sise: 3\n")
    with pytest.raises(ConfigError, match=f"config file {bad}: unknown key 'model.hidden_sise'"):
        load_config(str(bad))
    bad.write_text("model: [1, 2\n")
    with pytest.raises(ConfigError) as info:
        load_config(str(bad))
    assert str(info.value) == (f"config file {bad}: not valid YAML at line 2, column 1: expected ',' or ']', but got "
                               "'<stream end>' (while parsing a flow sequence at line 1, column 8)")
    bad.write_text("model: 3\n")
    with pytest.raises(ConfigError, match=f"config file {bad}: key 'model' is a section: expected a mapping"):
        load_config(str(bad))
    with pytest.raises(ConfigError, match=f"-c {tmp_path}: is a directory; expected a preset name or a YAML file"):
        load_config(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    with pytest.raises(ConfigError, match="-c runs: is a directory, not a preset in .*; expected a preset name"):
        load_config("runs")


def test_parse_overrides_nests():
    assert parse_overrides(["a.b=1", "a.c=[x, y]", "d=text"]) == {"a": {"b": 1, "c": ["x", "y"]}, "d": "text"}
    assert override_keys(["a.b=1", "c={d: 2, e: x}", "cluster=tpu"]) == ["a.b", "c.d", "c.e", "cluster.kind"]


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["plan", "-c", "llama3-tiny", "model.num_layer=2"], "did you mean 'model.num_layers'"),
        (["plan", "-c", "llama3-tiny", "mesh.fsdp=3"], "devices are present"),
        (["plan", "-c", "llama3-tiny", "model.remat=bogus"], "unknown remat policy 'bogus'"),
        (["plan", "-c", "llama3-tiny", "model=3"], "key 'model' is a section"),
        (["plan", "--cpu-devices", "0"], "--cpu-devices: expected a positive number of devices, found 0"),
        (["plan", "--cpu-devices", "-2"], "--cpu-devices: expected a positive number of devices, found -2"),
        (["check", "--steps", "-1"], "--steps: expected a positive number of train steps, found -1"),
        (["submit", "--address", "http://127.0.0.1:1", "--no-follow"],
         "--address http://127.0.0.1:1: cannot reach Ray"),
    ],
)
def test_cli_turns_config_errors_into_one_line_and_exit_2(argv, needle, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("podtrain: error: ") and needle in err
    assert err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.slow
@pytest.mark.skipif(has_accelerator(), reason="JAX picks this machine's accelerators, and what they print, itself")
def test_a_plan_on_the_cpu_writes_nothing_to_stderr():
    """The installed `podtrain`, in a user's environment (no JAX_PLATFORMS), starts no accelerator
    plugin on a machine without accelerators: no CUDA plugin traceback, no libtpu warnings."""
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    done = subprocess.run([str(Path(sys.executable).parent / "podtrain"), "plan", "-c", "llama3-tiny", "--no-compile"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0 and done.stdout.startswith("model      llama: 8 layers")
    assert done.stderr == ""


def test_cli_takes_overrides_before_and_after_options():
    from podtrain.launch.cli import parse

    args = parse(["train", "model.num_layers=2", "--cpu-devices", "2", "-c", "qwen3-tiny", "train.steps=3"])
    assert (args.config, args.cpu_devices, args.overrides) == ("qwen3-tiny", 2, ["model.num_layers=2", "train.steps=3"])
    with pytest.raises(SystemExit):
        parse(["train", "model.num_layers=2", "--cpu-devices", "2", "bogus"])
