"""The Ray orchestrator end to end: real Ray, real worker processes, real checkpoints (loopback only).

Each test runs `podtrain train` (the driver) as a subprocess with the `local` cluster kind: 2
simulated hosts x 2 CPU devices, each host a Ray actor that starts a fresh JAX process per attempt.
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cluster_fixtures import TWO_HOSTS, env, finish, job, run_train, start, train_command
from train_fixtures import ROOT, TINY, losses

from podtrain.orchestrator.common.protocol import read_heartbeat
from podtrain.orchestrator.train.goodput import LEDGER, read_ledger, summarize

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def start_train(tmp_path, run_dir, steps, *extra, every: int = 2) -> subprocess.Popen:
    return start(train_command(run_dir, steps, *extra, every=every), tmp_path, run_dir.name)


def wait_for_step(run_dir: Path, proc: subprocess.Popen, step: int, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if (run_dir / "metrics.jsonl").exists() and max(losses(run_dir), default=0) >= step:
            return
        time.sleep(0.2)
    out = finish(proc) if proc.poll() is not None else ""
    raise AssertionError(f"the run did not reach step {step} (status {proc.poll()}):\n{out[-3000:]}")


def wait_for_checkpoint(run_dir: Path, proc: subprocess.Popen, step: int, timeout: float = 300) -> None:
    """Until the checkpoint of `step` is committed (a step's record is written before its save starts)."""
    deadline = time.time() + timeout
    while not (run_dir / "checkpoints" / str(step)).is_dir():
        assert time.time() < deadline and proc.poll() is None, f"no checkpoint of step {step} (status {proc.poll()})"
        time.sleep(0.2)


def worker_pid(run_dir: Path, attempt: int, rank: int) -> int:
    return int((run_dir / "logs" / f"attempt-{attempt}" / f"rank{rank}.pid").read_text())


def stop_between_steps(run_dir: Path, attempt: int, rank: int, timeout: float = 120) -> None:
    """SIGSTOPs `rank`'s worker while its heartbeat says it is between training steps. Stopped in a
    checkpoint save it would be bounded by `cluster.save_timeout_s` instead, and JAX's own heartbeat
    timeout could end the gang first."""
    beat = run_dir / "logs" / f"attempt-{attempt}" / f"rank{rank}.heartbeat"
    pid = worker_pid(run_dir, attempt, rank)
    deadline = time.time() + timeout
    while time.time() < deadline:
        os.kill(pid, signal.SIGSTOP)
        if (b := read_heartbeat(beat)) is not None and b.phase == "step":
            return
        os.kill(pid, signal.SIGCONT)
        time.sleep(0.05)
    raise AssertionError(f"rank {rank} of attempt {attempt} was never between steps within {timeout:g}s")


def assert_no_worker_left(run_dir: Path) -> None:
    for pid_file in (run_dir / "logs").glob("attempt-*/rank*.pid"):
        pid = int(pid_file.read_text())
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        state = Path(f"/proc/{pid}/stat").read_text().split()[2] if Path(f"/proc/{pid}/stat").exists() else "?"
        assert state == "Z", f"worker {pid} ({pid_file}) still runs (state {state})"


def test_two_hosts_match_one_process_and_survive_a_kill_and_a_preemption(tmp_path):
    steps = 8
    constant = "optimizer.schedule=constant"  # so that a longer run's first steps equal these
    reference = tmp_path / "one-process"
    done = run_train(tmp_path, reference, steps, "cluster=none", constant, devices=4)
    assert done.returncode == 0, done.stderr[-3000:]
    want = losses(reference)
    assert want.keys() == set(range(1, steps + 1))

    def signal_rank_1(run_dir, steps, sig, *, at_step, every, ended, restart, extra=()):
        """Runs the gang, sends `sig` to rank 1's worker after `at_step`; the job must end in
        success after one restart of kind `restart`, with the reference's losses."""
        proc = start_train(tmp_path, run_dir, steps, *TWO_HOSTS, constant, *extra, every=every)
        wait_for_step(run_dir, proc, at_step)
        os.kill(worker_pid(run_dir, 1, 1), sig)
        out = finish(proc)
        assert proc.returncode == 0, out[-4000:]
        assert f"attempt 1 ended: {ended}" in out and "[rank 0]" in out and "job succeeded" in out
        result = job(run_dir)
        assert result["restarts"] == {restart: 1} and result["attempts"] == 2, result
        assert result["last_checkpoint"] == steps
        for attempt in (1, 2):
            logs = sorted(p.name for p in (run_dir / "logs" / f"attempt-{attempt}").glob("*.log"))
            assert logs == ["rank0.log", "rank1.log"], logs
        # 2 processes x 2 devices, restarted from a checkpoint, see the same global batches as
        # 1 process x 4 devices.
        after = losses(run_dir)
        assert set(want) <= after.keys() and max(after) == steps
        for step in want:
            assert abs(after[step] - want[step]) <= 1e-6, (step, after[step], want[step])
        assert_no_worker_left(run_dir)

    # checkpoint.resume=none holds for the first attempt only: the restart resumes from the job's
    # own step 2 (it would refuse that checkpoint, twice, and fail the job).
    killed = tmp_path / "killed"
    signal_rank_1(killed, steps, signal.SIGKILL, at_step=3, every=2, ended="crash (rank 1): killed by SIGKILL",
                  restart="crash", extra=("checkpoint.resume=none",))
    assert "resumed from step" in (killed / "logs" / "attempt-2" / "rank0.log").read_text()
    # The goodput ledger: the driver's reservations and the workers' lines of both attempts cover
    # the wall clock; the steps past the checkpoint the restart resumed from are lost.
    ledger = summarize(read_ledger(killed))
    assert sorted(ledger.attempts) == [1, 2]
    seconds = ledger.total.seconds
    assert min(seconds[k] for k in ("starting", "distributed", "compiling", "training", "lost", "between")) > 0
    assert sum(v for k, v in seconds.items() if k != "unaccounted") == pytest.approx(ledger.total.wall, rel=0.02)

    # A preemption notice (SIGTERM) to one host: every process stops at the same step through JAX's
    # preemption sync point, checkpoints it, exits 75; the gang restarts on the preemption budget.
    # The run is long enough for the notice to reach every process (it may take a few steps).
    preempted = tmp_path / "preempted"
    signal_rank_1(preempted, 40, signal.SIGTERM, at_step=1, every=100, ended="preempted", restart="preempted")
    assert "resumed from step" in (preempted / "logs" / "attempt-2" / "rank0.log").read_text()


def test_a_data_file_damaged_where_one_host_reads_is_skipped_by_both_and_renamed_once(tmp_path):
    """Each host reads only its own shards, so the damage fails on host 1 only: the hosts decide
    together that the step is damaged, fall back to the same older step in the same attempt, and
    then train the steps of an uninterrupted run."""
    constant = "optimizer.schedule=constant"  # so that a 6-step run's steps equal an 8-step run's
    reference = start(train_command(tmp_path / "reference", 8, "cluster=none", constant), tmp_path, "reference",
                      devices=4)
    run_dir = tmp_path / "damaged"
    done = run_train(tmp_path, run_dir, 6, *TWO_HOSTS, constant)
    assert done.returncode == 0, done.stdout[-4000:]
    files = sorted((run_dir / "checkpoints" / "6" / "state" / "ocdbt.process_1" / "d").iterdir())
    largest = max(files, key=lambda p: p.stat().st_size)
    largest.write_bytes(largest.read_bytes()[: largest.stat().st_size // 2])
    done = run_train(tmp_path, run_dir, 8, *TWO_HOSTS, constant)
    assert done.returncode == 0, done.stdout[-4000:]
    assert job(run_dir)["attempts"] == 1 and job(run_dir)["restarts"] == {}, job(run_dir)
    assert "cannot be restored (process 1: ValueError: OUT_OF_RANGE" in done.stdout
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["4", "6", "6.damaged", "8"]
    for rank in (0, 1):
        assert "resumed from step 4" in (run_dir / "logs" / "attempt-2" / f"rank{rank}.log").read_text()
    out = finish(reference)
    assert reference.returncode == 0, out[-3000:]
    want, got = losses(tmp_path / "reference"), losses(run_dir)
    assert got.keys() == want.keys() == set(range(1, 9))
    for step in want:
        assert abs(got[step] - want[step]) <= 1e-6, (step, got[step], want[step])


def test_expert_parallel_across_two_hosts_matches_one_process(tmp_path):
    """DeepSeek-V3 with ep=2 outermost, so each host holds the experts of one EP rank and tokens
    cross the process boundary in the all-to-alls; tp=2 inside each host sums partial outputs."""
    model = ["model.num_layers=2", "train.batch_size=4", "train.seq_len=32", "checkpoint.async_save=false",
             "train.peak_flops_per_device=1e9", "mesh.fsdp=1", "mesh.ep=2", "mesh.tp=2", "train.steps=3",
             "checkpoint.every_steps=3", "optimizer.schedule=constant", f"run.dir={tmp_path}"]
    procs = {}  # both runs at once: their start-up (Ray, imports, compiles) overlaps
    for name, placement, devices in (("one-process", ["cluster=none"], 4), ("two-hosts", TWO_HOSTS, 2)):
        command = [sys.executable, "-m", "podtrain.launch.cli", "train", "-c", "deepseek-v3-tiny", *model, *placement,
                   f"run.name={name}"]
        procs[name] = start(command, tmp_path, name, devices)
    runs = {}
    for name, proc in procs.items():
        out = finish(proc)
        assert proc.returncode == 0, out[-4000:]
        runs[name] = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    one, two = runs["one-process"], runs["two-hosts"]
    assert [r["step"] for r in one] == [r["step"] for r in two] == [1, 2, 3]
    for a, b in zip(one, two, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-6, (a["step"], a["loss"], b["loss"])
        assert a["expert_load"] == b["expert_load"] and b["dropped_tokens"] == 0
        assert [sum(layer) for layer in b["expert_load"]] == [4 * 32 * 2]  # tokens x experts per token


def recovered(run_dir, attempt: int) -> bool:
    """Whether the driver has seen the first step after `attempt` ended (its failure line in the
    goodput ledger then carries the restart time); steps logged by the attempt before do not say so."""
    ledger = run_dir / LEDGER
    lines = map(json.loads, ledger.read_text().splitlines()) if ledger.exists() else []
    return any(line.get("attempt") == attempt and (line.get("failure") or {}).get("restart_s") is not None
               for line in lines)


def test_a_rank_stopped_at_start_then_mid_run_then_a_lost_host_each_restart_the_gang(tmp_path):
    """Attempt 1: rank 1 stops (SIGSTOP) as soon as its process exists; rank 0 waits in
    `jax.distributed` past `cluster.init_timeout_s` and the hang names rank 1, its host and pid.
    Attempt 2: rank 1 stops mid-run; the hang is detected, every rank's stacks dumped, the gang
    restarted from the last checkpoint. Attempt 3: rank 1's host (its Ray actor) dies; that counts as
    a preemption, and its worker does not outlive it. Attempt 4 finishes the run, and every step
    trained twice has the same loss both times."""
    run_dir = tmp_path / "hung-then-lost"
    hosts = [o for o in TWO_HOSTS if not o.startswith("cluster.init_timeout_s=")]
    proc = start_train(tmp_path, run_dir, 30, *hosts, "cluster.hang_timeout_s=8", "cluster.init_timeout_s=20")
    first = run_dir / "logs" / "attempt-1" / "rank1.pid"
    wait_until(lambda: proc.poll() is not None or first.exists() and first.read_text().strip(), 120,
               "rank 1's process in attempt 1")
    never_joined = worker_pid(run_dir, 1, 1)
    os.kill(never_joined, signal.SIGSTOP)
    wait_for_checkpoint(run_dir, proc, 2)
    assert (run_dir / "logs" / "attempt-2").is_dir()
    stop_between_steps(run_dir, 2, 1)
    stopped_at = time.time()
    wait_until(lambda: (run_dir / "logs" / "attempt-3" / "rank1.pid").exists()
               and max(losses(run_dir), default=0) >= 3 and recovered(run_dir, 2), 300,
               "step 3 in attempt 3, and the driver seeing attempt 3's first step")
    stacks = run_dir / "stacks" / "attempt-2"
    proc.log.flush()
    assert {p.name for p in stacks.glob("rank*.txt")} == {"rank0.txt", "rank1.txt"}, \
        (tmp_path / f"{run_dir.name}-driver.log").read_text()[-6000:]
    dumped = (stacks / "rank1.txt").read_text()
    assert "orchestrator" in dumped or "Thread" in dumped, dumped[:2000]
    assert stacks.stat().st_mtime - stopped_at < 8 + 60  # detected within the timeout (plus polling)

    worker = worker_pid(run_dir, 3, 1)
    host_actor = int(Path(f"/proc/{worker}/stat").read_text().split(")")[1].split()[1])  # the worker's parent
    os.kill(host_actor, signal.SIGKILL)
    out = finish(proc)
    assert proc.returncode == 0, out[-4000:]
    assert re.search(r"attempt 1 ended: hang \(rank 1\): rank 1's process is stopped .*; phase distributed ran past "
                     r"cluster.init_timeout_s=20s \(rank 0 in it for 2\ds\); waiting: ranks \[0\]; not arrived \(has "
                     rf"not joined jax.distributed\): rank 1 \(host \S+ 127.0.0.1, node \w{{8}}, pid {never_joined}, "
                     r"in phase start\)", out), out[-4000:]
    assert "attempt 2 ended: hang (rank 1)" in out and "cluster.hang_timeout_s=8" in out
    assert "attempt 3 ended: node_lost (rank 1)" in out
    result = job(run_dir)
    assert result["restarts"] == {"hang": 2, "node_lost": 1} and result["attempts"] == 4, result
    assert result["last_checkpoint"] == 30
    seen: dict[int, float] = {}
    for record in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()):
        assert seen.setdefault(record["step"], record["loss"]) == record["loss"], record  # bit-exact when redone
    assert_no_worker_left(run_dir)

    # What each failure cost: in job.json, `podtrain status` and the goodput ledger.
    history = result["history"]
    assert [(a["ended"], a["rank"], a["phase"]) for a in history] == [
        ("hang", 1, "distributed"), ("hang", 1, "step"), ("node_lost", 1, None), ("done", None, None)], history
    assert history[0]["detect_s"] >= 20 and history[1]["detect_s"] >= 8, history
    assert [a["start_step"] for a in history[:3]] == [None, None, 2]
    for failed, after in zip(history, history[1:], strict=False):
        assert failed["restart_s"] == round(after["first_step_at"] - failed["detected_at"], 3) > 0, history
        assert failed["steps_redone"] == max(0, (failed["last_step"] or 0) - (after["start_step"] or 0)), history
    status = subprocess.run([sys.executable, "-m", "podtrain.launch.cli", "status", str(run_dir)], cwd=ROOT,
                            env=env(tmp_path), capture_output=True, text=True, timeout=60)
    rows = [line.split()[:5] for line in status.stdout.splitlines()[2:]]  # attempt, ended, slices, rank, phase
    assert rows == [["1", "hang", "1", "1", "distributed"], ["2", "hang", "1", "1", "step"],
                    ["3", "node_lost", "1", "1", "-"], ["4", "done", "1", "-", "-"]], status.stdout
    failures = summarize(read_ledger(run_dir)).failures
    assert {a: f["restart_s"] for a, f in failures.items()} == {a["attempt"]: a["restart_s"] for a in history[:3]}


# Loaded by every worker of the test below (on its PYTHONPATH): rank 1 stops itself (SIGSTOP) as it
# enters one phase per attempt, as a host that freezes there would.
STOP_IN_PHASE = """
import os, signal
PHASE = {"1": "restore", "2": "compile", "3": "save", "4": "commit"}.get(os.environ.get("PODTRAIN_ATTEMPT", ""))
if PHASE and os.environ.get("PODTRAIN_PROCESS_ID") == "1":
    from podtrain.orchestrator.common import protocol

    enter = protocol.Heartbeat.phase

    def enter_then_stop(self, name):
        enter(self, name)
        if name == PHASE:
            os.kill(os.getpid(), signal.SIGSTOP)

    protocol.Heartbeat.phase = enter_then_stop
"""


def test_a_rank_stopped_in_restore_compile_save_and_commit_is_named_in_each_phases_own_time(tmp_path):
    """Rank 1 stops in a new phase each attempt: restoring, compiling, saving, waiting for the commit.
    Each attempt ends as a hang of that phase once its own timeout is past, naming rank 1 as stopped;
    the fifth attempt finishes, and every step trained twice has the same loss both times."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(STOP_IN_PHASE)
    run_dir = tmp_path / "phases"
    timeouts = {"restore": 15, "compile": 30, "save": 10, "commit": 10}
    proc = start_train(tmp_path, run_dir, 8, *TWO_HOSTS[:3], "cluster.init_timeout_s=60",
                       *(f"cluster.{phase}_timeout_s={t}" for phase, t in timeouts.items()),
                       "cluster.hang_timeout_s=30", "cluster.max_failures=4", f"cluster.env.PYTHONPATH={hook}:{ROOT}",
                       every=4)
    out = finish(proc)
    assert proc.returncode == 0, out[-4000:]
    history = job(run_dir)["history"]
    assert [(a["ended"], a["rank"], a["phase"]) for a in history] == [
        ("hang", 1, phase) for phase in timeouts] + [("done", None, None)], history
    for attempt, (phase, timeout) in enumerate(timeouts.items(), 1):
        assert re.search(rf"attempt {attempt} ended: hang \(rank 1\): rank 1's process is stopped .*; "
                         rf"phase {phase} ran past cluster.{phase}_timeout_s={timeout}s", out), (phase, out[-4000:])
        assert history[attempt - 1]["detect_s"] <= timeout + 15, history[attempt - 1]  # found within its timeout
    seen: dict[int, float] = {}
    for record in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()):
        assert seen.setdefault(record["step"], record["loss"]) == record["loss"], record  # bit-exact when redone
    assert sorted(seen) == list(range(1, 9))
    assert_no_worker_left(run_dir)


# A user's chat template with a bug: it divides by zero on one conversation (Python's error, not Jinja's).
BUGGY_TEMPLATE = ("{% for m in messages %}{% if 'boom' in m['content'] %}{{ 1 // 0 }}{% endif %}"
                  "{{ m['role'][0] + ': ' + m['content'] + '\\n' }}{% endfor %}")


def conversation_read_at(step: int, overrides: list[str]) -> int:
    """The index of a conversation that the run with `overrides` reads for `step` (one a batch row)."""
    from podtrain.orchestrator.config.compose import load_config
    from podtrain.orchestrator.data.pipeline import make_dataset
    from podtrain.orchestrator.data.tokenizers import ByteTokenizer

    config = load_config("llama3-tiny", overrides)
    batches = iter(make_dataset(config.data, ByteTokenizer(), seq_len=config.train.seq_len,
                                global_batch=config.train.batch_size))
    for _ in range(step):
        batch = next(batches)
    text = bytes(int(t) for t in batch["inputs"][0] if 0 < t < 256).decode()
    return int(re.search(r"question (\d+)", text).group(1))


def test_an_exception_in_user_code_fails_the_job_with_its_traceback_without_retrying_forever(tmp_path):
    rows = [[{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"answer {i}"}]
            for i in range(40)]
    corpus, template = tmp_path / "chat.jsonl", tmp_path / "buggy.jinja"
    template.write_text(BUGGY_TEMPLATE)
    data = ["data.source=chat", f"data.path={corpus}", f"data.chat_template={template}", "data.packing=false",
            "data.eval_fraction=0.0", "train.eval_every=0"]
    corpus.write_text("".join(json.dumps({"messages": row}) + "\n" for row in rows))
    bad = conversation_read_at(9, [*TINY, *data])  # after the checkpoints of steps 2 to 8
    rows[bad][0]["content"] += " boom"
    corpus.write_text("".join(json.dumps({"messages": row}) + "\n" for row in rows))
    run_dir = tmp_path / "bad-template"
    with socket.socket() as taken:  # the configured coordinator port is taken: another one is used
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = run_train(tmp_path, run_dir, 50, *TWO_HOSTS, *data, "cluster.max_failures=5",
                         f"cluster.coordinator_port={port}")
    assert done.returncode == 1, done.stdout[-4000:]
    assert f"coordinator port {port} is in use" in done.stdout
    assert "ZeroDivisionError" in done.stdout and "Traceback" in done.stdout
    assert "the same exception twice in a row" in done.stdout
    result = job(run_dir)
    assert result["status"] == "failed" and result["restarts"] == {"exception": 2} and result["attempts"] == 2
    assert result["last_checkpoint"] is not None  # it failed mid-training, not at start-up
    assert_no_worker_left(run_dir)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")


def start_ray(e: dict) -> str:
    """`ray start --head` on loopback with a dashboard; its address."""
    ray = str(Path(sys.executable).parent / "ray")
    dashboard = free_port()
    subprocess.run([ray, "start", "--head", f"--port={free_port()}", "--num-cpus=4", "--include-dashboard=true",
                    "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}", f"--temp-dir={e['RAY_TMPDIR']}"],
                   env=e, check=True, capture_output=True, timeout=120)
    return f"http://127.0.0.1:{dashboard}"


def stop_ray(e: dict) -> None:
    subprocess.run([str(Path(sys.executable).parent / "ray"), "stop", "--force"], env=e, capture_output=True,
                   timeout=120)


def test_ray_job_submit_then_ray_job_stop_checkpoints_then_a_resubmit_after_a_ray_restart_resumes(tmp_path):
    """`podtrain submit` with the default run.dir: the run lives where it was submitted from, not in
    Ray's temporary copy of the working directory, so it survives `ray stop` / `ray start`."""
    from ray.job_submission import JobStatus, JobSubmissionClient

    e = env(tmp_path)
    ray = str(Path(sys.executable).parent / "ray")
    submitted_from = tmp_path / "project"
    submitted_from.mkdir()
    run_dir = submitted_from / "runs" / "submitted"  # the default run.dir, relative to where submit ran

    def submit(address, steps):
        command = [sys.executable, "-m", "podtrain.launch.cli", "submit", "--address", address, "--no-follow",
                   "--working-dir", str(ROOT), "-c", "llama3-tiny", *TINY, f"train.steps={steps}",
                   "checkpoint.every_steps=500", "run.name=submitted", *TWO_HOSTS, "cluster.stop_grace_s=60"]
        done = subprocess.run(command, cwd=submitted_from, env=e, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
        assert f"run directory: {run_dir}" in done.stdout, done.stdout
        return JobSubmissionClient(address)

    address = start_ray(e)
    try:
        client = submit(address, 1000)
        wait_until(lambda: (run_dir / "metrics.jsonl").exists() and max(losses(run_dir), default=0) >= 3, 300,
                   "step 3 of the submitted job")
        stop = subprocess.run([ray, "job", "stop", "--address", address, "submitted"], env=e, capture_output=True,
                              text=True, timeout=180)
        assert stop.returncode == 0, stop.stdout + stop.stderr
        assert client.get_job_status("submitted") == JobStatus.STOPPED
        wait_until(lambda: (run_dir / "job.json").exists(), 60, "the driver's job.json")
        result = job(run_dir)
        assert result["status"] == "stopped", result
        last = max(losses(run_dir))
        assert result["last_checkpoint"] == last >= 3  # the step it stopped at was checkpointed
        assert "podtrain: run directory " + str(run_dir) in client.get_job_logs("submitted")
        assert_no_worker_left(run_dir)
    finally:
        stop_ray(e)

    address = start_ray(e)  # a new cluster: a new copy of the working directory
    try:
        client = submit(address, last + 2)
        wait_until(lambda: client.get_job_status("submitted").is_terminal(), 300, "the resubmitted job")
        logs = client.get_job_logs("submitted")
        assert client.get_job_status("submitted") == JobStatus.SUCCEEDED, logs[-3000:]
        assert f"resumed from step {last}" in logs and job(run_dir)["last_checkpoint"] == last + 2

        # `ray job submit` itself with a relative run.dir would write into Ray's copy: refused in one line.
        raw = subprocess.run([ray, "job", "submit", "--address", address, "--working-dir", str(ROOT),
                              "--submission-id", "relative", "--", "podtrain", "train", "-c", "llama3-tiny", *TINY,
                              "train.steps=2"], env=e, capture_output=True, text=True, timeout=300)
        assert raw.returncode != 0 and client.get_job_status("relative") == JobStatus.FAILED
        errors = [line for line in client.get_job_logs("relative").splitlines() if "error" in line.lower()]
        assert len(errors) == 1 and errors[0].startswith("podtrain: error: run.dir='runs' is relative, and this "
                                                         "Ray job runs in Ray's temporary copy"), errors
    finally:
        stop_ray(e)
