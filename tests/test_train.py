"""The training loop end to end, as real `podtrain train cluster=none` processes: determinism, resume, SIGTERM."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from xla_flags import xla_flags

ROOT = Path(__file__).parent.parent
TINY = ["model.num_layers=2", "model.hidden_size=64", "model.intermediate_size=128", "model.vocab_size=384",
        "model.head_dim=16", "train.batch_size=4", "train.seq_len=32", "checkpoint.async_save=false",
        "train.peak_flops_per_device=1e9"]


def command(run_dir: Path, steps: int, *extra: str, every: int = 2) -> list[str]:
    return [sys.executable, "-m", "podtrain.launch.cli", "train", "-c", "llama3-tiny", *TINY, "cluster=none",
            f"train.steps={steps}", f"checkpoint.every_steps={every}", f"run.dir={run_dir.parent}",
            f"run.name={run_dir.name}", *extra]


def env():
    return dict(os.environ, PYTHONPATH=str(ROOT), XLA_FLAGS=xla_flags(2))


def train(run_dir: Path, steps: int, *extra: str) -> subprocess.CompletedProcess:
    done = subprocess.run(command(run_dir, steps, *extra), cwd=ROOT, env=env(), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def losses(run_dir: Path) -> dict[int, float]:
    """Step -> loss; a step written twice (after a resume) keeps its last value."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records}


def wait_for_step(run_dir: Path, proc: subprocess.Popen, step: int) -> None:
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if (run_dir / "metrics.jsonl").exists() and max(losses(run_dir), default=0) >= step:
            return
        time.sleep(0.2)
    raise AssertionError(f"the run did not reach step {step}: {proc.poll()}")


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


def cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "podtrain.launch.cli", *args], cwd=ROOT, env=env(),
                          capture_output=True, text=True, timeout=timeout)


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


def export(run_dir: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "podtrain.launch.cli", "export", "-c", "llama3-tiny", *TINY, f"checkpoint={run_dir}",
           f"out={out}", *extra]
    return subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_export_writes_the_trained_weights_as_hf_files_transformers_loads(tmp_path):
    import dataclasses

    import jax
    import numpy as np
    import torch
    from flax import nnx
    from transformers import AutoModelForCausalLM

    from podtrain.models import from_hf
    from podtrain.orchestrator.checkpoint.checkpointer import Checkpointer
    from podtrain.orchestrator.config.compose import load_config
    from podtrain.orchestrator.train.build import build_training

    run_dir = tmp_path / "run"
    train(run_dir, 4)
    out = tmp_path / "hf"
    # Trained on fsdp=2, exported from step 2 on a (fsdp=1, tp=2) mesh.
    done = export(run_dir, out, "step=2", "mesh.fsdp=1", "mesh.tp=2")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "exported step 2" in done.stdout and (out / "config.json").exists()
    assert "(data.tokenizer=byte has no HF tokenizer files)" in done.stdout

    config = load_config("llama3-tiny", TINY)
    config = dataclasses.replace(config, mesh=dataclasses.replace(config.mesh, fsdp=1))
    training = build_training(config, jax.devices()[:1])
    with Checkpointer(run_dir / "checkpoints", config.checkpoint) as ckpt:
        trained, _, _ = ckpt.restore_params(training.abstract_params, step=2)
    _, exported = from_hf(out)
    want = {k: np.asarray(v.get_value()) for k, v in nnx.to_flat_state(trained)}
    got = {k: np.asarray(v.get_value()) for k, v in nnx.to_flat_state(nnx.state(exported, nnx.Param))}
    assert want.keys() == got.keys()
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=str(key))

    tokens = np.random.default_rng(0).integers(0, 384, (2, 16))
    ours = np.asarray(exported(jax.numpy.asarray(tokens))[0])
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    # The byte tokenizer's BOS / EOS, so that generate() in transformers stops where training ended documents.
    assert (hf.generation_config.bos_token_id, hf.generation_config.eos_token_id) == (257, 258)
    with torch.no_grad():
        theirs = hf(torch.from_numpy(tokens)).logits.numpy()
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)

    done = export(run_dir, tmp_path / "other", "model.rms_norm_eps=1e-6", "model.remat=none")
    assert done.returncode == 2, done.stderr[-3000:]
    assert "model.rms_norm_eps: checkpoint has 1e-05, config has 1e-06" in done.stderr
    assert f"Pass -c the preset or YAML file it was trained with (the run's resolved config: {run_dir}/config.yaml)" \
        in done.stderr
    assert "remat" not in done.stderr
    assert not (tmp_path / "other").exists()


@pytest.mark.parametrize("add_bos", [True, False])
def test_export_takes_the_training_tokenizer_along(tmp_path, add_bos):
    """A tokenizer.json run: transformers' AutoTokenizer on the exported files encodes as training did."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer

    from podtrain.launch.export import tokenizer_export
    from podtrain.orchestrator.config.compose import load_config
    from podtrain.orchestrator.data.tokenizers import load_tokenizer

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 16)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}",
                                                                "add_bos_token": False}))
    config = load_config("llama3-tiny", [f"data.tokenizer={tmp_path / 'tokenizer.json'}", "data.eos_token=</s>",
                                         "data.bos_token=<s>", f"data.add_bos={str(add_bos).lower()}"])
    config_extra, files = tokenizer_export(config)
    assert config_extra == {"eos_token_id": 2, "bos_token_id": 1}
    out = tmp_path / "out"
    out.mkdir()
    for name, data in files.items():
        (out / name).write_bytes(data)
    theirs = AutoTokenizer.from_pretrained(out)
    ours = load_tokenizer(config.data.tokenizer, eos_token="</s>", bos_token="<s>")
    assert theirs("w3 w4 w5").input_ids == [1] * add_bos + ours.encode("w3 w4 w5").tolist()
    assert (theirs.eos_token, theirs.bos_token, theirs.pad_token) == ("</s>", "<s>", "</s>")
    assert theirs.chat_template == "{{ messages }}"


def test_export_errors_name_the_problem(tmp_path):
    done = export(tmp_path / "missing", tmp_path / "hf")
    assert done.returncode == 2 and "no such directory" in done.stderr and "Traceback" not in done.stderr
    done = cli("export", "-c", "llama3-tiny", f"out={tmp_path}")
    assert done.returncode == 2 and "checkpoint=<dir>" in done.stderr


@pytest.mark.parametrize("out, step, needle", [
    ("a-file", None, "out={out}: is a file; expected a new or empty directory"),
    ("a-file/hf", None, "out={out}: lies under {tmp_path}/a-file, which is a file; expected a new or empty directory"),
    ("/proc/podtrain/hf", None, "out={out}: cannot create a directory in /proc/podtrain (No such file or directory)"),
    ("hf", "4", "checkpoint={checkpoint} is the folder of step 2, but step=4; give the step folder or step=, not both"),
    ("hf", "-1", "export.step: expects a step number >= 0 or null (the newest), found -1"),
])
def test_export_errors_name_out_and_step_before_any_work(tmp_path, capsys, out, step, needle):
    from podtrain.launch.cli import main

    checkpoint = tmp_path / "run" / "checkpoints" / "2"
    (checkpoint / "state").mkdir(parents=True)  # the layout of a committed step; nothing is read before the errors
    (tmp_path / "a-file").write_text("kept\n")
    out = out if out.startswith("/") else tmp_path / out
    extra = [f"step={step}"] if step else []
    assert main(["export", "-c", "llama3-tiny", f"checkpoint={checkpoint}", f"out={out}", *extra]) == 2
    err = capsys.readouterr().err
    assert err == f"podtrain: error: {needle.format(out=out, tmp_path=tmp_path, checkpoint=checkpoint)}\n"
    assert (tmp_path / "a-file").read_text() == "kept\n" and not (tmp_path / "hf").exists()



def tensorboard_scalars(directory: Path) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value), ...] in the order TensorBoard shows them, from the TFRecord event
    files in `directory` (oldest file first); a session start with a step (tensorboardX's
    `purge_step`) drops the events at that step and later, as TensorBoard does."""
    from tensorboardX.proto.event_pb2 import Event, SessionLog

    scalars: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(directory.glob("events.out.tfevents.*"), key=lambda p: (int(p.name.split(".")[3]),
                                                                             p.stat().st_mtime)):
        data, offset = path.read_bytes(), 0
        while offset < len(data):  # record: u64 length, u32 crc, payload, u32 crc
            length = int.from_bytes(data[offset:offset + 8], "little")
            event = Event.FromString(data[offset + 12:offset + 12 + length])
            offset += 12 + length + 4
            if event.HasField("session_log") and event.session_log.status == SessionLog.START:
                scalars = {tag: [(s, v) for s, v in points if s < event.step] for tag, points in scalars.items()}
            for value in event.summary.value:
                scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return scalars


def test_metrics_reach_tensorboard_without_importing_torch(tmp_path):
    """The writer imports tensorboardX with torch hidden (seconds saved at every process start)."""
    script = (f"import sys\nfrom pathlib import Path\nfrom podtrain.orchestrator.train.metrics import MetricsWriter\n"
              f"w = MetricsWriter(Path({str(tmp_path)!r}), enabled=True, total_steps=3)\n"
              "for s in (1, 2, 3):\n    w.write({'step': s, 'loss': 4.0 - s, 'lr': 0.5, 'sample': 'text'})\n"
              "w.close()\nassert 'torch' not in sys.modules, 'torch was imported'\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env(), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    scalars = tensorboard_scalars(tmp_path / "tensorboard")
    assert scalars["loss"] == [(1, 3.0), (2, 2.0), (3, 1.0)] and scalars["lr"] == [(1, 0.5), (2, 0.5), (3, 0.5)]
    assert "sample" not in scalars and "step" not in scalars


def test_step_times_leave_out_evals_and_saves(tmp_path, monkeypatch):
    """An eval (here made 3 s slower) and a checkpoint save are not the step's time: step_s,
    tokens/s and MFU measure training only."""
    import podtrain.orchestrator.train.loop as train_module
    from podtrain.orchestrator.config.compose import load_config

    real_evaluate = train_module.evaluate

    def slow_evaluate(*args, **kwargs):
        time.sleep(3.0)
        return real_evaluate(*args, **kwargs)

    monkeypatch.setattr(train_module, "evaluate", slow_evaluate)
    config = load_config("llama3-tiny", [*TINY, "mesh.fsdp=4", "mesh.tp=2", "train.steps=3", "train.eval_every=2",
                                         "train.eval_batches=1", "checkpoint.every_steps=2", "data.eval_fraction=0.05"])
    train_module.run(config, tmp_path / "run")  # gives SIGTERM and SIGINT their handlers back
    records = {r["step"]: r for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())}
    assert "eval_loss" in records[2] and "save_block_s" in records[2]
    assert records[2]["step_s"] < 3.0 and records[3]["step_s"] < 3.0, records
