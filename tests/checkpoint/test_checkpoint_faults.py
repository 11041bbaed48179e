"""Checkpoint faults: damaged steps fall back, and unwritable, unshared or full directories are one clear error."""

import asyncio
import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import orbax.checkpoint as ocp
import pytest
import tensorstore as ts
from checkpoint_fixtures import (
    CHECKPOINT_LOGGER,
    EVENT_LOOP_CLOSED,
    assert_bit_equal,
    checkpointer,
    files,
    random_state,
    tiny_training,
)
from xla_flags import xla_flags

from podtrain.orchestrator.checkpoint.checkpointer import CheckpointWriteError, NoRestorableCheckpointError
from podtrain.orchestrator.common.errors import ConfigError

pytestmark = EVENT_LOOP_CLOSED


@pytest.fixture(scope="module")
def training():
    return tiny_training()


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
    # Garbled bytes fail to decompress, or decode without error into other values: then the saved
    # fingerprints tell (which of the two depends on where the bytes fall in the chunks).
    (garble_data_files, r"ValueError|arrays read differ from the ones saved: \."),
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
    assert f"checkpoint step 4 in {tmp_path} cannot be restored (" in failed and re.search(reason, failed)
    assert "4.damaged" in renamed
    # Nothing is deleted or changed: the damaged step is renamed so that Orbax ignores it, and the
    # run can checkpoint step 4 again (Orbax skips saves of steps not newer than its latest).
    assert files(tmp_path) == {name.replace("4/", "4.damaged/", 1) if name.startswith("4/") else name: data
                               for name, data in before.items()}
    with checkpointer(tmp_path) as ckpt:
        assert ckpt.all_steps() == [2] and ckpt.save(4, newer)
        ckpt.wait()
        assert ckpt.restore_latest(training.abstract_state())[2] == 4


def test_an_array_that_reads_back_different_from_the_saved_one_is_a_damaged_step(training, tmp_path, caplog):
    """What garbled bytes that still decompress look like: every file reads, one array's values
    differ from its saved fingerprint."""
    older, newer = random_state(training, seed=2), random_state(training, seed=3)
    with checkpointer(tmp_path) as ckpt:
        ckpt.save(2, older)
        ckpt.save(4, newer)
        ckpt.wait()
    fingerprints = tmp_path / "4" / "fingerprints" / "metadata"
    saved = json.loads(fingerprints.read_text())
    leaf = next(path for path in saved if path.startswith(".params"))
    saved[leaf] = [(saved[leaf][0] + 1) % 2**32, saved[leaf][1]]
    fingerprints.write_text(json.dumps(saved))
    with checkpointer(tmp_path) as ckpt, caplog.at_level(logging.WARNING, logger=CHECKPOINT_LOGGER):
        restored, _, step = ckpt.restore_latest(training.abstract_state())
    assert step == 2
    assert_bit_equal(restored, older)
    [failed, renamed] = [r.getMessage() for r in caplog.records if r.name == CHECKPOINT_LOGGER]
    assert f"cannot be restored (arrays read differ from the ones saved: {leaf})" in failed
    assert "4.damaged" in renamed


def complete_a_read_on_a_closed_loop():
    """What a read Orbax abandoned does: tensorstore completes its future after the loop that awaited
    it was closed, and reports the closed loop as an unraisable error."""
    promise, future = ts.Promise.new()

    async def read():
        await future

    loop = asyncio.new_event_loop()
    task = loop.create_task(read())
    loop.run_until_complete(asyncio.sleep(0))
    loop.close()
    task._log_destroy_pending = False  # the pending task is the point, not news
    promise.set_result(None)


def test_reads_a_damaged_step_abandons_say_nothing_even_before_its_error_is_caught(training, tmp_path,
                                                                                    monkeypatch):
    state = random_state(training, seed=0)
    with checkpointer(tmp_path) as ckpt:
        ckpt.save(2, state)
        ckpt.save(4, state)
        ckpt.wait()
    restore = ocp.StandardCheckpointHandler.restore

    def failing_at_step_4(self, directory, *args, **kwargs):
        if directory.parent.name == "4":
            complete_a_read_on_a_closed_loop()  # before Orbax's error leaves its restore
            raise ValueError("OUT_OF_RANGE: Error reading an array")
        return restore(self, directory, *args, **kwargs)

    reported = []
    monkeypatch.setattr(ocp.StandardCheckpointHandler, "restore", failing_at_step_4)
    monkeypatch.setattr(sys, "unraisablehook", reported.append)
    with checkpointer(tmp_path) as ckpt:
        assert ckpt.restore_latest(training.abstract_state())[2] == 2
    assert reported == []


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


SHARED_PROBE = """
import sys
import jax
jax.distributed.initialize(f"127.0.0.1:{sys.argv[1]}", num_processes=2, process_id=int(sys.argv[2]),
                           initialization_timeout=60)
from podtrain.orchestrator.checkpoint.directory import check_shared
from podtrain.orchestrator.common.errors import ConfigError
try:
    check_shared(sys.argv[3])
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

    port, root = free_port("127.0.0.1"), Path(__file__).parents[2]
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
from checkpoint_fixtures import random_state, tiny_training
from podtrain.orchestrator.checkpoint.checkpointer import Checkpointer, CheckpointWriteError
from podtrain.orchestrator.config.schema import CheckpointConfig
training = tiny_training()
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
    root = Path(__file__).parents[2]
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
