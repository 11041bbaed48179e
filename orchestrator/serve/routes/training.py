"""Training models: create, inspect, forward-backward, optimizer steps, save, load, unload."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

from fastapi import APIRouter, Request

from podtrain.orchestrator.serve import translate, wire
from podtrain.orchestrator.serve.service import Service, ServiceDep, future, json_answer
from podtrain.orchestrator.serve.store import CheckpointRecord, ModelRecord, SamplerRecord, Store
from podtrain.orchestrator.serve.store import tinker_path as make_tinker_path
from podtrain.orchestrator.serve.wire import PROTOBUF
from podtrain.orchestrator.serve.work import Load, OptimStep, Save, ServeError, Unload

router = APIRouter(prefix="/api/v1")


@router.post("/create_model")
def create_model(body: wire.CreateModelBody, service: ServiceDep) -> dict[str, Any]:
    info, store = service.info, service.store
    service.open_session(body.session_id)
    translate.check_base_model(body.base_model, info)
    model_id = f"{body.session_id}:train:{body.model_seq_id}"
    work = translate.create(model_id, body.lora_config, body.optimizer_config, info)

    def on_done(_: object) -> tuple[bytes, str]:
        store.add_model(ModelRecord(model_id, body.session_id, info.base_model, work.rank, work.targets,
                                    work.seed, time.time(), "live", None, body.user_metadata or {}))
        return json_answer({"type": "create_model", "model_id": model_id})

    return future(service.submit("create_model", model_id, 0, work, on_done), model_id)


@router.post("/get_info")
def get_info(body: wire.ModelBody, service: ServiceDep) -> dict[str, Any]:
    info = service.info
    model = service.model(body.model_id)
    progress = service.store.progress(model.model_id)
    # Beyond Tinker's fields (its SDK keeps extra ones): the optimizer steps the adapter has
    # taken, the step of the save a restart would bring it back from, and where the service's
    # live adapters are (device slots, host memory, disk: `serve/pages.py`).
    steps = {} if progress is None else {"step": progress.steps, "saved_step": progress.saved_step}
    return {"type": "get_info", "model_id": model.model_id, "is_lora": True, "lora_rank": model.rank,
            "model_name": info.base_model, "model_data": {"arch": info.model_type, "model_name": info.base_model,
                                                          "tokenizer_id": info.tokenizer_id}, **steps,
            "paging": service.paging()}


@router.post("/forward_backward")
async def forward_backward(request: Request, service: ServiceDep) -> dict[str, Any]:
    content_type = request.headers.get("content-type", "")
    if PROTOBUF not in content_type:
        raise ServeError(f"forward_backward: expected Content-Type {PROTOBUF} (tinker SDK 0.38), found "
                         f"{content_type!r}", 415)
    if request.headers.get("content-encoding", "identity") != "identity":
        raise ServeError(f"forward_backward: Content-Encoding {request.headers['content-encoding']!r} is not "
                         "supported; send the body uncompressed")
    message = wire.decode_forward_backward(await request.body())
    service.live_model(message.model_id)
    work = translate.forward_backward(message)
    kind = "forward" if message.forward_only else "forward_backward"
    request_id = service.submit(kind, message.model_id, message.seq_id, work,
                                lambda result: (wire.encode_forward_backward(result), PROTOBUF))
    return future(request_id, message.model_id)


@router.post("/optim_step")
def optim_step(body: wire.OptimStepBody, service: ServiceDep) -> dict[str, Any]:
    service.live_model(body.model_id)
    work = OptimStep(model_id=body.model_id, adam=translate.adam(body.adam_params, body.optimizer_params))
    request_id = service.submit("optim_step", body.model_id, body.seq_id, work,
                                lambda result: json_answer({"metrics": _floats(result.metrics)}))
    return future(request_id, body.model_id)


@router.post("/save_weights")
def save_weights(body: wire.SaveWeightsBody, service: ServiceDep) -> dict[str, Any]:
    store = service.store
    service.live_model(body.model_id)
    name = translate.checkpoint_name(body.path, "path")
    path = make_tinker_path(body.model_id, "state", name)
    if store.checkpoint(path) is not None and not body.overwrite:
        raise ServeError(f"path: checkpoint {path!r} exists; pass overwrite=True to replace it")
    work = Save(model_id=body.model_id, path=_prepared_dir(store, body.model_id, "state", name), optimizer=True)

    def on_done(_: object) -> tuple[bytes, str]:
        service.scheduler.forget_sampler_weights(store.add_checkpoint(body.model_id, "state", name).directory)
        return json_answer({"type": "save_weights", "path": path})

    return future(service.submit("save_weights", body.model_id, body.seq_id, work, on_done), body.model_id)


@router.post("/save_weights_for_sampler")
def save_weights_for_sampler(body: wire.SaveForSamplerBody, service: ServiceDep) -> dict[str, Any]:
    info, store = service.info, service.store
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
        return json_answer({"type": "save_weights_for_sampler", "path": path, "sampling_session_id": sampler_id})

    request_id = service.submit("save_weights_for_sampler", body.model_id, body.seq_id, work, on_done)
    return future(request_id, body.model_id)


@router.post("/load_weights")
def load_weights(body: wire.LoadWeightsBody, service: ServiceDep) -> dict[str, Any]:
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
        service.store.add_model(replace(model, rank=result.rank, targets=tuple(result.targets)))
        return json_answer({"type": "load_weights", "path": body.path, "model_id": model.model_id})

    return future(service.submit("load_weights", model.model_id, body.seq_id, work, on_done), model.model_id)


@router.post("/unload_model")
def unload_model(body: wire.ModelBody, service: ServiceDep) -> dict[str, Any]:
    service.live_model(body.model_id)

    def on_done(_: object) -> tuple[bytes, str]:
        service.store.set_model_state(body.model_id, "unloaded")
        return json_answer({"type": "unload_model", "model_id": body.model_id})

    request_id = service.submit("unload_model", body.model_id, None, Unload(model_id=body.model_id), on_done)
    return future(request_id, body.model_id)


def _load_new_model(service: Service, body: wire.LoadWeightsBody, checkpoint: CheckpointRecord) -> dict[str, Any]:
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
        return json_answer({"type": "load_weights", "path": body.path, "model_id": model_id})

    return future(service.submit("load_weights", model_id, 0, work, on_done), model_id)


def _prepared_dir(store: Store, model_id: str, kind: str, name: str) -> str:
    """The checkpoint's directory, its parent made (the engine writes the directory itself)."""
    directory = store.checkpoint_dir(model_id, kind, name)
    directory.parent.mkdir(parents=True, exist_ok=True)
    return str(directory)


def _floats(metrics: dict[str, Any]) -> dict[str, float]:
    return {key: float(value) for key, value in metrics.items()}
