"""The service's own waits end: the scheduler's stop while a step hangs in the engine, and a step
waiting for a compile ahead that does not finish."""

import logging
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
