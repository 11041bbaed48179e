"""The RestClient's calls: training runs, their checkpoints, and what a checkpoint holds, all
answered from the store (so they outlive the engine that made them); and deleting a checkpoint."""

from __future__ import annotations

import shutil
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Response

from podtrain.orchestrator.serve.service import ServiceDep
from podtrain.orchestrator.serve.store import PATH_SEGMENT, CheckpointRecord, ModelRecord, Store
from podtrain.orchestrator.serve.wire import WeightsInfoBody
from podtrain.orchestrator.serve.work import ServeError

router = APIRouter(prefix="/api/v1")


@router.get("/training_runs")
def list_training_runs(service: ServiceDep, limit: int = 20, offset: int = 0) -> dict[str, Any]:
    store = service.store
    models = store.models()
    return {"training_runs": [_training_run(store, model) for model in models[offset:offset + limit]],
            "cursor": {"offset": offset, "limit": limit, "total_count": len(models)}}


@router.get("/training_runs/{model_id}")
def get_training_run(model_id: str, service: ServiceDep) -> dict[str, Any]:
    return _training_run(service.store, _model(service.store, model_id))


@router.get("/training_runs/{model_id}/checkpoints")
def list_checkpoints(model_id: str, service: ServiceDep) -> dict[str, Any]:
    _model(service.store, model_id)
    return {"checkpoints": [_checkpoint_json(checkpoint) for checkpoint in service.store.checkpoints(model_id)]}


@router.get("/checkpoints")
def list_user_checkpoints(service: ServiceDep, limit: int = 100, offset: int = 0) -> dict[str, Any]:
    checkpoints = service.store.checkpoints()
    return {"checkpoints": [_checkpoint_json(checkpoint) for checkpoint in checkpoints[offset:offset + limit]],
            "cursor": {"offset": offset, "limit": limit, "total_count": len(checkpoints)}}


@router.delete("/training_runs/{model_id}/checkpoints/{checkpoint_id:path}", status_code=204)
def delete_checkpoint(model_id: str, checkpoint_id: str, service: ServiceDep) -> Response:
    """Deletes a checkpoint's files and forgets it, unless an open session samples from it or a live
    model would come back from it after a restart. The refusal is a 400: the SDK retries a 409 until
    its own deadline, and waiting does not end a session."""
    store = service.store
    path = f"tinker://{model_id}/{checkpoint_id}"
    checkpoint = service.checkpoint(path, "checkpoint_id")
    if users := store.samplers(model_path=path, open_sessions=True):
        raise ServeError(f"checkpoint_id: {path!r} is sampled from by sampling session {users[0].sampler_id!r} of an "
                         "open session; delete it after that session is closed", 400)
    if (model := store.restore_point_of(checkpoint.directory)) is not None:
        raise ServeError(f"checkpoint_id: {path!r} is the save live model {model!r} comes back from after a restart; "
                         "delete it after a newer save_state of that model, or after unloading it", 400)
    store.delete_checkpoint(path)
    service.scheduler.forget_sampler_weights(checkpoint.directory)
    for directory in (checkpoint.directory, f"{checkpoint.directory}.previous"):
        shutil.rmtree(directory, ignore_errors=True)
    return Response(status_code=204)


@router.post("/weights_info")
def weights_info(body: WeightsInfoBody, service: ServiceDep) -> dict[str, Any]:
    checkpoint = service.store.checkpoint(body.tinker_path)
    if checkpoint is None:
        raise ServeError(f"tinker_path: unknown checkpoint {body.tinker_path!r}", 404)
    model = _model(service.store, checkpoint.model_id)
    targets = set(model.targets)
    return {"base_model": model.base_model, "is_lora": True, "lora_rank": model.rank,
            "train_unembed": "lm_head" in targets, "train_mlp": "gate_proj" in targets,
            "train_attn": "o_proj" in targets}


def _model(store: Store, model_id: str) -> ModelRecord:
    model = store.model(model_id)
    if model is None:
        raise ServeError(f"model_id: unknown training run {model_id!r}", 404)
    return model


def _training_run(store: Store, model: ModelRecord) -> dict[str, Any]:
    checkpoints = store.checkpoints(model.model_id)
    latest = {kind: next((c for c in reversed(checkpoints) if c.kind == kind), None) for kind in PATH_SEGMENT}
    last_time = max([model.created, *(checkpoint.created for checkpoint in checkpoints)])
    return {"training_run_id": model.model_id, "base_model": model.base_model, "model_owner": model.session_id,
            "is_lora": True, "corrupted": False, "lora_rank": model.rank, "last_request_time": _iso(last_time),
            "last_checkpoint": _checkpoint_json(latest["state"]) if latest["state"] else None,
            "last_sampler_checkpoint": _checkpoint_json(latest["sampler"]) if latest["sampler"] else None,
            "user_metadata": {str(key): str(value) for key, value in model.user_metadata.items()}}


def _checkpoint_json(checkpoint: CheckpointRecord) -> dict[str, Any]:
    files = [path for path in Path(checkpoint.directory).rglob("*") if path.is_file()]
    return {"checkpoint_id": f"{PATH_SEGMENT[checkpoint.kind]}/{checkpoint.name}",
            "checkpoint_type": "training" if checkpoint.kind == "state" else "sampler",
            "time": _iso(checkpoint.created), "tinker_path": checkpoint.tinker_path,
            "size_bytes": sum(path.stat().st_size for path in files), "public": False}


def _iso(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).isoformat()
