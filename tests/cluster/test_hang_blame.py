"""Which phase of a gang ran past its timeout, which ranks had not arrived, and which rank a hang is
blamed on: a stopped process, the one behind, the one whose main thread runs."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from podtrain.orchestrator.cluster import hangs
from podtrain.orchestrator.common import protocol as p
from podtrain.orchestrator.config.compose import load_config

INFOS = [{"hostname": "host-a", "ip": "10.0.0.1", "node_id": "aaaaaaaa1111"},
         {"hostname": "host-b", "ip": "10.0.0.2", "node_id": "bbbbbbbb2222"}]


def poll(step, state="S", pid=None, phase="step", since=0.0, now=1.0):
    return {"returncode": None, "heartbeat": (step, since) if phase != "start" else None, "state": state, "pid": pid,
            "phase": phase, "phase_at": since, "now": now}


def test_a_hang_is_blamed_on_the_stopped_rank_then_the_one_behind():
    """Every rank of a gang waits for the one that stopped, so their heartbeats read the same step."""
    assert hangs.blame([poll(3), poll(3, "T")], ["", ""], first=0) == (
        1, "rank 1's process is stopped (state T: SIGSTOP or a debugger)")
    assert hangs.blame([poll(4), poll(4), poll(3)], ["", "", ""], first=0) == (
        2, "rank 2 is behind (at step 3, others at step 4)")
    assert hangs.blame([poll(4), poll(4)], ["", ""], first=0) == (0, "every rank waits")


def test_a_hang_is_blamed_on_the_rank_whose_main_thread_runs_while_the_others_wait(tmp_path):
    """Real py-spy dumps of a process spinning in Python and one waiting in a system call."""
    from podtrain.orchestrator.cluster.host import HostActor

    programs = ["import time\nwhile True: time.sleep(60)", "while True: pass"]
    procs = [subprocess.Popen([sys.executable, "-c", program]) for program in programs]
    try:
        time.sleep(2.0)
        stacks = []
        for rank, proc in enumerate(procs):
            actor = HostActor(rank)
            actor.proc, actor.files = proc, {"stacks": tmp_path / f"rank{rank}.stacks"}
            stacks.append(actor.dump_stacks(str(tmp_path / f"rank{rank}.txt")))
        polls = [poll(5, "S", procs[0].pid), poll(5, "R", procs[1].pid)]
        assert hangs.blame(polls, stacks, first=0) == (1, "rank 1's main thread is running while the other ranks "
                                                           "wait"), stacks
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


TIMEOUTS = {"start_timeout_s": 11, "init_timeout_s": 12, "restore_timeout_s": 13, "compile_timeout_s": 14,
            "hang_timeout_s": 15, "save_timeout_s": 16, "commit_timeout_s": 17}


@pytest.mark.parametrize("phase", p.PHASES)
def test_each_phase_is_bounded_by_its_own_timeout(phase):
    cluster = load_config("llama3-tiny", [f"cluster.{k}={v}" for k, v in TIMEOUTS.items()]).cluster
    limit = TIMEOUTS[p.PHASE_TIMEOUTS[phase]]
    assert hangs.overdue([poll(0, phase=phase, now=limit - 0.5), poll(0)], cluster) is None
    assert hangs.overdue([poll(0, phase=phase, now=limit + 0.5), poll(0)], cluster) == (0, phase, limit + 0.5, limit)
    assert hangs.overdue([dict(poll(0, phase=phase, now=limit + 0.5), returncode=0), poll(0)], cluster) is None


def test_a_rank_that_never_joined_jax_distributed_is_named_with_its_host_node_and_pid():
    """Rank 1 stopped as its process started; rank 0 waits in `jax.distributed` past init_timeout_s."""
    cluster = load_config("llama3-tiny", ["cluster.init_timeout_s=20"]).cluster
    polls = [poll(0, pid=100, phase="distributed", since=5.0, now=26.0),
             poll(0, state="T", pid=4242, phase="start", since=4.0, now=26.0)]
    late = hangs.overdue(polls, cluster)
    assert late == (0, "distributed", 21.0, 20)
    outcome = hangs.hang_outcome(polls, ["", ""], late, INFOS, cluster)
    assert (outcome.kind, outcome.rank, outcome.phase) == ("hang", 1, "distributed")
    assert outcome.detail == (
        "rank 1's process is stopped (state T: SIGSTOP or a debugger); phase distributed ran past "
        "cluster.init_timeout_s=20s (rank 0 in it for 21s); waiting: ranks [0]; not arrived (has not joined "
        "jax.distributed): rank 1 (host host-b 10.0.0.2, node bbbbbbbb, pid 4242, in phase start)")


def test_a_rank_still_stepping_while_the_other_waits_in_a_save_is_behind():
    """Rank 0 entered the save of step 4 (a barrier of every process); rank 1 has not finished step 4."""
    cluster = load_config("llama3-tiny", ["cluster.save_timeout_s=30"]).cluster
    polls = [poll(4, phase="save", since=10.0, now=41.0), poll(3, phase="step", since=9.0, now=41.0)]
    outcome = hangs.hang_outcome(polls, ["", ""], hangs.overdue(polls, cluster), INFOS, cluster)
    assert (outcome.rank, outcome.phase) == (1, "save")
    assert outcome.detail.startswith("rank 1 is behind (at step 3, others in phase save after step 4); phase save "
                                     "ran past cluster.save_timeout_s=30s")
    assert "not arrived (has not saved a checkpoint): rank 1 (host host-b 10.0.0.2" in outcome.detail


def test_a_long_compile_is_not_a_hang_until_its_own_timeout():
    """A worker that says it compiles is given compile_timeout_s, not hang_timeout_s."""
    cluster = load_config("llama3-tiny", ["cluster.hang_timeout_s=10", "cluster.compile_timeout_s=900"]).cluster
    polls = [poll(0, phase="compile", now=600.0), poll(0, phase="compile", now=600.0)]
    assert hangs.overdue(polls, cluster) is None
    polls = [poll(0, phase="compile", now=901.0), poll(0, phase="compile", now=901.0)]
    outcome = hangs.hang_outcome(polls, ["", ""], hangs.overdue(polls, cluster), INFOS, cluster)
    assert outcome.detail == ("every rank waits; phase compile ran past cluster.compile_timeout_s=900s (rank 0 in "
                              "it for 901s); every rank is in it; blamed: rank 0 (host host-a 10.0.0.1, node "
                              "aaaaaaaa, pid None, in phase compile)")


def test_an_abort_beside_a_stopped_peer_is_that_peers_hang(tmp_path):
    """JAX's coordination service aborts a process whose peer stopped answering: the stopped peer is the cause."""
    polls = [{"returncode": -signal.SIGABRT, "error": None, "error_at": None},
             dict(poll(2, state="T", phase="save"), error=None, error_at=None)]
    outcome = hangs.classify([(0, -signal.SIGABRT)], polls)
    assert (outcome.kind, outcome.rank, outcome.phase) == ("hang", 1, "save")
    assert outcome.detail == ("rank 1's process is stopped (state T: SIGSTOP or a debugger) in phase save; rank 0 "
                              "aborted waiting for it")


PEER_WAITS_AT_A_BARRIER = """
import os, sys, time, traceback
import jax
from jax._src.distributed import global_state
from podtrain.orchestrator.common import protocol as p
rank, coordinator, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
jax.distributed.initialize(coordinator, num_processes=2, process_id=rank, heartbeat_timeout_seconds=3)
open(os.path.join(out, f"ready{rank}"), "w").close()
if rank == 1:
    time.sleep(600)
while not os.path.exists(os.path.join(out, "go")):
    time.sleep(0.05)
try:
    global_state.client.wait_at_barrier("save", 60_000)  # as Orbax's save waits for its peers
except Exception as error:
    p.write_error(os.path.join(out, "error.json"), "exception", p.describe_exception(error), traceback.format_exc())
    sys.exit(p.EXIT_EXCEPTION)
"""


# What rank 0 of a 2-host gang raised when rank 1 was stopped in a save (a CI run's job log).
JAX_LOST_A_PEER = ("JaxRuntimeError: INTERNAL: Barrier failed because: task is set to ERROR: UNAVAILABLE: Task 1 "
                   "heartbeat timeout. This indicates that the remote task has failed, got preempted, or crashed "
                   "unexpectedly. Check the task logs for an earlier error or scheduler events (e.g. preemption, "
                   "eviction) to debug further. [type.googleapis.com/tensorflow.CoordinationServiceError='']. "
                   "Barrier Id: ThreadSaveMultiHostValueHolder:set_value_end::1, Task: 1")


def test_an_exception_over_a_peers_lost_heartbeats_is_that_peers_hang():
    error = json.dumps({"kind": "exception", "summary": JAX_LOST_A_PEER[:300] + "...",
                        "traceback": f"Traceback (most recent call last):\n...\n{JAX_LOST_A_PEER}\n"})
    polls = [{"returncode": p.EXIT_EXCEPTION, "error": error, "error_at": 1.0},
             dict(poll(4, state="T", phase="save"), error=None, error_at=None)]
    outcome = hangs.classify([(0, p.EXIT_EXCEPTION)], polls)
    assert (outcome.kind, outcome.rank, outcome.phase) == ("hang", 1, "save")
    assert outcome.detail == ("rank 1 sent jax.distributed no heartbeat within cluster.heartbeat_timeout_s, in phase "
                              "save after step 4 (its process is stopped (state T: SIGSTOP or a debugger)); rank 0 "
                              f"failed waiting for it: {JAX_LOST_A_PEER[:300]}...")
    # Not stopped, yet silent to JAX (a frozen host, a cut network): still that rank's hang.
    polls[1]["state"] = "S"
    assert hangs.classify([(0, p.EXIT_EXCEPTION)], polls).detail.startswith(
        "rank 1 sent jax.distributed no heartbeat within cluster.heartbeat_timeout_s, in phase save after step 4 "
        "(its process is still running); ")
    # A rank that has itself ended is classed by its own exit, whatever its peers say of it.
    polls[1] |= {"returncode": -signal.SIGKILL}
    assert hangs.classify([(0, p.EXIT_EXCEPTION), (1, -signal.SIGKILL)], polls).kind == "crash"


@pytest.mark.slow
def test_a_real_gang_jax_lost_a_peer_of_names_the_stopped_peer(tmp_path):
    """JAX's coordination service fails a peer's barrier once a stopped rank misses its heartbeats,
    often long before that phase's own timeout: the report names the stopped rank and its phase."""
    from podtrain.orchestrator.cluster.host import free_port

    coordinator = f"127.0.0.1:{free_port('127.0.0.1')}"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"JAX_PLATFORMS": "cpu"}
    procs = [subprocess.Popen([sys.executable, "-c", PEER_WAITS_AT_A_BARRIER, str(rank), coordinator, str(tmp_path)],
                              env=env) for rank in (0, 1)]
    try:
        deadline = time.time() + 120
        while not all((tmp_path / f"ready{rank}").exists() for rank in (0, 1)):
            assert time.time() < deadline and all(proc.poll() is None for proc in procs)
            time.sleep(0.1)
        os.kill(procs[1].pid, signal.SIGSTOP)
        (tmp_path / "go").touch()
        code = procs[0].wait(timeout=60)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    # JAX also aborts rank 0 for the same fault, racing its error: an abort may end it before it writes.
    raised = tmp_path / "error.json"
    polls = [{"returncode": code, "error": raised.read_text() if raised.exists() else None, "error_at": 1.0},
             dict(poll(4, state="T", phase="save"), error=None, error_at=None)]
    outcome = hangs.classify([(0, code)], polls)
    assert (outcome.kind, outcome.rank, outcome.phase) == ("hang", 1, "save")
    if raised.exists():  # JAX's own words name the rank
        assert outcome.detail.startswith("rank 1 sent jax.distributed no heartbeat within cluster.heartbeat_timeout_s,")
