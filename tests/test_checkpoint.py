"""Orbax checkpoints: bit-exact round trips and resume, keep-last-K, damaged steps, other meshes."""

import dataclasses
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import grain
import jax
import numpy as np
import pytest
import yaml
from xla_flags import xla_flags

from podtrain.orchestrator.build import build_training
from podtrain.orchestrator.checkpoint import (
    Checkpointer,
    CheckpointWriteError,
    NoRestorableCheckpointError,
    run_metadata,
)
from podtrain.orchestrator.config import ConfigError, checkpoint_directory, load_config
from podtrain.orchestrator.resume import model_differences
from podtrain.orchestrator.schema import CheckpointConfig

# A restore that fails part way leaves tensorstore reads in flight; they complete on tensorstore's threads after
# Orbax closed its event loop, which Python reports as an unraisable "Event loop is closed" (harmless).
pytestmark = pytest.mark.filterwarnings(
    "ignore:(?s)Exception ignored in.*Event loop is closed:pytest.PytestUnraisableExceptionWarning"
)

CHECKPOINT_LOGGER = "podtrain.orchestrator.checkpoint"
TINY = ["model.num_layers=2", "model.hidden_size=64", "model.intermediate_size=128", "model.vocab_size=256",
        "model.head_dim=16", "model.num_heads=4", "model.num_kv_heads=2", "train.batch_size=8", "train.seq_len=16"]


@pytest.fixture(scope="module")
def training():
    """fsdp=4 x tp=2 on the 8 fake devices."""
    return build_training(load_config("llama3-tiny", TINY + ["mesh.fsdp=4", "mesh.tp=2"]))


def random_state(training, seed):
    """Random values in every leaf, placed with the state's shardings, without compiling the model's init.

    Non-negative floats keep Adam's second moments valid, so the state also trains.
    """
    rng = np.random.default_rng(seed)

    def leaf(abstract):
        if np.issubdtype(abstract.dtype, np.integer):
            value = np.zeros(abstract.shape, abstract.dtype)
        else:
            value = (0.02 * np.abs(rng.standard_normal(abstract.shape))).astype(abstract.dtype)
        return jax.make_array_from_callback(abstract.shape, abstract.sharding, lambda index: value[index])

    return jax.tree.map(leaf, training.abstract_state())


def assert_bit_equal(actual, expected):
    actual_leaves, actual_tree = jax.tree.flatten(actual)
    expected_leaves, expected_tree = jax.tree.flatten(expected)
    assert actual_tree == expected_tree
    for a, e in zip(actual_leaves, expected_leaves, strict=True):
        assert a.dtype == e.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(e), strict=True)


def checkpointer(path, **changes):
    return Checkpointer(path, CheckpointConfig(**{"every_steps": 2, "keep": 5} | changes))


def files(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


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
    assert meta["mesh"]["axes"] == {"dp": 1, "fsdp": 4, "ep": 1, "tp": 2}
    assert yaml.safe_load(meta["config_yaml"])["model"]["hidden_size"] == 64


def test_training_continues_bit_identically_after_restore(training, tmp_path):
    """Save asynchronously, keep training (donating the state), then replay the same batches from the checkpoint."""
    batches = [training.random_batch(seed) for seed in range(4)]
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


def truncate_array_files(step_dir: Path):
    for path in (step_dir / "state" / "d").iterdir():
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def delete_array_files(step_dir: Path):
    for path in (step_dir / "state" / "d").iterdir():
        path.unlink()


def data_files(step_dir: Path) -> list[Path]:
    """The files holding the arrays' bytes that each process wrote (the OCDBT index is in state/d)."""
    return sorted(step_dir.glob("state/ocdbt.process_*/d/*"))


def truncate_a_data_file(step_dir: Path):
    largest = max(data_files(step_dir), key=lambda p: p.stat().st_size)
    largest.write_bytes(largest.read_bytes()[: largest.stat().st_size // 2])


def garble_data_files(step_dir: Path):
    for path in data_files(step_dir):
        data = bytearray(path.read_bytes())
        middle = len(data) // 2
        data[middle : middle + 64] = bytes(255 - b for b in data[middle : middle + 64])
        path.write_bytes(bytes(data))


def break_metadata(step_dir: Path):
    (step_dir / "state" / "_METADATA").write_text('{"tree_metadata": ')


@pytest.mark.parametrize("damage, reason", [
    (truncate_array_files, "ValueError"), (delete_array_files, "ValueError"),
    (truncate_a_data_file, "ValueError: OUT_OF_RANGE"),
    # Garbled bytes inside a compressed chunk may decode without error: the saved fingerprints tell.
    (garble_data_files, "arrays read differ from the ones saved: ."),
    (break_metadata, "JSONDecodeError"),
])
def test_damaged_latest_step_falls_back_to_the_previous_one(training, tmp_path, caplog, damage, reason):
    older, newer = random_state(training, seed=2), random_state(training, seed=3)
    with checkpointer(tmp_path) as ckpt:
        ckpt.save(2, older)
        ckpt.save(4, newer)
        ckpt.wait()
    damage(tmp_path / "4")
    before = files(tmp_path)
    with checkpointer(tmp_path) as ckpt, caplog.at_level(logging.WARNING, logger=CHECKPOINT_LOGGER):
        restored, meta, step = ckpt.restore_latest(training.abstract_state())
    assert (step, meta["step"]) == (2, 2)
    assert_bit_equal(restored, older)
    failed, renamed = [r.getMessage() for r in caplog.records if r.name == CHECKPOINT_LOGGER]
    assert f"checkpoint step 4 in {tmp_path} cannot be restored (" in failed and reason in failed
    assert "4.damaged" in renamed
    # Nothing is deleted or changed: the damaged step is renamed so that Orbax ignores it, and the
    # run can checkpoint step 4 again (Orbax skips saves of steps not newer than its latest).
    assert files(tmp_path) == {name.replace("4/", "4.damaged/", 1) if name.startswith("4/") else name: data
                               for name, data in before.items()}
    with checkpointer(tmp_path) as ckpt:
        assert ckpt.all_steps() == [2] and ckpt.save(4, newer)
        ckpt.wait()
        assert ckpt.restore_latest(training.abstract_state())[2] == 4


def test_all_steps_damaged_is_a_clear_error(training, tmp_path):
    state = random_state(training, seed=0)
    with checkpointer(tmp_path) as ckpt:
        ckpt.save(2, state)
        ckpt.save(4, state)
        ckpt.wait()
    truncate_array_files(tmp_path / "2")
    delete_array_files(tmp_path / "4")
    with checkpointer(tmp_path) as ckpt, pytest.raises(NoRestorableCheckpointError) as raised:
        ckpt.restore_latest(training.abstract_state())
    assert list(raised.value.failures) == [4, 2]
    assert f"no checkpoint in {tmp_path} can be restored (step 4: ValueError" in str(raised.value)
    assert "; step 2: ValueError" in str(raised.value)


def test_uncommitted_tmp_dir_is_ignored(training, tmp_path):
    state = random_state(training, seed=0)
    with checkpointer(tmp_path) as ckpt:
        ckpt.save(2, state)
    interrupted = tmp_path / "8.orbax-checkpoint-tmp" / "state"
    interrupted.mkdir(parents=True)
    (interrupted / "_METADATA").write_text("half written")
    with checkpointer(tmp_path) as ckpt:
        assert ckpt.all_steps() == [2]
        _, _, step = ckpt.restore_latest(training.abstract_state())
    assert step == 2
    assert (interrupted / "_METADATA").read_text() == "half written"


@pytest.mark.parametrize("mesh, num_devices", [(["mesh.fsdp=2", "mesh.tp=2"], 4), (["mesh.fsdp=1", "mesh.dp=8"], 8)])
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
    from podtrain.orchestrator.config import to_yaml

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
    ],
)
def test_config_errors_name_the_key(changes, message):
    with pytest.raises(ValueError, match=message):
        CheckpointConfig(**changes).validate()


SHARED_PROBE = """
import sys
import jax
jax.distributed.initialize(f"127.0.0.1:{sys.argv[1]}", num_processes=2, process_id=int(sys.argv[2]),
                           initialization_timeout=60)
from podtrain.orchestrator.checkpoint import _check_shared
from podtrain.orchestrator.config import ConfigError
try:
    _check_shared(sys.argv[3])
    print("shared")
except ConfigError as e:
    print("error:", e)
"""


@pytest.mark.slow
@pytest.mark.parametrize("same", [True, False])
def test_checkpoint_dir_must_be_shared_by_processes(tmp_path, same):
    """Two JAX processes: a directory both see passes; one that is not the same for process 1 (here a
    different local folder, as a local path on separate hosts would be) is one error on every process."""
    from podtrain.orchestrator.cluster.host import free_port

    port, root = free_port("127.0.0.1"), Path(__file__).parent.parent
    dirs = [tmp_path / "ckpt", tmp_path / ("ckpt" if same else "elsewhere")]
    env = dict(os.environ, PYTHONPATH=str(root), XLA_FLAGS=xla_flags(1), JAX_PLATFORMS="cpu")
    procs = [subprocess.Popen([sys.executable, "-c", SHARED_PROBE, str(port), str(i), str(dirs[i])], cwd=root,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    outputs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outputs
    lines = [out.strip().splitlines()[-1] for out, _ in outputs]
    if same:
        assert lines == ["shared", "shared"], outputs
    else:
        for line in lines:
            assert line.startswith("error: checkpoint.dir=") and "processes [1] do not see" in line, outputs
    assert not list(dirs[0].glob(".podtrain-shared-*")), "the probe file is removed"


FAILING_SAVE = """
import resource, signal, sys
from test_checkpoint import TINY, Checkpointer, CheckpointConfig, CheckpointWriteError, build_training, load_config
from test_checkpoint import random_state
training = build_training(load_config("llama3-tiny", TINY + ["mesh.fsdp=4", "mesh.tp=2"]))
older, newer = random_state(training, seed=7), random_state(training, seed=8)
with Checkpointer(sys.argv[1], CheckpointConfig(every_steps=2, async_save=sys.argv[2] == "async")) as ckpt:
    ckpt.save(2, older)
    ckpt.wait()
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the kernel ends the process
    resource.setrlimit(resource.RLIMIT_FSIZE, (32 << 10, resource.RLIM_INFINITY))
    try:
        ckpt.save(4, newer)
        ckpt.save(6, newer)  # an async save of 4 fails here, while this one waits for it
    except CheckpointWriteError as e:
        print(f"step {e.step}: {e}")
"""


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_save_that_cannot_be_written_is_one_error_and_keeps_the_committed_steps(training, tmp_path, mode):
    """Writes past a file size limit fail (EFBIG) as they do on a full disk (ENOSPC), even for root. In
    a process of its own: Orbax's abandoned write tasks report their errors as that process ends."""
    root = Path(__file__).parent.parent
    done = subprocess.run([sys.executable, "-c", FAILING_SAVE, str(tmp_path), mode], cwd=root, capture_output=True,
                          text=True, timeout=300, env=dict(os.environ, PYTHONPATH=f"{root}:{root / 'tests'}"))
    lines = [line for line in done.stdout.splitlines() if line.startswith("step ")]
    assert done.returncode == 0 and len(lines) == 1, done.stderr[-3000:]
    assert lines[0].startswith(f"step 4: checkpoint step 4 could not be written to {tmp_path} (")
    assert "File too large" in lines[0] and lines[0].endswith("the steps committed before it are kept: free space "
                                                              "or fix the storage, then resume")
    older, newer = random_state(training, seed=7), random_state(training, seed=8)
    with checkpointer(tmp_path) as ckpt:
        assert ckpt.all_steps() == [2]
        restored, _, step = ckpt.restore_latest(training.abstract_state())
        assert step == 2
        assert_bit_equal(restored, older)
        assert ckpt.save(4, newer)
        ckpt.wait()
        assert_bit_equal(ckpt.restore(training.abstract_state())[0], newer)


def test_the_cli_prints_a_failed_save_as_one_line(monkeypatch, capsys):
    """Exit status 1 and one line; any other RuntimeError keeps its traceback."""
    import podtrain.launch.train
    from podtrain.launch.cli import main

    raised = [CheckpointWriteError(15, "/runs/x/ck", OSError(28, "No space left on device")), RuntimeError("a bug")]

    def run_command(args):
        raise raised.pop(0)

    monkeypatch.setattr(podtrain.launch.train, "run_command", run_command)
    assert main(["train"]) == 1
    assert capsys.readouterr().err == (
        "podtrain: error: checkpoint step 15 could not be written to /runs/x/ck (OSError: [Errno 28] No space left "
        "on device); the steps committed before it are kept: free space or fix the storage, then resume\n"
    )
    with pytest.raises(RuntimeError, match="^a bug$"):
        main(["train"])


def unwritable(directory, reason: str) -> str:
    """The start of the error for `directory`, as a regex; `reason` is one too (the OS error's text)."""
    return (f"^checkpoint.dir={re.escape(str(directory))}: cannot create or write the checkpoint directory "
            f"\\({reason}\\): expected a directory podtrain can create and write")


def test_a_file_in_the_checkpoint_path_is_one_config_error(tmp_path):
    (tmp_path / "afile").write_text("")
    with pytest.raises(ConfigError, match=unwritable(tmp_path / "afile" / "ck", "Not a directory")):
        checkpointer(tmp_path / "afile" / "ck")
    with pytest.raises(ConfigError, match=unwritable(tmp_path / "afile", "Not a directory")):
        checkpointer(tmp_path / "afile")


def test_a_directory_that_takes_no_file_opens_for_reading_and_fails_resume(training):
    """/proc/sys exists and takes no new file, even from root: export may read there, a run may not
    start there (its first save would fail)."""
    with checkpointer("/proc/sys") as ckpt:
        assert ckpt.all_steps() == []
        with pytest.raises(ConfigError, match=unwritable("/proc/sys", ".+")):
            ckpt.resume(training.abstract_state())


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only directory regardless of its mode")
def test_a_read_only_directory_restores_but_fails_resume(training, tmp_path):
    state = random_state(training, seed=9)
    with checkpointer(tmp_path / "ck") as ckpt:
        ckpt.save(2, state)
    (tmp_path / "ck").chmod(0o500)
    try:
        with checkpointer(tmp_path / "ck") as ckpt:
            assert_bit_equal(ckpt.restore(training.abstract_state())[0], state)
            with pytest.raises(ConfigError, match=unwritable(tmp_path / "ck", "Permission denied")):
                ckpt.resume(training.abstract_state())
    finally:
        (tmp_path / "ck").chmod(0o700)


def test_the_write_probe_leaves_nothing_behind(training, tmp_path):
    with checkpointer(tmp_path / "new" / "ck") as ckpt:
        assert ckpt.resume(training.abstract_state()) is None
    assert [p.name for p in (tmp_path / "new").iterdir()] == ["ck"] and not list((tmp_path / "new" / "ck").iterdir())
