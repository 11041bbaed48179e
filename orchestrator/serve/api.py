"""The HTTP front end of `podtrain serve`: the routes the tinker SDK (0.38) calls, over a `Backend`.

A handler checks its request, turns it into a work item (`translate`), lets the engine refuse it
at once (`Backend.check`: a 4xx whose message the SDK raises) and queues it for the scheduler
thread, answering with a future; the SDK then long-polls `retrieve_future`, which answers "try
again" until the result is stored. Errors found while running come back inside the future,
where the SDK raises them without retrying.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Callable
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, replace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

from podtrain.orchestrator.serve import translate, wire
from podtrain.orchestrator.serve.guard import NO_RETRY, Guard
from podtrain.orchestrator.serve.runs import add_run_routes
from podtrain.orchestrator.serve.scheduler import Job, Scheduler
from podtrain.orchestrator.serve.store import CheckpointRecord, ModelRecord, SamplerRecord, Store
from podtrain.orchestrator.serve.store import tinker_path as make_tinker_path
from podtrain.orchestrator.serve.wire import JSON, PROTOBUF, schema
from podtrain.orchestrator.serve.work import Backend, BaseInfo, Load, OptimStep, Save, ServeError, Unload, Work


def create_app(backend: Backend, store: Store, *, api_key: str | None, max_request_bytes: int,
               long_poll_s: float = 25.0, sampler_slots: int = 2, decode: translate.Decode | None = None,
               encode: translate.Encode | None = None, autosave_every: int = 0) -> FastAPI:
    """The service's app. A new app means a new engine: the models the store lists as live come
    back from their last saves (`Scheduler`), and futures left pending are failed. `decode` and
    `encode` are the service's tokenizer, which stop strings need; every `autosave_every`
    optimizer steps (0: never) an adapter's whole state is saved for such a restore."""
    store.fail_pending_futures("the service restarted before this request ran")
    schema()
    waiters = _Waiters()
    scheduler = Scheduler(backend, store, waiters.notify, sampler_slots, autosave_every)
    service = _Service(backend, store, scheduler, backend.info(), waiters, long_poll_s, max_request_bytes, decode,
                       encode)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        waiters.bind(asyncio.get_running_loop())
        scheduler.start()
        try:
            yield
        finally:
            scheduler.stop()

    app = FastAPI(title="podtrain serve", lifespan=lifespan)
    app.state.scheduler = scheduler
    app.add_middleware(Guard, api_key=api_key, max_bytes=max_request_bytes)
    app.add_exception_handler(ServeError, _refusal)
    app.add_exception_handler(RequestValidationError, _invalid_body)
    for add_routes in (_client_routes, _training_routes, _sampling_routes, _future_routes):
        add_routes(app, service)
    add_run_routes(app, store)

    @app.api_route("/api/v1/{rest:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"])
    def unsupported(rest: str, request: Request) -> None:
        raise translate.not_supported(f"{request.method} /api/v1/{rest}")

    return app


@dataclass
class _Service:
    backend: Backend
    store: Store
    scheduler: Scheduler
    info: BaseInfo
    waiters: _Waiters
    long_poll_s: float
    max_request_bytes: int
    decode: translate.Decode | None
    encode: translate.Encode | None

    def submit(self, kind: str, key: str, seq: int | None, work: Work, on_done: Callable[[object], tuple[bytes, str]],
               sampler_dir: str | None = None) -> str:
        """Queues `work` after the engine's check; a resubmission of the same `seq` gets the
        first one's request id."""
        dedup_key = None if seq is None else f"{kind}#{key}#{seq}"
        if dedup_key is not None and (request_id := self.store.future_id(dedup_key)) is not None:
            return request_id
        self.backend.check(work)
        request_id, fresh = self.store.add_future(kind, key, dedup_key)
        if fresh and (notice := self.scheduler.take_notice(key)) is not None:
            self.store.fail_future(request_id, notice, "server")  # as a request in flight is told
        elif fresh:
            self.scheduler.submit(Job(request_id, key, math.inf if seq is None else seq, work, on_done, sampler_dir))
        return request_id

    def open_session(self, session_id: str) -> None:
        session = self.store.session(session_id)
        if session is None:
            raise ServeError(f"session_id: unknown session {session_id!r}", 404)
        if session.finished is not None:
            raise ServeError(f"session {session_id!r} is finished ({session.finished})")

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
            raise ServeError(f"model {model_id!r} is unloaded (unload_model, its session finished, or it could not "
                             f"be brought back after a restart); continue with {resume}")
        return model

    def checkpoint(self, path: str, field: str) -> CheckpointRecord:
        checkpoint = self.store.checkpoint(path)
        if checkpoint is None:
            raise ServeError(f"{field}: unknown checkpoint {path!r}; expected a tinker:// path this service saved", 404)
        return checkpoint


def _json(payload: dict[str, Any]) -> tuple[bytes, str]:
    return json.dumps(payload).encode(), JSON


def _future(request_id: str, model_id: str | None = None) -> dict[str, Any]:
    return {"request_id": request_id, "model_id": model_id}


def _client_routes(app: FastAPI, service: _Service) -> None:
    """Client setup: config flags, health, capabilities, sessions and telemetry."""
    info, store = service.info, service.store

    @app.post("/api/v1/client/config")
    def client_config() -> dict[str, Any]:
        # Plain httpx, API keys, one serial forward_backward request per call (split only past
        # half the body limit), results polled one future at a time, custom losses client-side.
        return {"pjwt_auth_enabled": False, "credential_default_source": "api_key", "use_pyqwest_transport": False,
                "parallel_fwdbwd_chunks": False, "proto_compress_fwdbwd": False, "fwdbwd_max_chunk_len": 1 << 30,
                "fwdbwd_max_chunk_bytes_count": service.max_request_bytes // 2, "sample_use_retrieve_futures": False,
                "custom_loss_server_side": False, "sample_join_sampling_session": False}

    @app.post("/api/v1/client/dynamic_config")
    def client_dynamic_config() -> dict[str, Any]:
        return {"refresh_interval_sec": 300, "sample_cancel_enabled": False}

    @app.get("/api/v1/healthz")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/api/v1/get_server_capabilities")
    def get_server_capabilities() -> dict[str, Any]:
        return {"supported_models": [{"model_name": info.base_model, "max_context_length": info.max_seq_len,
                                      "trainable": True, "sampleable": True}]}

    @app.post("/api/v1/create_session")
    def create_session(body: wire.CreateSessionBody) -> dict[str, Any]:
        return {"type": "create_session", "session_id": store.create_session(body.user_metadata)}

    @app.post("/api/v1/session_heartbeat")
    def session_heartbeat(body: wire.SessionBody) -> dict[str, Any]:
        session = store.session(body.session_id)
        if session is None:
            raise ServeError(f"session_id: unknown session {body.session_id!r}", 404)
        if session.finished is not None:
            raise ServeError(f"session {body.session_id!r} is finished", 410)
        store.heartbeat(body.session_id)
        return {"type": "session_heartbeat"}

    @app.post("/api/v1/sessions/{session_id}/finish")
    def finish_session(session_id: str, body: dict[str, Any]) -> dict[str, Any]:
        if store.session(session_id) is None:
            raise ServeError(f"session_id: unknown session {session_id!r}", 404)
        store.finish_session(session_id, str((body.get("reason") or {}).get("type", "finished")))
        for model in store.models(session_id):
            if model.state == "live":
                store.set_model_state(model.model_id, "unloaded")
                service.scheduler.submit(Job(None, model.model_id, math.inf, Unload(model_id=model.model_id),
                                             lambda _: _json({})))
        return {}

    @app.post("/api/v1/telemetry")
    def telemetry() -> dict[str, str]:
        return {"status": "accepted"}


def _training_routes(app: FastAPI, service: _Service) -> None:
    """Training models: create, inspect, forward-backward, optimizer steps, save, load, unload."""
    info, store = service.info, service.store

    @app.post("/api/v1/create_model")
    def create_model(body: wire.CreateModelBody) -> dict[str, Any]:
        service.open_session(body.session_id)
        translate.check_base_model(body.base_model, info)
        model_id = f"{body.session_id}:train:{body.model_seq_id}"
        work = translate.create(model_id, body.lora_config, body.optimizer_config, info)

        def on_done(_: object) -> tuple[bytes, str]:
            store.add_model(ModelRecord(model_id, body.session_id, info.base_model, work.rank, work.targets,
                                        work.seed, time.time(), "live", None, body.user_metadata or {}))
            return _json({"type": "create_model", "model_id": model_id})

        return _future(service.submit("create_model", model_id, 0, work, on_done), model_id)

    @app.post("/api/v1/get_info")
    def get_info(body: wire.ModelBody) -> dict[str, Any]:
        model = service.model(body.model_id)
        progress = store.progress(model.model_id)
        # Beyond Tinker's fields (its SDK keeps extra ones): the optimizer steps the adapter has
        # taken, and the step of the save a restart would bring it back from.
        steps = {} if progress is None else {"step": progress.steps, "saved_step": progress.saved_step}
        return {"type": "get_info", "model_id": model.model_id, "is_lora": True, "lora_rank": model.rank,
                "model_name": info.base_model, "model_data": {"arch": info.model_type, "model_name": info.base_model,
                                                              "tokenizer_id": info.tokenizer_id}, **steps}

    @app.post("/api/v1/forward_backward")
    async def forward_backward(request: Request) -> dict[str, Any]:
        content_type = request.headers.get("content-type", "")
        if PROTOBUF not in content_type:
            raise ServeError(f"forward_backward: expected Content-Type {PROTOBUF} (tinker SDK 0.38), found "
                             f"{content_type!r}", 415)
        if request.headers.get("content-encoding", "identity") != "identity":
            raise ServeError(f"forward_backward: Content-Encoding {request.headers['content-encoding']!r} is not "
                             "supported; send the body uncompressed")
        message = wire.decode_forward_backward(await request.body())
        service.live_model(message.model_id)
        work = translate.forward_backward(message, info)
        kind = "forward" if message.forward_only else "forward_backward"
        request_id = service.submit(kind, message.model_id, message.seq_id, work,
                                    lambda result: (wire.encode_forward_backward(result), PROTOBUF))
        return _future(request_id, message.model_id)

    @app.post("/api/v1/optim_step")
    def optim_step(body: wire.OptimStepBody) -> dict[str, Any]:
        service.live_model(body.model_id)
        work = OptimStep(model_id=body.model_id, adam=translate.adam(body.adam_params, body.optimizer_params))
        request_id = service.submit("optim_step", body.model_id, body.seq_id, work,
                                    lambda result: _json({"metrics": _floats(result.metrics)}))
        return _future(request_id, body.model_id)

    @app.post("/api/v1/save_weights")
    def save_weights(body: wire.SaveWeightsBody) -> dict[str, Any]:
        service.live_model(body.model_id)
        name = translate.checkpoint_name(body.path, "path")
        path = make_tinker_path(body.model_id, "state", name)
        if store.checkpoint(path) is not None and not body.overwrite:
            raise ServeError(f"path: checkpoint {path!r} exists; pass overwrite=True to replace it")
        work = Save(model_id=body.model_id, path=_prepared_dir(store, body.model_id, "state", name), optimizer=True)

        def on_done(_: object) -> tuple[bytes, str]:
            service.scheduler.forget_sampler_weights(store.add_checkpoint(body.model_id, "state", name).directory)
            return _json({"type": "save_weights", "path": path})

        return _future(service.submit("save_weights", body.model_id, body.seq_id, work, on_done), body.model_id)

    @app.post("/api/v1/save_weights_for_sampler")
    def save_weights_for_sampler(body: wire.SaveForSamplerBody) -> dict[str, Any]:
        model = service.live_model(body.model_id)
        if body.kind != "snapshot":
            raise translate.not_supported(f"sampling client kind {body.kind!r} (only snapshot)")
        named = body.path is not None
        if not named and body.sampling_session_seq_id is None:
            raise ServeError("save_weights_for_sampler: expected a path or a sampling_session_seq_id")
        name = translate.checkpoint_name(body.path, "path") if named else f"session-{body.sampling_session_seq_id}"
        path = make_tinker_path(body.model_id, "sampler", name)
        if named and store.checkpoint(path) is not None:
            raise ServeError(f"path: sampler checkpoint {path!r} exists; choose another name")
        sampler_id = None if named else f"{model.session_id}:sample:{body.sampling_session_seq_id}"
        work = Save(model_id=body.model_id, path=_prepared_dir(store, body.model_id, "sampler", name), optimizer=False)

        def on_done(_: object) -> tuple[bytes, str]:
            checkpoint = store.add_checkpoint(body.model_id, "sampler", name)
            if sampler_id is not None:
                store.add_sampler(SamplerRecord(sampler_id, model.session_id, info.base_model, path,
                                                checkpoint.directory, time.time()))
            return _json({"type": "save_weights_for_sampler", "path": path, "sampling_session_id": sampler_id})

        request_id = service.submit("save_weights_for_sampler", body.model_id, body.seq_id, work, on_done)
        return _future(request_id, body.model_id)

    @app.post("/api/v1/load_weights")
    def load_weights(body: wire.LoadWeightsBody) -> dict[str, Any]:
        checkpoint = service.checkpoint(body.path, "path")
        if body.optimizer and checkpoint.kind != "state":
            raise ServeError(f"path: {body.path!r} holds sampler weights, which have no optimizer state; load a "
                             "tinker://<model>/weights/<name> path")
        translate.check_optimizer(body.optimizer_config)
        if body.session_id is not None:
            return _load_new_model(service, body, checkpoint)
        if body.model_id is None:
            raise ServeError("load_weights: expected a model_id, or a session_id and model_seq_id")
        model = service.live_model(body.model_id)
        work = Load(model_id=model.model_id, path=checkpoint.directory, optimizer=body.optimizer)

        def on_done(result: Any) -> tuple[bytes, str]:
            store.add_model(replace(model, rank=result.rank, targets=tuple(result.targets)))
            return _json({"type": "load_weights", "path": body.path, "model_id": model.model_id})

        return _future(service.submit("load_weights", model.model_id, body.seq_id, work, on_done), model.model_id)

    @app.post("/api/v1/unload_model")
    def unload_model(body: wire.ModelBody) -> dict[str, Any]:
        service.live_model(body.model_id)

        def on_done(_: object) -> tuple[bytes, str]:
            store.set_model_state(body.model_id, "unloaded")
            return _json({"type": "unload_model", "model_id": body.model_id})

        request_id = service.submit("unload_model", body.model_id, None, Unload(model_id=body.model_id), on_done)
        return _future(request_id, body.model_id)


def _load_new_model(service: _Service, body: wire.LoadWeightsBody, checkpoint: CheckpointRecord) -> dict[str, Any]:
    """`create_training_client_from_state`: a new model whose first request is the load."""
    service.open_session(body.session_id)
    translate.check_base_model(body.base_model, service.info)
    if body.model_seq_id is None:
        raise ServeError("load_weights: a session_id needs a model_seq_id")
    model_id = f"{body.session_id}:train:{body.model_seq_id}"
    work = Load(model_id=model_id, path=checkpoint.directory, optimizer=body.optimizer)

    def on_done(result: Any) -> tuple[bytes, str]:
        service.store.add_model(ModelRecord(model_id, body.session_id, service.info.base_model, result.rank,
                                            tuple(result.targets), None, time.time(), "live", None,
                                            body.user_metadata or {}))
        return _json({"type": "load_weights", "path": body.path, "model_id": model_id})

    return _future(service.submit("load_weights", model_id, 0, work, on_done), model_id)


def _prepared_dir(store: Store, model_id: str, kind: str, name: str) -> str:
    """The checkpoint's directory, its parent made (the engine writes the directory itself)."""
    directory = store.checkpoint_dir(model_id, kind, name)
    directory.parent.mkdir(parents=True, exist_ok=True)
    return str(directory)


def _sampling_routes(app: FastAPI, service: _Service) -> None:
    """Sampling sessions over saved sampler weights or the base model, and their samples."""
    info, store = service.info, service.store

    @app.post("/api/v1/create_sampling_session")
    def create_sampling_session(body: wire.CreateSamplingSessionBody) -> dict[str, Any]:
        service.open_session(body.session_id)
        translate.check_base_model(body.base_model, info)
        if body.model_path is None and body.base_model is None:
            raise ServeError("create_sampling_session: expected a model_path or a base_model")
        directory = service.checkpoint(body.model_path, "model_path").directory if body.model_path else None
        sampler_id = f"{body.session_id}:sample:{body.sampling_session_seq_id}"
        store.add_sampler(SamplerRecord(sampler_id, body.session_id, info.base_model, body.model_path, directory,
                                        time.time()))
        return {"type": "create_sampling_session", "sampling_session_id": sampler_id}

    @app.get("/api/v1/samplers/{sampler_id}")
    def get_sampler(sampler_id: str) -> dict[str, Any]:
        sampler = store.sampler(sampler_id)
        if sampler is None:
            raise ServeError(f"sampler_id: unknown sampling session {sampler_id!r}", 404)
        return {"sampler_id": sampler_id, "base_model": sampler.base_model, "model_path": sampler.model_path}

    @app.post("/api/v1/asample")
    def asample(body: wire.SampleBody) -> dict[str, Any]:
        if body.sampling_session_id is None:
            raise translate.not_supported("asample without a sampling_session_id (create a sampling client first)")
        sampler = store.sampler(body.sampling_session_id)
        if sampler is None:
            raise ServeError(f"sampling_session_id: unknown sampling session {body.sampling_session_id!r}", 404)
        work = translate.sample(body, info, service.decode, service.encode)

        def on_done(result: Any) -> tuple[bytes, str]:
            result = translate.cut_at_stop_strings(result, work.stop_strings, service.decode)
            logprobs = result.prompt_logprobs if work.prompt_logprobs else None
            logprobs = translate.masked_prompt_logprobs(logprobs, body.prompt_logprobs_last_n)
            return wire.encode_sample(result, logprobs), PROTOBUF

        request_id = service.submit("sample", sampler.sampler_id, body.seq_id, work, on_done, sampler.directory)
        return {"request_id": request_id, "sample_sequence_ids": [f"{request_id}:{i}" for i in range(work.num_samples)]}


def _future_routes(app: FastAPI, service: _Service) -> None:
    @app.post("/api/v1/retrieve_future")
    async def retrieve_future(body: wire.RetrieveBody) -> Response:
        record = service.store.future(body.request_id)
        if record is None:
            raise ServeError(f"request_id: unknown request {body.request_id!r}", 404)
        if record.status == "pending":
            def pending() -> bool:
                return service.store.future(body.request_id).status == "pending"

            await service.waiters.wait(body.request_id, pending, service.long_poll_s)
            record = service.store.future(body.request_id)
        if record.status == "pending":
            waiting = {"queue_state": "active"}
            if (note := service.scheduler.engine_note) is not None:  # the SDK shows why it waits
                waiting = {"queue_state": "paused_capacity",
                           "queue_state_reason": f"{note}; waiting for the new engine"}
            return JSONResponse({"type": "try_again", "request_id": body.request_id, **waiting})
        if record.status == "error":
            return JSONResponse({"error": record.error, "category": record.category})
        return Response(record.result, media_type=record.media_type)


def _floats(metrics: dict[str, Any]) -> dict[str, float]:
    return {key: float(value) for key, value in metrics.items()}


class _Waiters:
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


def _refusal(_: Request, error: ServeError) -> JSONResponse:
    return JSONResponse({"detail": str(error)}, error.status, NO_RETRY)


def _invalid_body(_: Request, error: RequestValidationError) -> JSONResponse:
    first = error.errors()[0]
    where = ".".join(str(part) for part in first["loc"] if part != "body") or "body"
    return JSONResponse({"detail": f"{where}: {first['msg']}"}, 400, NO_RETRY)
