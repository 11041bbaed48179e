"""Orbax checkpoints: bit-exact round trips and resume, keep-last-K, other meshes, params alone."""

import dataclasses
import json
import logging

import grain
import jax
import numpy as np
import pytest
import yaml
from checkpoint_fixtures import (
    CHECKPOINT_LOGGER,
    EVENT_LOOP_CLOSED,
    TINY,
    assert_bit_equal,
    checkpointer,
    files,
    random_state,
    tiny_training,
)

from podtrain.orchestrator.checkpoint.checkpointer import Checkpointer, run_metadata
from podtrain.orchestrator.checkpoint.integrity import DamagedStepError
from podtrain.orchestrator.checkpoint.resume import model_differences
from podtrain.orchestrator.checkpoint.rundir import checkpoint_directory
from podtrain.orchestrator.common.errors import ConfigError
from podtrain.orchestrator.config.compose import load_config
from podtrain.orchestrator.config.schema import CheckpointConfig
from podtrain.orchestrator.placed.mesh import make_mesh
from podtrain.orchestrator.placed.model import model_factory
from podtrain.orchestrator.train.build import build_training
from podtrain.orchestrator.train.synthetic import random_batch
from podtrain.sharding.place import abstract_model

pytestmark = EVENT_LOOP_CLOSED


@pytest.fixture(scope="module")
def training():
    return tiny_training()


def test_round_trip_is_bit_exact_and_meta_round_trips(training, tmp_path):
    state = random_state(training, seed=0)
    run_meta = run_metadata(training.config, training.mesh)
    with Checkpointer(tmp_path, CheckpointConfig(), run_meta=run_meta) as ckpt:
        assert ckpt.save(7, state, meta={"data_position": 123}, force=True)
        ckpt.wait()
        restored, meta, step = ckpt.restore(training.abstract_state())
    assert step == 7
    assert_bit_equal(restored, state)
    for r, s in zip(jax.tree.leaves(restored), jax.tree.leaves(training.state_shardings), strict=True):
        assert r.sharding == s
    assert meta == run_meta | {"data_position": 123, "step": 7}
    assert meta["mesh"]["axes"] == {"dp": 1, "fsdp": 4, "ep": 1, "cp": 1, "tp": 2}
    assert yaml.safe_load(meta["config_yaml"])["model"]["hidden_size"] == 64


@pytest.mark.parametrize("async_save", [False, True])
def test_a_checkpoint_with_its_host_memory_bounded_round_trips_bit_exactly(training, tmp_path, async_save, monkeypatch):
    """`checkpoint.host_gb` gives Orbax's state handlers its bounds on host memory (bytes copied
    from the devices, being written, being read); the step reads back as any other, params alone too."""
    import orbax.checkpoint as ocp

    bounds, handler, reader = [], ocp.PyTreeCheckpointHandler, ocp.StandardCheckpointHandler
    monkeypatch.setattr(ocp, "PyTreeCheckpointHandler", lambda **kw: bounds.append(kw) or handler(**kw))
    monkeypatch.setattr(ocp, "StandardCheckpointHandler", lambda **kw: bounds.append(kw) or reader(**kw))
    state = random_state(training, seed=3)
    with Checkpointer(tmp_path, CheckpointConfig(host_gb=1, async_save=async_save)) as ckpt:
        assert ckpt.save(5, state, force=True)
        ckpt.wait()
        restored, _, step = ckpt.restore(training.abstract_state())
        params, _, _ = ckpt.restore_params(training.abstract_state().params, step=5)
    assert bounds == [{"save_concurrent_gb": 1, "save_device_host_concurrent_gb": 1, "restore_concurrent_gb": 1},
                      {"restore_concurrent_gb": 1}]
    assert step == 5
    assert_bit_equal(restored, state)
    assert_bit_equal(params, state.params)


def test_training_continues_bit_identically_after_restore(training, tmp_path):
    """Save asynchronously, keep training (donating the state), then replay the same batches from the checkpoint."""
    batches = [random_batch(training, seed) for seed in range(4)]
    state, _ = training.step(random_state(training, seed=1), batches[0])
    with checkpointer(tmp_path) as ckpt:
        assert ckpt.save(1, state, force=True)
        uninterrupted = []
        for batch in batches[1:]:
            state, metrics = training.step(state, batch)
            uninterrupted.append(np.asarray(metrics["loss"]))
        ckpt.wait()
        resumed_state, _, step = ckpt.restore(training.abstract_state())
    assert step == 1
    resumed = []
    for batch in batches[1:]:
        resumed_state, metrics = training.step(resumed_state, batch)
        resumed.append(np.asarray(metrics["loss"]))
    np.testing.assert_array_equal(resumed, uninterrupted, strict=True)
    assert_bit_equal(resumed_state, state)
    assert int(resumed_state.step) == 4


def test_saves_every_n_steps_and_keeps_the_last_k(training, tmp_path):
    state = random_state(training, seed=0)
    with checkpointer(tmp_path, keep=2) as ckpt:
        saved = [step for step in range(1, 8) if ckpt.save(step, state)]
        ckpt.wait()
        assert saved == [2, 4, 6]
        assert ckpt.all_steps() == [4, 6]
        assert not ckpt.save(6, state, force=True), "an existing step is never overwritten"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["4", "6"]


def test_async_save_commits_after_wait(training, tmp_path):
    with checkpointer(tmp_path) as ckpt:
        assert ckpt.save(2, random_state(training, seed=0))
        ckpt.wait()
        assert ckpt.latest_step() == 2
    assert [p.name for p in tmp_path.iterdir()] == ["2"]
    assert (tmp_path / "2" / "state" / "_METADATA").is_file()


def test_relative_directory_is_made_absolute(training, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with checkpointer("run/checkpoints") as ckpt:
        assert ckpt.directory == str(tmp_path / "run" / "checkpoints")
        ckpt.save(2, random_state(training, seed=0))
    assert (tmp_path / "run" / "checkpoints" / "2" / "state").is_dir()


@pytest.mark.parametrize("mesh, num_devices", [(["mesh.fsdp=2", "mesh.tp=2"], 4), (["mesh.fsdp=1", "mesh.dp=8"], 8),
                                                (["mesh.fsdp=2", "mesh.cp=4"], 8)])
def test_restore_onto_another_mesh_is_bit_equal(training, tmp_path, mesh, num_devices):
    state = random_state(training, seed=4)
    with checkpointer(tmp_path) as ckpt:
        ckpt.save(2, state)
        ckpt.wait()
    other = build_training(load_config("llama3-tiny", TINY + mesh), jax.devices()[:num_devices])
    with checkpointer(tmp_path) as ckpt:
        restored, _, _ = ckpt.restore(other.abstract_state())
    assert_bit_equal(restored, state)
    for r, s in zip(jax.tree.leaves(restored), jax.tree.leaves(other.state_shardings), strict=True):
        assert r.sharding == s


def test_restore_params_needs_no_optimizer_and_checks_their_fingerprints(training, tmp_path):
    """What export and generate read: the params alone, onto the abstract model of another mesh (no
    optimizer built), bit-equal; a params array whose fingerprint differs is a damaged step, while
    the optimizer state's fingerprints are not the params' concern."""
    state = random_state(training, seed=10)
    with checkpointer(tmp_path) as ckpt:
        ckpt.save(2, state)
        ckpt.wait()
    config = load_config("llama3-tiny", TINY + ["mesh.fsdp=1", "mesh.tp=2"])
    mesh = make_mesh(config, jax.devices()[:2])
    _, abstract_params = abstract_model(model_factory(config.model), mesh, config.sharding.rules)
    with checkpointer(tmp_path) as ckpt:
        params, meta, step = ckpt.restore_params(abstract_params)
    assert (step, meta["step"]) == (2, 2)
    assert_bit_equal(params, state.params)
    for p, a in zip(jax.tree.leaves(params), jax.tree.leaves(abstract_params), strict=True):
        assert p.sharding == a.sharding

    saved = tmp_path / "2" / "fingerprints" / "metadata"
    fingerprints = json.loads(saved.read_text())
    opt_state = [path for path in fingerprints if path.startswith(".opt_state")]
    saved.write_text(json.dumps(fingerprints | {path: [0, 0] for path in opt_state}))
    with checkpointer(tmp_path) as ckpt:
        assert_bit_equal(ckpt.restore_params(abstract_params)[0], state.params)
    saved.write_text(json.dumps(fingerprints | {".params['embed'].value": [0, 0]}))
    with checkpointer(tmp_path) as ckpt, pytest.raises(DamagedStepError, match=r"differ from the ones saved: "
                                                                               r"\['embed'\]\.value"):
        ckpt.restore_params(abstract_params)


def test_data_position_is_saved_only_with_a_step_and_comes_back_in_meta(training, tmp_path):
    def iterator():
        return grain.MapDataset.range(100).seed(0).shuffle().batch(4).to_iter_dataset().__iter__()

    data, asked = iterator(), []

    def position():
        asked.append(True)
        return {"stream": data.get_state()}

    for _ in range(3):
        next(data)
    with checkpointer(tmp_path) as ckpt:
        assert not ckpt.save(1, random_state(training, seed=0), data_position=position)  # not due: not asked
        assert not asked
        assert ckpt.save(2, random_state(training, seed=0), data_position=position)
        ckpt.wait()
        expected = [next(data) for _ in range(2)]
        _, meta, _ = ckpt.restore(training.abstract_state())
        ckpt.save(4, random_state(training, seed=0))
        ckpt.wait()
        assert "data_position" not in ckpt.restore(training.abstract_state())[1]
    resumed = iterator()
    resumed.set_state(meta["data_position"]["stream"])
    np.testing.assert_array_equal([next(resumed) for _ in range(2)], expected)
    assert asked == [True] and (tmp_path / "2" / "data_position").is_dir()


def test_model_differences_name_the_first_three_and_count_the_rest(training):
    meta = run_metadata(training.config, training.mesh)
    model = training.config.model
    assert model_differences(meta, model) == ""
    assert model_differences(meta, dataclasses.replace(model, remat="none", dtype="bfloat16")) == ""  # runtime keys
    other = dataclasses.replace(model, num_layers=3, hidden_size=32, head_dim=8, vocab_size=128, rms_norm_eps=1e-6)
    assert model_differences(meta, other) == ("model.head_dim: checkpoint has 16, config has 8; model.hidden_size: "
                                              "checkpoint has 64, config has 32; model.num_layers: checkpoint has 2, "
                                              "config has 3; and 2 more")


def test_model_differences_name_nested_keys_and_allow_moe_training_knobs():
    """DeepSeek-V3 stops its router-bias updates late in training: a run resumes with another rate."""
    from podtrain.orchestrator.config.compose import to_yaml

    config = load_config("deepseek-v3-tiny")
    meta = {"config_yaml": to_yaml(config)}
    moe = config.model.moe
    knobs = dataclasses.replace(moe, bias_update_rate=0.0, capacity_factor=2.0)
    assert model_differences(meta, dataclasses.replace(config.model, moe=knobs)) == ""
    other = dataclasses.replace(config.model, moe=dataclasses.replace(moe, num_experts=2 * moe.num_experts))
    assert model_differences(meta, other) == (f"model.moe.num_experts: checkpoint has {moe.num_experts}, config has "
                                              f"{2 * moe.num_experts}")


@pytest.mark.parametrize("directory, expected", [
    ("gs://bucket/run/checkpoints", "gs://bucket/run/checkpoints"),
    ("/abs/checkpoints", "/abs/checkpoints"),
    ("checkpoints", "/runs/x/checkpoints"),
    ("../elsewhere", "/runs/elsewhere"),
])
def test_checkpoint_directory_keeps_urls_and_resolves_paths_under_the_run(directory, expected):
    assert checkpoint_directory(directory, "/runs/x") == expected


def resume(path, mode, abstract):
    with checkpointer(path, resume=mode) as ckpt:
        return ckpt.resume(abstract)


def test_resume_modes(training, tmp_path):
    abstract = training.abstract_state()
    assert resume(tmp_path, "auto", abstract) is None
    assert resume(tmp_path, "none", abstract) is None
    with checkpointer(tmp_path) as ckpt:
        ckpt.save(2, random_state(training, seed=0))
        ckpt.save(4, random_state(training, seed=1))
    with pytest.raises(ConfigError, match=r"checkpoint.resume=3: no such step in .* \(steps: \[2, 4\]\)"):
        resume(tmp_path, "3", abstract)
    assert resume(tmp_path, "auto", abstract)[2] == 4
    with pytest.raises(ConfigError, match=r"checkpoint.resume=none, but .* already holds steps \[2, 4\]"):
        resume(tmp_path, "none", abstract)
    assert resume(tmp_path, "4", abstract)[2] == 4
    assert resume(tmp_path, "2", abstract)[2] == 2  # sets step 4 aside: see the next test


def test_resume_of_an_older_step_sets_the_newer_ones_aside_and_saves_them_again(training, tmp_path, caplog):
    """Orbax skips saving any step not newer than its latest: left in place, steps 4 and 6 of the old
    run would stay on disk instead of the resumed run's, and a later `auto` would continue the old run."""
    old, new = random_state(training, seed=5), random_state(training, seed=6)
    with checkpointer(tmp_path) as ckpt:
        for step in (2, 4, 6):
            ckpt.save(step, old)
    before = files(tmp_path)
    with checkpointer(tmp_path, resume="2") as ckpt, caplog.at_level(logging.WARNING, logger=CHECKPOINT_LOGGER):
        assert ckpt.resume(training.abstract_state())[2] == 2
        assert ckpt.all_steps() == [2]
        assert ckpt.save(4, new)
        ckpt.wait()
    [warning] = [r.getMessage() for r in caplog.records if r.name == CHECKPOINT_LOGGER]
    assert f"checkpoint steps [4, 6] in {tmp_path} renamed to 4.superseded, 6.superseded" in warning
    assert "checkpoint.resume=2" in warning
    after, moved = files(tmp_path), {"4": "4.superseded", "6": "6.superseded"}
    for name, data in before.items():  # nothing lost: the old steps are kept under their new names
        top, rest = name.split("/", 1)
        assert after[f"{moved.get(top, top)}/{rest}"] == data
    assert resume(tmp_path, "auto", training.abstract_state())[2] == 4
    assert_bit_equal(resume(tmp_path, "auto", training.abstract_state())[0], new)
    assert resume(tmp_path, "2", training.abstract_state())[2] == 2  # a second time: 4.superseded is taken
    assert sorted(p.name for p in tmp_path.iterdir()) == ["2", "4.superseded", "4.superseded.2", "6.superseded"]


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"resume": "latest"}, "checkpoint.resume: expected 'auto', 'none' or a step number, found 'latest'"),
        ({"keep": 0}, "checkpoint.keep: expected a positive integer, found 0"),
        ({"every_steps": -1}, "checkpoint.every_steps: expected a positive integer, found -1"),
        ({"host_gb": -1}, "checkpoint.host_gb: expected 0 \\(no bound\\) or a positive number of GB, found -1"),
    ],
)
def test_config_errors_name_the_key(changes, message):
    with pytest.raises(ValueError, match=message):
        CheckpointConfig(**changes).validate()
