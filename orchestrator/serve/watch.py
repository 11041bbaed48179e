"""The watch on an engine in the service's own process (`cluster.kind=none`), where no worker
heartbeat and no driver see its steps: a step that runs past its bound is named, with where it is
stuck. The bound is `cluster.hang_timeout_s`, or `cluster.compile_timeout_s` once the step compiles
(a trace on the step's thread: a program's first shape)."""

from __future__ import annotations

import os
import sys
import sysconfig
import threading
import time
import traceback

from podtrain.orchestrator.serve.work import BaseInfo, Work

TRACED_EVENT = "/jax/core/compile/jaxpr_trace_duration"  # JAX reports it when a trace ends; a compile follows


_LIBRARIES = tuple({sysconfig.get_paths()[key] for key in ("stdlib", "purelib", "platlib")})
_PODTRAIN = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _own_frame(stack: traceback.StackSummary) -> traceback.FrameSummary:
    """The innermost frame of podtrain's (or the user's) code, not Python's or a library's: where
    the step waits (in XLA, a lock, I/O), seen from the code that called it."""
    for frame in reversed(stack):
        if frame.filename.startswith(_PODTRAIN) or not frame.filename.startswith(_LIBRARIES):
            return frame
    return stack[-1]


class WatchedEngine:
    """The Backend the front end uses: the engine's, with each step's start and whether it compiles."""

    def __init__(self, engine, hang_timeout_s: float, compile_timeout_s: float):
        import jax

        self._engine = engine
        self._bounds = {False: ("cluster.hang_timeout_s", hang_timeout_s),
                        True: ("cluster.compile_timeout_s", compile_timeout_s)}
        self._started: float | None = None
        self._thread: int | None = None
        self._compiling = False
        jax.monitoring.register_event_duration_secs_listener(self._traced)

    def _traced(self, event: str, _seconds: float, **_) -> None:
        if event == TRACED_EVENT and threading.get_ident() == self._thread and self._started is not None:
            self._compiling = True

    def info(self) -> BaseInfo:
        return self._engine.info()

    def generation(self) -> int:
        return self._engine.generation()

    def check(self, work: Work) -> None:
        self._engine.check(work)

    def run(self, works: list[Work], generation: int | None = None) -> list[object]:
        self._thread, self._compiling, self._started = threading.get_ident(), False, time.monotonic()
        try:
            return self._engine.run(works, generation)
        finally:
            self._started = None

    def overdue(self) -> str | None:
        """What is wrong when the step running now has run past its bound (None otherwise)."""
        started, compiling = self._started, self._compiling
        if started is None:
            return None
        key, bound = self._bounds[compiling]
        elapsed = time.monotonic() - started
        if elapsed <= bound:
            return None
        frame = sys._current_frames().get(self._thread)
        where = ""
        if frame is not None:
            last = _own_frame(traceback.extract_stack(frame))
            where = f"; it is in {last.name} ({last.filename}:{last.lineno})"
        doing = "compiling" if compiling else "running"
        return f"the engine step has been {doing} for {elapsed:.0f}s, past {key}={bound:g}s{where}"

    def stack(self) -> str:
        """The step's thread's whole stack, for the log."""
        frame = sys._current_frames().get(self._thread) if self._thread is not None else None
        return "".join(traceback.format_stack(frame)) if frame is not None else ""
