"""The driver's step channel to the gang (`GangBackend`), with worker processes running the real
`serve_steps` loop over an echoing stand-in engine: lockstep steps, a lost worker, a new gang, a
preemption notice."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from podtrain.orchestrator.common import protocol as p
from podtrain.orchestrator.serve.gang import GangBackend
from podtrain.orchestrator.serve.work import BaseInfo, EngineLost, EngineRestarted, ServeError

WORKER = """
import os
from podtrain.orchestrator.common.protocol import Heartbeat
from podtrain.orchestrator.serve.gang import serve_steps

if "HEARTBEAT" in os.environ:
    import jax

    INC = jax.jit(lambda x: x + 1)

class Echo:
    def run(self, works):
        for work in works:
            if work.startswith("compile"):  # a program at a shape, compiled on its first use
                import time
                import numpy as np
                INC(np.zeros(int(work.split()[1])))
                time.sleep(1.5)
        return [f"rank {os.environ['PODTRAIN_PROCESS_ID']} ran {work}" for work in works]

raise SystemExit(serve_steps(Echo(), os.environ, Heartbeat(os.environ.get("HEARTBEAT")),
                             grace_s=float(os.environ.get("GRACE", "120"))))
"""
INFO = BaseInfo(base_model="m", tokenizer_id="t", model_type="llama", vocab_size=8, max_seq_len=8, max_rank=2,
                max_adapters=2)


def start_gang(backend: GangBackend, size: int = 2, **env: str) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", WORKER],
                             env=dict(os.environ, **backend.env(), PODTRAIN_PROCESS_ID=str(rank),
                                      PODTRAIN_NUM_PROCESSES=str(size),
                                      **{k: v.format(rank=rank) for k, v in env.items()}))
            for rank in range(size)]


@pytest.mark.slow
def test_steps_run_on_every_rank_and_a_lost_worker_ends_the_step_until_a_new_gang_joins():
    backend = GangBackend(INFO, (), ready_timeout_s=60)
    gang = start_gang(backend)
    try:
        with pytest.raises(EngineRestarted):  # planned before any gang joined: it runs nothing
            backend.run(["a"], generation=0)
        assert backend.generation() == 1  # the gang that joined whole is the first engine
        assert backend.run(["a", "b"], generation=1) == ["rank 0 ran a", "rank 0 ran b"]

        gang[1].send_signal(signal.SIGKILL)
        gang[1].wait()
        with pytest.raises(EngineLost, match="the engine's workers were lost during this step"):
            backend.run(["b"], generation=1)
        backend.lost("attempt 1 ended: crash (rank 1)")
        gang[0].wait(30)  # its channel closed: it exits

        waiting = threading.Thread(target=lambda: setattr(waiting, "error", _raises(backend.run, ["c"], 1)))
        waiting.start()  # planned for the old engine, it waits for the new gang, then runs nothing
        gang = start_gang(backend)
        waiting.join(60)
        assert isinstance(waiting.error, EngineRestarted) and backend.generation() == 2
        assert backend.run(["c"], generation=2) == ["rank 0 ran c"]
    finally:
        backend.stop()
        for worker in gang:
            assert worker.wait(30) in (0, -signal.SIGKILL)

    stopped = GangBackend(INFO, (), ready_timeout_s=60)
    threading.Timer(0.5, stopped.stop).start()
    with pytest.raises(ServeError, match="the service is stopping"):  # no gang: stopping ends the wait
        stopped.run(["d"], generation=0)


def _raises(fn, *args) -> Exception | None:
    try:
        fn(*args)
    except Exception as error:
        return error
    return None


@pytest.mark.slow
def test_a_step_that_compiles_says_so_in_the_heartbeat_until_it_ends(tmp_path):
    """The driver bounds a step that compiles by `cluster.compile_timeout_s`: the workers' heartbeats
    say `compile` from the step's first trace to its end, and `serve` for a step that reuses its programs."""
    backend = GangBackend(INFO, (), ready_timeout_s=60)
    gang = start_gang(backend, HEARTBEAT=str(tmp_path / "rank{rank}.heartbeat"))
    phases = {}

    def watch(name):
        time.sleep(0.8)  # inside the step's second and a half
        phases[name] = [p.read_heartbeat(tmp_path / f"rank{rank}.heartbeat").phase for rank in (0, 1)]

    try:
        assert backend.run(["a"], generation=None) == ["rank 0 ran a"]  # the gang has joined
        for name in ("first", "again"):
            watcher = threading.Thread(target=watch, args=(name,))
            watcher.start()
            assert backend.run(["compile 3"], generation=1) == ["rank 0 ran compile 3"]
            watcher.join()
            assert [p.read_heartbeat(tmp_path / f"rank{rank}.heartbeat").phase for rank in (0, 1)] == ["serve"] * 2
        assert phases == {"first": ["compile"] * 2, "again": ["serve"] * 2}
    finally:
        backend.stop()
        for worker in gang:
            worker.wait(30)


@pytest.mark.slow
def test_a_preemption_notice_keeps_the_worker_serving_until_the_gang_is_released(tmp_path):
    """SIGTERM to one worker: its heartbeat says `preempting` and the gang still runs steps (the
    driver's save of unsaved adapters); `release` ends the gang (exit 75 for the noticed worker, 0
    for the other) and later steps wait for the next gang. Unreleased, a noticed worker exits 75
    after its grace."""
    backend = GangBackend(INFO, (), ready_timeout_s=60)
    gang = start_gang(backend, HEARTBEAT=str(tmp_path / "rank{rank}.heartbeat"))
    try:
        assert backend.run(["a"], generation=None) == ["rank 0 ran a"]
        gang[0].send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        while getattr(p.read_heartbeat(tmp_path / "rank0.heartbeat"), "notice", "") != "preempting":
            assert time.monotonic() < deadline and gang[0].poll() is None
            time.sleep(0.1)
        assert p.read_heartbeat(tmp_path / "rank1.heartbeat")[2:] == ("serve", "")
        assert backend.run(["save"], generation=1) == ["rank 0 ran save"]
        backend.release("rank 0 received a preemption notice", timeout_s=10)
        assert [worker.wait(30) for worker in gang] == [p.EXIT_PREEMPTED, p.EXIT_OK]

        waiting = threading.Thread(target=lambda: setattr(waiting, "error", _raises(backend.run, ["b"], 1)))
        waiting.start()
        gang = start_gang(backend, GRACE="1")
        waiting.join(60)
        assert isinstance(waiting.error, EngineRestarted) and backend.generation() == 2
        gang[1].send_signal(signal.SIGTERM)
        assert gang[1].wait(30) == p.EXIT_PREEMPTED  # after its one-second grace, nobody releasing it
    finally:
        backend.stop()
        for worker in gang:
            worker.wait(30)
