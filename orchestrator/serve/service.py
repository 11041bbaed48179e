"""What every route of the front end shares: the backend, the store, the scheduler and the long
polls' waiters (`Service`, one per app, reached with `ServiceDep`), and the answers' shapes."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Depends, Request

from podtrain.orchestrator.serve import translate
from podtrain.orchestrator.serve.lifetimes import Lifetimes
from podtrain.orchestrator.serve.scheduler import Job, Scheduler
from podtrain.orchestrator.serve.store import CheckpointRecord, ModelRecord, SamplerRecord, Store
from podtrain.orchestrator.serve.wire import JSON
from podtrain.orchestrator.serve.work import Backend, BaseInfo, ServeError, Work


class Waiters:
    """Wakes the long polls of `retrieve_future` when the scheduler thread settles their futures."""

    def __init__(self):
        self._loop: asyncio.AbstractEventLoop | None = None
        self._events: dict[str, set[asyncio.Event]] = {}

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    async def wait(self, request_id: str, pending: Callable[[], bool], timeout: float) -> None:
        """Returns once `request_id` is settled or after `timeout` seconds. The poll registers
        before it looks (`pending`), so a result stored in between still wakes it."""
        event = asyncio.Event()
        self._events.setdefault(request_id, set()).add(event)
        try:
            if pending():
                with suppress(TimeoutError):
                    await asyncio.wait_for(event.wait(), timeout)
        finally:
            events = self._events[request_id]
            events.discard(event)
            if not events:
                del self._events[request_id]

    def notify(self, request_ids: list[str]) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._set, request_ids)

    def _set(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            for event in self._events.get(request_id, ()):
                event.set()


@dataclass
class Service:
    backend: Backend
    store: Store
    scheduler: Scheduler
    lifetimes: Lifetimes
    info: BaseInfo
    waiters: Waiters
    long_poll_s: float
    max_request_bytes: int
    decode: translate.Decode | None
    encode: translate.Encode | None

    def submit(self, kind: str, key: str, seq: int | None, work: Work, on_done: Callable[[object], tuple[bytes, str]],
               sampler_dir: str | None = None) -> str:
        """Queues `work` after the backend's check (`checks.check_work`); a resubmission of the
        same `seq` gets the first one's request id."""
        dedup_key = None if seq is None else f"{kind}#{key}#{seq}"
        if dedup_key is not None and (request_id := self.store.future_id(dedup_key)) is not None:
            return request_id
        self.backend.check(work)
        request_id, fresh = self.store.add_future(kind, key, dedup_key)
        if fresh and (notice := self.scheduler.take_notice(key, request_id)) is not None:
            self.store.fail_future(request_id, notice, "server")  # as a request in flight is told
        elif fresh:
            self.scheduler.submit(Job(request_id, key, math.inf if seq is None else seq, work, on_done, sampler_dir))
        return request_id

    def open_session(self, session_id: str) -> None:
        session = self.store.session(session_id)
        if session is None:
            raise ServeError(f"session_id: unknown session {session_id!r}", 404)
        if session.finished is not None:
            raise ServeError(f"session {session_id!r} ended ({session.finished}); start a new ServiceClient", 410)

    def model(self, model_id: str) -> ModelRecord:
        model = self.store.model(model_id)
        if model is None:
            raise ServeError(f"model_id: unknown model {model_id!r}", 404)
        return model

    def live_model(self, model_id: str) -> ModelRecord:
        model = self.model(model_id)
        if model.state != "live":
            resume = (f"create_training_client_from_state({model.last_checkpoint!r})" if model.last_checkpoint
                      else "a new training client (it has no saved state)")
            session = self.store.session(model.session_id)
            if session is not None and session.finished is not None:
                raise ServeError(f"model {model_id!r}: its session ended ({session.finished}); continue with "
                                 f"{resume} (its last state is the newest training checkpoint of the model)", 410)
            raise ServeError(f"model {model_id!r} is unloaded (unload_model, or it could not be brought back after "
                             f"a restart); continue with {resume}")
        return model

    def open_sampler(self, sampler_id: str, field: str) -> SamplerRecord:
        sampler = self.store.sampler(sampler_id)
        if sampler is None:
            raise ServeError(f"{field}: unknown sampling session {sampler_id!r}", 404)
        session = self.store.session(sampler.session_id)
        if session is not None and session.finished is not None:
            raise ServeError(f"sampling session {sampler_id!r}: its session ended ({session.finished}); sample from "
                             "a sampling client of a new ServiceClient", 410)
        return sampler

    def paging(self) -> dict[str, Any]:
        """Where the live adapters are and what paging did, as the engine last wrote it
        (`serve/pages.py`); {} before it has written anything."""
        try:
            return json.loads((self.store.run_dir / "pages" / "paging.json").read_text())
        except (OSError, ValueError):
            return {}

    def checkpoint(self, path: str, field: str) -> CheckpointRecord:
        checkpoint = self.store.checkpoint(path)
        if checkpoint is None:
            raise ServeError(f"{field}: unknown checkpoint {path!r}; expected a tinker:// path this service saved", 404)
        return checkpoint


def current_service(request: Request) -> Service:
    return request.app.state.service


ServiceDep = Annotated[Service, Depends(current_service)]


def json_answer(payload: dict[str, Any]) -> tuple[bytes, str]:
    """A future's stored answer as JSON."""
    return json.dumps(payload).encode(), JSON


def future(request_id: str, model_id: str | None = None) -> dict[str, Any]:
    """What a queued request answers at once: the future the SDK polls."""
    return {"request_id": request_id, "model_id": model_id}
