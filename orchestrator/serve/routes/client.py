"""Client setup: config flags, health, capabilities, sessions and telemetry."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from podtrain.orchestrator.serve import wire
from podtrain.orchestrator.serve.service import ServiceDep
from podtrain.orchestrator.serve.work import ServeError

router = APIRouter(prefix="/api/v1")


@router.post("/client/config")
def client_config(service: ServiceDep) -> dict[str, Any]:
    # Plain httpx, API keys, one serial forward_backward request per call (split only past half
    # the body limit), results polled one future at a time, custom losses client-side.
    return {"pjwt_auth_enabled": False, "credential_default_source": "api_key", "use_pyqwest_transport": False,
            "parallel_fwdbwd_chunks": False, "proto_compress_fwdbwd": False, "fwdbwd_max_chunk_len": 1 << 30,
            "fwdbwd_max_chunk_bytes_count": service.max_request_bytes // 2, "sample_use_retrieve_futures": False,
            "custom_loss_server_side": False, "sample_join_sampling_session": False}


@router.post("/client/dynamic_config")
def client_dynamic_config() -> dict[str, Any]:
    return {"refresh_interval_sec": 300, "sample_cancel_enabled": False}


@router.get("/healthz")
def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/get_server_capabilities")
def get_server_capabilities(service: ServiceDep) -> dict[str, Any]:
    info = service.info
    return {"supported_models": [{"model_name": info.base_model, "max_context_length": info.max_seq_len,
                                  "trainable": True, "sampleable": True}]}


@router.post("/create_session")
def create_session(body: wire.CreateSessionBody, service: ServiceDep) -> dict[str, Any]:
    return {"type": "create_session", "session_id": service.store.create_session(body.user_metadata)}


@router.post("/session_heartbeat")
def session_heartbeat(body: wire.SessionBody, service: ServiceDep) -> dict[str, Any]:
    session = service.store.session(body.session_id)
    if session is None:
        raise ServeError(f"session_id: unknown session {body.session_id!r}", 404)
    if session.finished is not None:
        raise ServeError(f"session {body.session_id!r} is finished", 410)
    service.store.heartbeat(body.session_id)
    return {"type": "session_heartbeat"}


@router.post("/sessions/{session_id}/finish")
def finish_session(session_id: str, body: dict[str, Any], service: ServiceDep) -> dict[str, Any]:
    if service.store.session(session_id) is None:
        raise ServeError(f"session_id: unknown session {session_id!r}", 404)
    status = str((body.get("reason") or {}).get("type", "finished"))
    service.lifetimes.end_session(session_id, f"closed by its client: {status}")
    return {}


@router.post("/telemetry")
def telemetry() -> dict[str, str]:
    return {"status": "accepted"}
