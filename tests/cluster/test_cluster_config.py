"""The cluster config, reservation shapes and the driver's restart rules, without starting Ray."""

import io
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from podtrain.orchestrator.cluster import driver, hangs
from podtrain.orchestrator.cluster.driver import _normalise, next_attempt, worker_config
from podtrain.orchestrator.cluster.logs import LogFilter
from podtrain.orchestrator.cluster.outcomes import Budgets, Ending, Outcome, Quarantine
from podtrain.orchestrator.cluster.reserve import (
    ReservationError,
    _bundles,
    gang_devices,
    host_env,
    megascale_env,
    ray_tpu_version,
    reserve,
    tpu_topology,
)
from podtrain.orchestrator.cluster.worker import port_taken
from podtrain.orchestrator.common import protocol as p
from podtrain.orchestrator.common.errors import ConfigError
from podtrain.orchestrator.config.compose import load_config

ROOT = Path(__file__).parents[2]


@pytest.mark.parametrize("tpu_type, topology", [
    ("v4-8", "2x2x1"), ("v4-16", "2x2x2"), ("v5p-64", "2x4x4"), ("v5p-128", "4x4x4"), ("v6e-16", "4x4"),
    ("v6e-8", "2x4"), ("v5litepod-16", "4x4"), ("v5e-16", "4x4"), ("v3-32", "4x4"), ("v2-128", "8x8"),
])
def test_tpu_types_map_to_their_default_topology(tpu_type, topology):
    """The topology podtrain asks Ray for is one Ray's own table holds for that generation."""
    from ray._private.accelerators.tpu import TPUAcceleratorManager
    from ray.util.tpu import get_tpu_version_from_type

    assert tpu_topology(tpu_type) == topology
    version = get_tpu_version_from_type(ray_tpu_version(tpu_type))
    assert TPUAcceleratorManager.is_valid_tpu_accelerator_topology(version, topology)


def test_cluster_shorthand_and_kinds():
    config = load_config("llama3-tiny", ["cluster=gpu", "cluster.num_nodes=4", "cluster.gpus_per_node=8"])
    assert config.cluster.kind == "gpu"
    bundles, strategy, options = _bundles(config.cluster)
    assert bundles == [{"CPU": 1.0, "GPU": 8}] * 4 and strategy == "STRICT_SPREAD" and options["num_gpus"] == 8
    # All of a node's GPUs for its one process, named (local_device_ids) so that JAX's Slurm / Open MPI
    # detection cannot give it one; a missing CUDA plugin fails instead of falling back to the CPU.
    assert host_env(config.cluster, {"gpu_ids": [str(i) for i in range(8, 16)]}) == {
        "CUDA_VISIBLE_DEVICES": "8,9,10,11,12,13,14,15", "PODTRAIN_LOCAL_DEVICE_IDS": "0,1,2,3,4,5,6,7",
        "JAX_PLATFORMS": "cuda"}
    tpu = load_config("llama3-tiny", ["cluster=tpu", "cluster.tpu_type=v5p-64"]).cluster
    assert host_env(tpu, {}) == {"JAX_PLATFORMS": "tpu"}
    local = load_config("llama3-tiny", ["cluster.num_hosts=3", "cluster.devices_per_host=2",
                                        "cluster.env.FOO=bar"]).cluster
    assert _bundles(local)[:2] == ([{"CPU": 1.0}] * 3, "PACK")
    assert host_env(local, {}) == {"JAX_PLATFORMS": "cpu", "FOO": "bar",
                                   "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    # The driver's other XLA flags reach the workers; its device count does not.
    inherited = "--xla_force_host_platform_device_count=8 --xla_dump_to=/tmp/hlo"
    assert host_env(local, {}, xla_flags=inherited)["XLA_FLAGS"] == (
        "--xla_force_host_platform_device_count=2 --xla_dump_to=/tmp/hlo")
    # cluster.env.XLA_FLAGS replaces the driver's flags, and the host still gets its device count.
    own = load_config("llama3-tiny", ["cluster.devices_per_host=2",
                                      "cluster.env.XLA_FLAGS=--xla_cpu_use_thunk_runtime=true"])
    assert host_env(own.cluster, {}, xla_flags=inherited)["XLA_FLAGS"] == (
        "--xla_force_host_platform_device_count=2 --xla_cpu_use_thunk_runtime=true")


def test_megascale_variables_only_for_several_tpu_slices():
    two = load_config("llama3-tiny", ["cluster=tpu", "cluster.tpu_type=v5p-64", "cluster.num_slices=2"]).cluster
    assert megascale_env(two, "10.0.0.2", 1, 8081) == {
        "MEGASCALE_COORDINATOR_ADDRESS": "10.0.0.2", "MEGASCALE_PORT": "8081", "MEGASCALE_NUM_SLICES": "2",
        "MEGASCALE_SLICE_ID": "1"}
    one = load_config("llama3-tiny", ["cluster=tpu", "cluster.tpu_type=v5p-64"]).cluster
    assert megascale_env(one, "10.0.0.2", 0, 8081) == {}


@pytest.mark.parametrize("override, needle", [
    ("cluster=slurm", "cluster.kind: expected one of ['local', 'tpu', 'gpu', 'none'], found 'slurm'"),
    ("cluster.num_hosts=0", "cluster.num_hosts: expected a positive integer, found 0"),
    ("cluster.hang_timeout_s=-1", "cluster.hang_timeout_s: expected a positive number of seconds"),
])
def test_bad_cluster_config_is_one_clear_line(override, needle):
    with pytest.raises(ConfigError) as info:
        load_config("llama3-tiny", [override])
    assert needle in str(info.value)


def test_a_tpu_cluster_needs_a_tpu_type():
    with pytest.raises(ConfigError, match="cluster.tpu_type: expected a TPU type such as 'v5p-64'"):
        load_config("llama3-tiny", ["cluster=tpu"])


def test_tracebacks_compare_without_addresses():
    a = "Traceback\n  File x, line 3\nValueError: <object at 0x7f00aa>"
    b = "Traceback\n  File x, line 3\nValueError: <object at 0x7f11bb>"
    assert _normalise(a) == _normalise(b) != _normalise(a.replace("line 3", "line 4"))


@pytest.mark.parametrize("resume", ["none", "auto", "4"])
def test_restarts_resume_from_the_jobs_latest_checkpoint_whatever_the_first_attempt_asked(resume):
    config = load_config("llama3-tiny", [f"checkpoint.resume={resume}", "cluster.num_hosts=2"])
    first = worker_config(config, own_checkpoint=False)
    assert first.checkpoint.resume == resume and first.cluster.kind == "none"
    restart = worker_config(config, own_checkpoint=True)
    assert restart.checkpoint.resume == "auto" and restart.cluster.kind == "none"
    assert restart.checkpoint.dir == config.checkpoint.dir and restart.train == config.train



def charges(kinds, max_failures=1, max_preemptions=2):
    """(failures, preemptions, what each charge returned) after charging `kinds` in order."""
    budgets = Budgets(max_failures, max_preemptions)
    spent = [budgets.charge(kind) for kind in kinds]
    return budgets.failures, budgets.preemptions, spent


def test_waiting_for_capacity_after_a_preemption_draws_on_the_preemption_budget():
    # However many reservation failures follow a preemption or a lost node, they are part of it.
    assert charges(["preempted", "reservation", "reservation"]) == (
        0, 3, [None, None, "3 preemptions, more than cluster.max_preemptions=2"])
    assert charges(["node_lost", "reservation"])[:2] == (0, 2)
    # Without a preemption before it, a reservation failure is a failure (the cluster may be too small).
    assert charges(["reservation", "reservation"]) == (2, 0, [None, "2 failures, more than cluster.max_failures=1"])
    assert charges(["preempted", "crash", "reservation"])[:2] == (2, 1)
    assert charges(["hang", "exception"]) == (2, 0, [None, "2 failures, more than cluster.max_failures=1"])


def test_attempt_numbers_continue_after_the_run_directorys_earlier_attempts(tmp_path):
    assert next_attempt(tmp_path / "new-run") == 1
    for name in ("attempt-1", "attempt-3", "attempt-x", "other"):
        (tmp_path / "logs" / name).mkdir(parents=True)
    assert next_attempt(tmp_path) == 4


def run_driver(tmp_path, monkeypatch, errors, *overrides):
    """Runs the driver with `reserve` raising `errors` in turn (no Ray); returns (job.json, output)."""
    names = []

    def fake_reserve(cluster, name, exclude=frozenset()):
        names.append(name)
        raise errors[len(names) - 1]

    monkeypatch.setattr(driver, "connect", lambda config: None)
    monkeypatch.setattr(driver, "reserve", fake_reserve)
    (tmp_path / "run" / "logs" / "attempt-2").mkdir(parents=True)  # an earlier job of this run name
    out = io.StringIO()
    config = load_config("llama3-tiny", list(overrides))
    result = driver.run_job(config, tmp_path / "run", out=out)
    assert names == [f"podtrain-run-{n}" for n in range(3, 3 + len(names))]
    assert result.exit_code == 1
    return json.loads((tmp_path / "run" / "job.json").read_text()), out.getvalue()


def test_a_host_lost_while_the_gang_starts_and_the_wait_for_capacity_draw_on_preemptions(tmp_path, monkeypatch):
    import ray

    errors = [ray.exceptions.ActorDiedError(), ReservationError("no capacity"), ReservationError("no capacity")]
    job, out = run_driver(tmp_path, monkeypatch, errors, "cluster.max_failures=0", "cluster.max_preemptions=2")
    assert job["status"] == "failed" and job["attempts"] == 3, job
    assert job["restarts"] == {"node_lost": 1, "reservation": 2}, job
    assert job["reason"] == "3 preemptions, more than cluster.max_preemptions=2; last: reservation: no capacity"
    assert "attempt 3 ended: node_lost (rank None): host actor lost: ActorDiedError" in out
    # The last line counts this job's attempts, and says where they fall among the run directory's.
    assert out.strip().splitlines()[-1].endswith("attempts 3 (attempts 3-5 of this run directory), "
                                                 "restarts {'node_lost': 1, 'reservation': 2}"), out


def test_a_host_actor_that_does_not_answer_is_a_lost_node_and_a_bad_slice_a_config_error(tmp_path, monkeypatch):
    import ray

    errors = [ray.exceptions.GetTimeoutError("Get timed out: some object(s) not ready."), ReservationError("none")]
    job, out = run_driver(tmp_path / "timeout", monkeypatch, errors, "cluster.max_failures=0",
                          "cluster.max_preemptions=1")
    assert job["restarts"] == {"node_lost": 1, "reservation": 1} and job["attempts"] == 2, job
    assert "node_lost (rank None): host actor lost: GetTimeoutError: Get timed out" in out
    # A mistake in the input ends the job as that one error (the CLI: one line, exit code 2), and
    # writes no job.json: nothing ran.
    errors = [ConfigError("cluster.tpu_topology='2x2x3': not a slice Ray can reserve")]
    with pytest.raises(ConfigError, match=r"^cluster.tpu_topology='2x2x3': not a slice Ray can reserve$"):
        run_driver(tmp_path / "config", monkeypatch, errors)
    assert not (tmp_path / "config" / "run" / "job.json").exists()


@pytest.mark.parametrize("error, expected, message", [
    (RuntimeError("Failed to reserve TPU slice. Requested 1 slice(s)"), ReservationError,
     "could not reserve 1 x v4-16 within cluster.reserve_timeout_s=5s: Failed to reserve TPU slice"),
    # What ray 2.60's reserve_tpu_slice raises when no slice head frees up within the timeout.
    (TimeoutError("Failed to reserve TPU head for slice with shape: v4-16 after 5.0 seconds"), ReservationError,
     "could not reserve 1 x v4-16 within cluster.reserve_timeout_s=5s: Failed to reserve TPU head"),
    (ValueError("Invalid accelerator topology: '2x2x3' for accelerator version: 'v4'"), ConfigError,
     "cluster.tpu_type='v4-16', cluster.tpu_topology='2x2x3': not a slice Ray can reserve: Invalid"),
])
def test_a_tpu_slice_ray_cannot_reserve_is_a_reservation_or_config_error(monkeypatch, error, expected, message):
    import ray.util.tpu

    def no_slice(**kwargs):  # stands in for Ray's SlicePlacementGroup: no free slice, or a topology it rejects
        raise error

    monkeypatch.setattr(ray.util.tpu, "SlicePlacementGroup", no_slice)
    cluster = load_config("llama3-tiny", ["cluster=tpu", "cluster.tpu_type=v4-16", "cluster.tpu_topology=2x2x3",
                                          "cluster.reserve_timeout_s=5"]).cluster
    with pytest.raises(expected) as info:
        reserve(cluster, name="podtrain-test-1")
    assert message in str(info.value)


def test_jaxs_busy_coordinator_port_errors_are_recognised():
    assert port_taken(RuntimeError("UNKNOWN: Failed to start RPC server"))  # jax 0.10.2's words
    assert port_taken(OSError("[Errno 98] Address already in use"))
    assert not port_taken(RuntimeError("DEADLINE_EXCEEDED: Barrier timed out"))


def test_a_worker_whose_coordinator_port_is_taken_asks_for_another(tmp_path):
    from podtrain.orchestrator.config.compose import to_yaml

    (tmp_path / "config.yaml").write_text(to_yaml(load_config("llama3-tiny")))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", **{
            p.ENV_COORDINATOR: f"127.0.0.1:{port}", p.ENV_NUM_PROCESSES: "2", p.ENV_PROCESS_ID: "0",
            p.ENV_INIT_TIMEOUT: "5", p.ENV_HEARTBEAT_TIMEOUT: "5", p.ENV_CONFIG: str(tmp_path / "config.yaml"),
            p.ENV_RUN_DIR: str(tmp_path)})
        done = subprocess.run([sys.executable, "-m", "podtrain.orchestrator.cluster.worker"], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=120)
    assert done.returncode == p.EXIT_COORDINATOR_PORT, done.stderr[-3000:]
    assert f"coordinator port {port} is taken" in done.stderr


@pytest.mark.parametrize("overrides, devices", [
    (["cluster.num_hosts=2", "cluster.devices_per_host=2"], 4),
    (["cluster=gpu", "cluster.num_nodes=2", "cluster.gpus_per_node=8"], 16),
    (["cluster=tpu", "cluster.tpu_type=v5p-64", "cluster.num_slices=2"], 64),  # 32 chips a slice
    (["cluster=tpu", "cluster.tpu_type=v3-8"], None),  # a device per TensorCore: not from the type alone
    (["cluster=tpu", "cluster.tpu_type=v4-16", "cluster.env.JAX_PLATFORMS=cpu"], None),  # CPU stand-ins
])
def test_a_mesh_that_does_not_fit_the_gang_fails_before_anything_starts(tmp_path, monkeypatch, overrides, devices):
    config = load_config("llama3-tiny", [*overrides, "mesh.fsdp=3"])
    assert gang_devices(config.cluster) == devices
    if devices is None:
        return
    monkeypatch.setattr(driver, "connect", lambda config: pytest.fail("Ray started for a mesh that cannot fit"))
    with pytest.raises(ConfigError, match=rf"= 3 devices, but {devices} devices are present \(in the gang of "
                                          rf"cluster.kind={config.cluster.kind}, before starting it\)"):
        driver.run_job(config, tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_rank_0_lines_are_echoed_without_the_libraries_info_records():
    out = io.StringIO()
    LogFilter(out).feed(0, [
        "2026-11-30 06:36:21,330 INFO absl: Queuing deletion of steps: [].",
        "2026-11-30 06:36:21,330 INFO podtrain.orchestrator.train.loop: starting at step 0 (fresh)",
        "2026-11-30 06:36:21,330 WARNING absl: something to look at",
        "step 1/6  loss 8.390",
    ])
    assert out.getvalue().splitlines() == [
        "[rank 0] 2026-11-30 06:36:21,330 INFO podtrain.orchestrator.train.loop: starting at step 0 (fresh)",
        "[rank 0] 2026-11-30 06:36:21,330 WARNING absl: something to look at", "[rank 0] step 1/6  loss 8.390"]


def test_a_peers_abort_is_not_taken_for_the_cause_of_an_ending(tmp_path):
    """JAX aborts (SIGABRT) the processes whose peer died: next to an exception or a kill, the abort
    is the consequence; alone, it is the crash."""
    record = json.dumps({"kind": "exception", "summary": "ValueError: bad data", "traceback": "Traceback ...\n"})
    polls = [{"error": None, "error_at": None}, {"error": record, "error_at": 5.0}]
    exception = hangs.classify([(0, -6), (1, p.EXIT_EXCEPTION)], polls)
    assert (exception.kind, exception.rank, exception.detail) == ("exception", 1, "ValueError: bad data")
    killed = hangs.classify([(0, 134), (1, -9)], polls)
    assert (killed.kind, killed.rank, killed.detail) == ("crash", 1, "killed by SIGKILL")
    aborted = hangs.classify([(0, -6)], polls)
    assert (aborted.kind, aborted.rank, aborted.detail) == ("crash", 0, "killed by SIGABRT")


class DamagedRead(Exception):
    """Stands in for Orbax's bare Exception around a tensorstore error, whose message runs over many lines."""


def test_an_exception_is_reported_by_its_type_and_first_meaningful_line_not_its_last(tmp_path):
    try:
        try:
            raise ValueError("OUT_OF_RANGE: Error reading \"opt_state.nu.lm_head.value/0.0\": Requested byte range")
        except ValueError as cause:
            raise DamagedRead("\nEncountered error while reading array index: (slice(0, 2, 1),). See full TensorStore "
                              "details: <bound method spec of TensorStore({\n  'base': {\n  },\n})>.") from cause
    except DamagedRead as error:
        summary = p.describe_exception(error)
    assert summary == ("DamagedRead: Encountered error while reading array index: (slice(0, 2, 1),). See full "
                       "TensorStore details: <bound method spec of TensorStore({ (caused by ValueError: "
                       "OUT_OF_RANGE: Error reading \"opt_state.nu.lm_head.value/0.0\": Requested byte range)")
    assert p.describe_exception(KeyError()) == "KeyError"
    p.write_error(tmp_path / "error", "exception", summary, "Traceback (most recent call last):\n...\n})>.\n")
    polls = [{"error": None, "error_at": None}, {"error": (tmp_path / "error").read_text(), "error_at": 1.0}]
    outcome = hangs.classify([(1, p.EXIT_EXCEPTION)], polls)
    assert (outcome.kind, outcome.rank, outcome.detail) == ("exception", 1, summary)
    assert outcome.traceback.endswith("})>.\n")


class FakeService:
    """The driver's side of a serve gang: records what the driver asked of it, in order."""

    def __init__(self):
        self.calls = []
        self.before_stop = lambda timeout_s: self.calls.append(("save", timeout_s))

    def release(self, why, timeout_s):
        self.calls.append(("release", why))


def test_a_serve_workers_preemption_notice_saves_the_adapters_then_releases_the_gang(tmp_path, monkeypatch):
    """A serve worker that received SIGTERM says `preempting` in its heartbeat: the driver has the
    service save its unsaved adapters on the still-running gang, then releases the workers (no
    signal to the others), and their exit 75 is a preemption, not a stop."""
    service = FakeService()
    d = driver.Driver(load_config("llama3-tiny", ["cluster.num_hosts=2", "cluster.stop_grace_s=30"]), tmp_path / "run",
                      out=io.StringIO(), service=service)

    def running(notice=""):
        return {"returncode": None, "lines": [], "heartbeat": (3, 0.0), "phase": "serve", "phase_at": 0.0,
                "notice": notice, "now": 1.0,
                "started_at": 0.0, "state": "S", "pid": 1, "error": None, "error_at": None}

    polls = iter([[running(), running()], [running("preempting"), running()],
                  [dict(running("preempting"), returncode=p.EXIT_PREEMPTED), dict(running(), returncode=p.EXIT_OK)]])
    monkeypatch.setattr(driver.Driver, "_start", lambda *args: None)
    monkeypatch.setattr(driver.Driver, "_poll", lambda self, gang: (next(polls), None))
    monkeypatch.setattr(driver, "POLL_S", 0.0)
    outcome = d._watch(gang=None, attempt=1, port_retries=0, config=d.config)  # the gang's actors are never signalled
    assert (outcome.kind, outcome.rank) == ("preempted", 0)
    assert service.calls == [("save", 30.0), ("release", "rank 0 received a preemption notice")]
    assert "rank 0 received a preemption notice: saving the adapters" in d.out.getvalue()


def test_the_same_traceback_twice_fails_a_training_job_but_not_a_service(tmp_path, monkeypatch):
    """A service runs the request that was in flight again, alone, and fails that request if it
    brings the workers down again: the second traceback is that request's, and the service goes on."""
    crash = Outcome(Ending.EXCEPTION, 1, "ValueError: bad row", "Traceback ...\nValueError: bad row\n")
    for service, status in ((None, "failed"), (FakeService(), "succeeded")):
        if service is not None:
            service.lost = lambda why: None
        outcomes = iter([crash, crash, Outcome(Ending.DONE)])
        monkeypatch.setattr(driver.Driver, "_one_attempt", lambda self, *args, outcomes=outcomes: next(outcomes))
        d = driver.Driver(load_config("llama3-tiny", ["cluster.num_hosts=2"]), tmp_path / str(status),
                          out=io.StringIO(), service=service)
        result = d._attempts()
        assert result.status == status, (service, result)


class FakeGang:
    def __init__(self, nodes):
        self.actors = [None] * len(nodes)
        self.infos = [{"hostname": f"host-{n}", "ip": f"10.0.0.{i}", "node_id": n} for i, n in enumerate(nodes)]

    def release(self):
        pass


def test_a_host_blamed_for_two_failures_is_left_out_of_the_next_reservations(tmp_path, monkeypatch):
    """Rank 1 on node `bad` crashes twice: `bad` is excluded from the third reservation, which
    lands on the spare `good2`; job.json says which host and why."""
    excluded, placements = [], iter([["good1", "bad"], ["good1", "bad"], ["good1", "good2"]])

    def fake_reserve(cluster, name, exclude=frozenset()):
        excluded.append(set(exclude))
        return FakeGang(next(placements))

    outcomes = iter([Outcome(Ending.CRASH, 1, "killed by SIGSEGV"), Outcome(Ending.CRASH, 1, "killed by SIGSEGV"),
                     Outcome(Ending.DONE)])
    monkeypatch.setattr(driver, "connect", lambda config: False)
    monkeypatch.setattr(driver, "reserve", fake_reserve)
    monkeypatch.setattr(driver.Driver, "_watch", lambda self, *args: next(outcomes))
    out = io.StringIO()
    result = driver.Driver(load_config("llama3-tiny", ["cluster.num_hosts=2", "cluster.quarantine_s=600"]),
                           tmp_path / "run", out=out).run()
    assert result.status == "succeeded" and excluded == [set(), set(), {"bad"}]
    assert ("host host-bad 10.0.0.1 (node bad) is left out of the next reservations for cluster.quarantine_s=600s: "
            "blamed for 2 failures within cluster.quarantine_window_s=3600s, the last: crash (rank 1): killed by "
            "SIGSEGV") in out.getvalue()
    assert "attempt 3: reserving without the quarantined hosts (host-bad 10.0.0.1); waiting for capacity" in \
        out.getvalue()
    [record] = json.loads((tmp_path / "run" / "job.json").read_text())["quarantined"]
    assert record["node"] == "bad" and record["host"] == "host-bad 10.0.0.1" and "killed by SIGSEGV" in record["why"]


def test_with_no_spare_a_quarantined_host_is_used_again_and_an_embedded_ray_never_quarantines(tmp_path, monkeypatch):
    """Connected: the reservation without the quarantined host times out, and the next one takes it
    again, saying so (the job goes on). Embedded: its one node cannot be replaced, so it is never
    left out (no wait)."""
    crash = Outcome(Ending.CRASH, 1, "killed by SIGSEGV")
    for embedded in (False, True):
        excluded = []

        def fake_reserve(cluster, name, exclude=frozenset(), excluded=excluded):
            excluded.append(set(exclude))
            if exclude:
                raise ReservationError("could not reserve 2 hosts within cluster.reserve_timeout_s=600s")
            return FakeGang(["good", "bad"])

        outcomes = iter([crash, crash, Outcome(Ending.DONE)])
        monkeypatch.setattr(driver, "connect", lambda config, embedded=embedded: embedded)
        monkeypatch.setattr(driver, "reserve", fake_reserve)
        monkeypatch.setattr(driver.Driver, "_watch", lambda self, *args, outcomes=outcomes: next(outcomes))
        out = io.StringIO()
        result = driver.Driver(load_config("llama3-tiny", ["cluster.num_hosts=2"]), tmp_path / str(embedded),
                               out=out).run()
        assert result.status == "succeeded", out.getvalue()
        if embedded:
            assert excluded == [set(), set(), set()] and result.quarantined == []
            assert "host host-bad 10.0.0.1 (node bad) is blamed for 2 failures within cluster.quarantine_window_s" \
                   "=3600s, the last: crash (rank 1): killed by SIGSEGV; it stays in use: an embedded Ray has no " \
                   "other host" in out.getvalue()
        else:
            assert excluded == [set(), set(), {"bad"}, set()] and result.quarantined == []
            assert "attempt 3: no spare host came within cluster.reserve_timeout_s=600s; reserving on the " \
                   "quarantined hosts again" in out.getvalue()


def test_a_quarantine_needs_two_strikes_within_the_window_and_ends_after_its_time():
    q = Quarantine(window_s=100, duration_s=50)
    assert q.blame("n", "h", "crash", now=0) is None
    assert q.blame("n", "h", "crash", now=150) is None  # the first strike is out of the window
    assert q.blame("n", "h", "hang", now=200).startswith("host h (node n) is left out")
    assert q.excluded(now=249) == {"n"} and q.excluded(now=250) == frozenset()
    assert q.blame("n", "h", "crash", now=251) is None  # its record starts again when it comes back
    assert Quarantine(window_s=100, duration_s=0).blame("n", "h", "x", 0) is None and \
        Quarantine(window_s=100, duration_s=0).excluded(0) == frozenset()
