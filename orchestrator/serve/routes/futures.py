"""`retrieve_future`: the long poll the SDK waits on for every queued request's answer."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from podtrain.orchestrator.serve import wire
from podtrain.orchestrator.serve.service import ServiceDep
from podtrain.orchestrator.serve.work import ServeError

router = APIRouter(prefix="/api/v1")


@router.post("/retrieve_future")
async def retrieve_future(body: wire.RetrieveBody, service: ServiceDep) -> Response:
    record = service.store.future(body.request_id)
    if record is None:
        raise ServeError(f"request_id: unknown request {body.request_id!r} (never made here, or its answer expired "
                         f"more than {service.lifetimes.result_ttl_s:g}s ago)", 404)
    if record.status == "pending":
        def pending() -> bool:
            return service.store.future(body.request_id).status == "pending"

        await service.waiters.wait(body.request_id, pending, service.long_poll_s)
        record = service.store.future(body.request_id)
    if record.status == "pending":
        waiting = {"queue_state": "active"}
        if (note := service.scheduler.engine_note) is not None:  # the SDK shows why it waits
            waiting = {"queue_state": "paused_capacity", "queue_state_reason": f"{note}; waiting for the new engine"}
        return JSONResponse({"type": "try_again", "request_id": body.request_id, **waiting})
    if record.status == "expired":
        kept = service.lifetimes.result_ttl_s
        raise ServeError(f"request_id: the answer of request {body.request_id!r} is gone: answers are kept {kept:g}s "
                         "after they are first retrieved (serve.result_ttl_s)", 410)
    service.store.retrieved(body.request_id)
    if record.status == "error":
        return JSONResponse({"error": record.error, "category": record.category})
    return Response(record.result, media_type=record.media_type)
