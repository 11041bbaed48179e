"""The HTTP front end of `podtrain serve`: the routes the tinker SDK (0.38) calls, over a `Backend`.

A handler turns its request into a work item (`translate`), lets the backend refuse it at once
(`Backend.check`, `checks.check_work`: a 4xx whose message the SDK raises) and queues it for the
scheduler thread, answering with a future; the SDK then long-polls `retrieve_future`, which answers
"try again" until the result is stored. Errors found while running come back inside the future,
where the SDK raises them without retrying. The routes are grouped in routers (`routes/`); what
they share is the app's `Service`.
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from podtrain.orchestrator.serve import translate
from podtrain.orchestrator.serve.guard import NO_RETRY, Guard
from podtrain.orchestrator.serve.lifetimes import Lifetimes
from podtrain.orchestrator.serve.routes import client, futures, runs, sampling, training
from podtrain.orchestrator.serve.scheduler import Scheduler
from podtrain.orchestrator.serve.service import Service, Waiters
from podtrain.orchestrator.serve.store import Store
from podtrain.orchestrator.serve.wire import schema
from podtrain.orchestrator.serve.work import Backend, ServeError


def create_app(backend: Backend, store: Store, *, api_key: str | None, max_request_bytes: int,
               long_poll_s: float = 25.0, sampler_slots: int = 2, decode: translate.Decode | None = None,
               encode: translate.Encode | None = None, autosave_every: int = 0, session_timeout_s: float = 0.0,
               result_ttl_s: float = 3600.0) -> FastAPI:
    """The service's app. A new app means a new engine: the models the store lists as live come
    back from their last saves (`Scheduler`), and futures left pending are failed. `decode` and
    `encode` are the service's tokenizer, which stop strings need; every `autosave_every`
    optimizer steps (0: never) an adapter's whole state is saved for such a restore. Sessions
    silent for `session_timeout_s` (0: never) end, and answers expire `result_ttl_s` after
    their first retrieve (`Lifetimes`)."""
    store.fail_pending_futures("the service restarted before this request ran")
    schema()
    waiters = Waiters()
    scheduler = Scheduler(backend, store, waiters.notify, sampler_slots, autosave_every)
    lifetimes = Lifetimes(store, scheduler, session_timeout_s, result_ttl_s)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        waiters.bind(asyncio.get_running_loop())
        scheduler.start()
        lifetimes.start()
        try:
            yield
        finally:
            lifetimes.stop()
            scheduler.stop()

    app = FastAPI(title="podtrain serve", lifespan=lifespan)
    app.state.service = Service(backend, store, scheduler, lifetimes, backend.info(), waiters, long_poll_s,
                                max_request_bytes, decode, encode)
    app.add_middleware(Guard, api_key=api_key, max_bytes=max_request_bytes)
    app.add_exception_handler(ServeError, _refusal)
    app.add_exception_handler(RequestValidationError, _invalid_body)
    for module in (client, training, sampling, futures, runs):
        app.include_router(module.router)

    @app.api_route("/api/v1/{rest:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"])
    def unsupported(rest: str, request: Request) -> None:
        raise translate.not_supported(f"{request.method} /api/v1/{rest}")

    return app


def _refusal(_: Request, error: ServeError) -> JSONResponse:
    return JSONResponse({"detail": str(error)}, error.status, NO_RETRY)


def _invalid_body(_: Request, error: RequestValidationError) -> JSONResponse:
    first = error.errors()[0]
    where = ".".join(str(part) for part in first["loc"] if part != "body") or "body"
    return JSONResponse({"detail": f"{where}: {first['msg']}"}, 400, NO_RETRY)
