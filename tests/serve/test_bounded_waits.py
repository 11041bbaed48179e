"""The service's own waits end: the scheduler's stop while a step hangs in the engine, and a step
waiting for a compile ahead that does not finish."""

import logging
import re
import threading
import time
from types import SimpleNamespace

import numpy as np
from fake_backend import FakeBackend
from test_api import fake_info

from podtrain.orchestrator.serve.scheduler import Job, Scheduler
from podtrain.orchestrator.serve.store import Store
from podtrain.orchestrator.serve.warm import RowWarmer
from podtrain.orchestrator.serve.work import Create


def test_stopping_the_scheduler_while_a_step_hangs_in_the_engine_ends_and_says_so(tmp_path, caplog):
    backend = FakeBackend(fake_info(tmp_path))
    backend.running.clear()  # every engine step hangs
    scheduler = Scheduler(backend, Store(tmp_path / "run"), lambda ids: None, sampler_slots=1)
    scheduler.start()
    scheduler.submit(Job(None, "m", 0, Create("m", 4, ("q_proj",), 1), lambda _: (b"", "")))
    time.sleep(0.3)  # the step is in the engine
    started = time.monotonic()
    with caplog.at_level(logging.WARNING):
        scheduler.stop(timeout_s=0.5)
    assert time.monotonic() - started < 5
    assert "the scheduler did not stop within 0.5s: a step is still running in the engine" in caplog.text
    backend.running.set()


def test_a_step_waits_for_a_compile_ahead_only_as_long_as_its_bound(caplog):
    warmer = RowWarmer(None, None, None, (), loss_chunk=0, max_rows=0, wait_s=0.3)
    warmer._shapes[(4, 16)] = threading.Event()  # a compile ahead of this shape that never ends
    started = time.monotonic()
    with caplog.at_level(logging.WARNING):
        warmer.ready(SimpleNamespace(tokens=np.zeros((4, 16))))
    assert 0.3 <= time.monotonic() - started < 5
    assert "for 4 rows x 16 tokens did not finish within 0.3s (cluster.compile_timeout_s); this step compiles it" \
        in caplog.text


def test_an_in_process_engine_step_past_its_bound_is_named_and_the_service_exits(tmp_path, capsys, caplog):
    """`cluster.kind=none`: nothing outside the process watches the engine, so the service does: a
    step past `cluster.hang_timeout_s` is named with where it is stuck, the waiting requests fail
    with that reason, and the service exits 1 without saving (an engine stuck in a step cannot)."""
    from podtrain.launch.serve import _serve_in_process
    from podtrain.orchestrator.serve.watch import WatchedEngine

    backend = FakeBackend(fake_info(tmp_path))
    backend.running.clear()  # every engine step hangs
    watch = WatchedEngine(backend, hang_timeout_s=1, compile_timeout_s=60)
    store = Store(tmp_path / "run")
    scheduler = Scheduler(watch, store, lambda ids: None, sampler_slots=1)
    scheduler.start()
    request_id, _ = store.add_future("create_model", "m", None)
    scheduler.submit(Job(request_id, "m", 0, Create("m", 4, ("q_proj",), 1), lambda _: (b"", "")))
    saves = []
    started = time.monotonic()
    with caplog.at_level(logging.ERROR):
        code = _serve_in_process(watch, store, saves.append, 5.0, stop=threading.Event())
    assert code == 1 and saves == [] and 1 <= time.monotonic() - started < 5
    # One line (another test's thread may log to this stderr too).
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("podtrain:")]
    assert len(lines) == 1, lines
    line = lines[0]
    assert re.match(r"podtrain: error: the engine step has been running for \ds, past cluster.hang_timeout_s=1s; "
                    r"it is in run \(\S+/fake_backend.py:\d+\); the service stops without saving", line), line
    assert "threading.py" in caplog.text  # the whole stack of the step, in the log
    record = store.future(request_id)
    assert record.status == "error" and "past cluster.hang_timeout_s=1s" in record.error
    backend.running.set()
    scheduler.stop(timeout_s=5)


def test_a_step_that_compiles_is_bounded_by_the_compile_timeout(tmp_path):
    import jax

    from podtrain.orchestrator.serve.watch import WatchedEngine

    release = threading.Event()

    class Compiles:
        def run(self, works, generation=None):
            jax.jit(lambda x: x * 3)(np.zeros(5))  # a program's first shape: traced, then compiled
            release.wait()
            return []

    watch = WatchedEngine(Compiles(), hang_timeout_s=0.2, compile_timeout_s=1.0)
    step = threading.Thread(target=watch.run, args=([],))
    step.start()
    time.sleep(0.6)
    assert watch.overdue() is None  # past the hang timeout, within the compile timeout
    time.sleep(0.8)
    assert re.match(r"the engine step has been compiling for \ds, past cluster.compile_timeout_s=1s; it is in run "
                    r"\(\S+test_bounded_waits.py:\d+\)", watch.overdue())
    release.set()
    step.join()
    assert watch.overdue() is None
