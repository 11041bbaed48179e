"""The training loop end to end, as real `podtrain train cluster=none` processes: determinism, resume, SIGTERM."""

import json
import os
import signal
import subprocess
from pathlib import Path

import numpy as np
import pytest
from train_fixtures import ROOT, TINY, command, env, losses, tensorboard_scalars, train, wait_for_step


@pytest.mark.slow
def test_same_seed_same_losses_and_kill_resume_is_bit_exact(tmp_path):
    reference = tmp_path / "reference"
    out = train(reference, 8)
    assert "loss first" in out.stdout and (reference / "config.yaml").exists()
    assert sorted(os.listdir(reference / "checkpoints")) == ["4", "6", "8"]  # keep=3
    again = tmp_path / "again"
    train(again, 8)
    assert losses(again) == losses(reference)

    killed = tmp_path / "killed"
    proc = subprocess.Popen(command(killed, 8), cwd=ROOT, env=env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    wait_for_step(killed, proc, 5)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    committed = sorted(int(p) for p in os.listdir(killed / "checkpoints") if p.isdigit())
    assert committed and committed[-1] < 8
    out = train(killed, 8)
    assert f"steps {committed[-1]} -> 8" in out.stdout
    assert losses(killed) == losses(reference)
    # One record per step: what the killed attempt logged after its last checkpoint was dropped, in
    # metrics.jsonl and in TensorBoard.
    records = [json.loads(line) for line in (killed / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 9))
    loss_points = tensorboard_scalars(killed / "tensorboard")["loss"]
    assert [step for step, _ in loss_points] == list(range(1, 9))
    assert np.allclose([v for _, v in loss_points], [r["loss"] for r in records])


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_sigterm_checkpoints_and_exits_with_the_preemption_code(tmp_path, signum):
    """SIGTERM, and with cluster=none a first Ctrl-C (SIGINT), checkpoint at the next step and exit 75."""
    run_dir = tmp_path / "preempted"
    own_cache = {k: v for k, v in env().items() if k != "JAX_COMPILATION_CACHE_DIR"}  # the run's default cache
    proc = subprocess.Popen(command(run_dir, 1000, every=500), cwd=ROOT, env=own_cache,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_step(run_dir, proc, 3)
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 75, err[-3000:]
    last = max(losses(run_dir))
    assert sorted(int(p) for p in os.listdir(run_dir / "checkpoints")) == [last]
    assert "preemption notice" in out
    cached = [p.name for p in (run_dir / "compilation_cache").iterdir()]
    assert any("train_step" in name for name in cached)  # for the restart
    assert any(name.startswith("jit__lambda") for name in cached)  # short init programs too (JAX skips < 1 s)


def test_sigterm_while_the_run_builds_stops_it_after_its_first_step(tmp_path, monkeypatch):
    """A notice that arrives before the loop (here: while the train step is built; on a pod, during
    a minutes-long restore) is not lost: the run trains one step, checkpoints it and reports preempted."""
    import podtrain.orchestrator.train.loop as train_module
    from podtrain.orchestrator.config.compose import load_config

    real_build = train_module.build_training

    def build_then_sigterm(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        return real_build(*args, **kwargs)

    monkeypatch.setattr(train_module, "build_training", build_then_sigterm)
    config = load_config("llama3-tiny", [*TINY, "mesh.fsdp=4", "mesh.tp=2", "train.steps=50",
                                         "checkpoint.every_steps=25"])
    before = signal.getsignal(signal.SIGTERM)
    result = train_module.run(config, tmp_path / "run")
    assert result.preempted and (result.start_step, result.end_step, result.last_checkpoint) == (0, 1, 1)
    assert signal.getsignal(signal.SIGTERM) is before  # the run's handler is gone again


@pytest.mark.slow
def test_finite_data_stops_the_run_with_a_checkpoint_and_resume_mistakes_are_one_line(tmp_path):
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"document {i}: " + "abc" * 9}) + "\n" for i in range(8)))
    run_dir = tmp_path / "finite"
    data = ["data.source=jsonl", f"data.path={corpus}", "data.epochs=1", "data.eval_fraction=0", "train.eval_every=0"]
    out = train(run_dir, 50, *data)
    last = max(losses(run_dir))
    assert 1 < last < 50 and f"stopped at step {last}: the training data ended (data.epochs)" in out.stdout
    # podtrain's INFO lines show
    assert "INFO podtrain.orchestrator.train.loop: starting at step 0 (fresh)" in out.stderr
    assert "WARNING podtrain.orchestrator.train.loop: the training data ended" in out.stderr
    assert "INFO absl" not in out.stderr
    assert max(int(p) for p in os.listdir(run_dir / "checkpoints")) == last
    again = train(run_dir, 50, *data)  # resumes at the end of the data: nothing to train, still a success
    assert f"nothing to do: the run is already at step {last}" in again.stdout and max(losses(run_dir)) == last
    for override, needle in (("checkpoint.resume=none", "checkpoint.resume=none, but"),
                             ("checkpoint.resume=1", "checkpoint.resume=1: no such step"),
                             ("model.num_kv_heads=2", "was trained with a different model: model.num_kv_heads: "
                                                      "checkpoint has 4, config has 2"),
                             ("train.batch_size=2", "the saved data position has 4 rows, but this run has "
                                                    "train.batch_size=2")):
        key = override.partition("=")[0]
        cmd = [arg for arg in command(run_dir, 50, *data) if not arg.startswith(key + "=")] + [override]
        done = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
        assert done.returncode == 2 and needle in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]


def test_a_bad_document_found_mid_run_is_one_line_exit_2_and_keeps_the_checkpoints(tmp_path):
    lines = [json.dumps({"text": f"document {i} " * 2}) for i in range(40)]
    lines[24] = json.dumps({"body": "no text field"})  # its row reads it after the first checkpoints
    corpus = tmp_path / "d.jsonl"
    corpus.write_text("\n".join(lines) + "\n")
    run_dir = tmp_path / "bad-doc"
    done = subprocess.run(command(run_dir, 50, "data.source=jsonl", f"data.path={corpus}", "data.eval_fraction=0.0",
                                  "train.eval_every=0"), cwd=ROOT, env=env(), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.splitlines()[-1] == (f"podtrain: error: {corpus}, line 25: data.text_field='text' not found; "
                                            "the line has keys ['body']")
    assert "Traceback" not in done.stderr
    trained = max(losses(run_dir))
    assert 2 <= trained < 50 and max(int(p) for p in os.listdir(run_dir / "checkpoints")) >= 2


def test_tokenizer_larger_than_model_vocab_is_a_clear_error(tmp_path):
    cmd = [arg for arg in command(tmp_path / "r", 2) if not arg.startswith("model.vocab_size=")]
    done = subprocess.run(cmd + ["model.vocab_size=200"], cwd=ROOT, env=env(),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "259" in done.stderr and "200" in done.stderr and "Traceback" not in done.stderr


def data_files(step_dir: Path) -> list[Path]:
    """The files holding the arrays' bytes of a checkpoint step, as each process wrote them."""
    return sorted(step_dir.glob("state/ocdbt.process_*/d/*"))


def truncate_largest(files: list[Path]) -> None:
    largest = max(files, key=lambda p: p.stat().st_size)
    largest.write_bytes(largest.read_bytes()[: largest.stat().st_size // 2])


@pytest.mark.slow
def test_a_damaged_array_file_in_the_newest_checkpoint_falls_back_and_trains_as_if_uninterrupted(tmp_path):
    constant = "optimizer.schedule=constant"  # so that a 6-step run's steps equal an 8-step run's
    reference, run_dir = tmp_path / "reference", tmp_path / "damaged"
    train(reference, 8, constant)
    train(run_dir, 6, constant)
    truncate_largest(data_files(run_dir / "checkpoints" / "6"))
    done = train(run_dir, 8, constant)
    assert "steps 4 -> 8" in done.stdout
    assert "checkpoint step 6 in" in done.stderr and "cannot be restored (ValueError: OUT_OF_RANGE" in done.stderr
    assert "renamed to 6.damaged" in done.stderr and "Traceback" not in done.stderr
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["4", "6", "6.damaged", "8"]
    assert losses(run_dir) == losses(reference)


@pytest.mark.slow
def test_a_single_text_file_trains_with_and_without_an_eval_split(tmp_path):
    """A book-like file: one file, paragraphs between blank lines. Its few eval paragraphs are shared
    by the batch rows; with data.eval_fraction=0 the run trains without evals."""
    rng = np.random.default_rng(0)
    words = ["the", "king", "said", "to", "his", "fool", "and", "all", "were", "merry", "that", "night"]
    paragraphs = [" ".join(rng.choice(words, 30)) + ".\n" + " ".join(rng.choice(words, 20)) + "." for _ in range(300)]
    book = tmp_path / "book.txt"
    book.write_text("\n\n".join(paragraphs) + "\n")
    data = ["data.source=text", f"data.path={book}", "train.eval_every=2", "train.eval_batches=1"]
    with_evals = tmp_path / "with-evals"
    train(with_evals, 4, *data)  # 3 eval paragraphs (data.eval_fraction=0.01) for 4 batch rows
    records = [json.loads(line) for line in (with_evals / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4] and "eval_loss" in records[1] and "eval_loss" in records[3]
    without = tmp_path / "without-evals"
    done = train(without, 4, *data, "data.eval_fraction=0")
    assert "data.eval_fraction=0 holds out no documents: no eval losses" in done.stderr
    records = [json.loads(line) for line in (without / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4] and not any("eval_loss" in r for r in records)
    done = subprocess.run(command(tmp_path / "one-document", 4, *data, "data.documents=file"), cwd=ROOT, env=env(),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "the train split has 1 documents" in done.stderr, done.stderr[-2000:]
    assert "data.documents" in done.stderr


def on_local_cluster(cmd: list[str]) -> list[str]:
    """`cmd` with the default cluster kind (local) and 2 simulated hosts instead of cluster=none."""
    return [arg for arg in cmd if arg != "cluster=none"] + ["cluster.num_hosts=2", "cluster.devices_per_host=2"]


def snapshot(directory: Path) -> dict[str, tuple[bytes, int]]:
    return {str(p.relative_to(directory)): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(directory.rglob("*")) if p.is_file()}


def bad_inputs(tmp_path: Path) -> dict[str, tuple[list[str], str]]:
    """Overrides that name inputs a run cannot use, and what the error says."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "a-file").write_text("not a directory\n")
    (tmp_path / "lib.jsonl").write_bytes(bytes(range(256)) * 64)  # a binary file named like a corpus
    return {
        "missing data path": (["data.source=text", f"data.path={tmp_path}/missing"], f"data.path='{tmp_path}/missing'"),
        "empty directory": (["data.source=text", f"data.path={tmp_path}/empty"], f"data.path='{tmp_path}/empty'"),
        "empty corpus": (["data.source=jsonl", f"data.path={tmp_path}/empty.jsonl"], "found none"),
        "checkpoint dir is a file": ([f"checkpoint.dir={tmp_path}/a-file"], f"checkpoint.dir={tmp_path}/a-file"),
        "binary jsonl": (["data.source=jsonl", f"data.path={tmp_path}/lib.jsonl"], f"{tmp_path}/lib.jsonl"),
    }


@pytest.mark.slow
def test_bad_input_under_the_local_cluster_is_one_line_exit_2_and_writes_nothing(tmp_path):
    """Checked by the driver before Ray starts: a new run leaves no directory, and a rerun of a run
    leaves every file of it as it was (config.yaml included)."""
    cases = bad_inputs(tmp_path)
    for case, (overrides, needle) in cases.items():
        run_dir = tmp_path / "new" / case.replace(" ", "-")
        done = subprocess.run(on_local_cluster(command(run_dir, 4)) + overrides, cwd=ROOT, env=env(),
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 2, (case, done.stdout[-2000:], done.stderr[-2000:])
        [line] = done.stderr.splitlines()
        assert line.startswith("podtrain: error: ") and needle in line, (case, line)
        assert done.stdout == "" and not run_dir.parent.exists(), (case, done.stdout)
    existing = tmp_path / "existing"
    train(existing, 2)
    before = snapshot(existing)
    for case, (overrides, needle) in cases.items():
        done = subprocess.run(on_local_cluster(command(existing, 4)) + overrides, cwd=ROOT, env=env(),
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 2 and needle in done.stderr and len(done.stderr.splitlines()) == 1, case
        assert snapshot(existing) == before, case


@pytest.mark.slow
def test_a_second_run_of_the_same_name_is_refused_and_a_killed_owner_leaves_no_lock(tmp_path):
    run_dir = tmp_path / "owned"
    owner = subprocess.Popen(command(run_dir, 1000), cwd=ROOT, env=env(), stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    try:
        wait_for_step(run_dir, owner, 2)
        for cmd in (command(run_dir, 1000), on_local_cluster(command(run_dir, 1000))):
            done = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
            assert done.returncode == 2, done.stderr[-3000:]
            [line] = done.stderr.splitlines()
            assert line.startswith(f"podtrain: error: run directory {run_dir} is in use by podtrain train "
                                   f"cluster=none (pid {owner.pid} on "), line
            assert line.endswith("wait for it to end or stop it, or choose another run.name")
    finally:
        owner.kill()
        owner.wait()
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, len(steps) + 1))  # only the owner wrote
    last = max(int(p) for p in os.listdir(run_dir / "checkpoints") if p.isdigit())
    done = train(run_dir, last + 2)  # the kernel released the killed owner's lock
    assert f"steps {last} -> {last + 2}" in done.stdout and not (run_dir / "podtrain.lock").exists()
