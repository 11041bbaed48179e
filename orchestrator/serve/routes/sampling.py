"""Sampling sessions over saved sampler weights or the base model, and their samples."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter

from podtrain.orchestrator.serve import translate, wire
from podtrain.orchestrator.serve.service import ServiceDep
from podtrain.orchestrator.serve.store import SamplerRecord
from podtrain.orchestrator.serve.wire import PROTOBUF
from podtrain.orchestrator.serve.work import ServeError

router = APIRouter(prefix="/api/v1")


@router.post("/create_sampling_session")
def create_sampling_session(body: wire.CreateSamplingSessionBody, service: ServiceDep) -> dict[str, Any]:
    info = service.info
    service.open_session(body.session_id)
    translate.check_base_model(body.base_model, info)
    if body.model_path is None and body.base_model is None:
        raise ServeError("create_sampling_session: expected a model_path or a base_model")
    directory = service.checkpoint(body.model_path, "model_path").directory if body.model_path else None
    sampler_id = f"{body.session_id}:sample:{body.sampling_session_seq_id}"
    service.store.add_sampler(SamplerRecord(sampler_id, body.session_id, info.base_model, body.model_path, directory,
                                            time.time()))
    return {"type": "create_sampling_session", "sampling_session_id": sampler_id}


@router.get("/samplers/{sampler_id}")
def get_sampler(sampler_id: str, service: ServiceDep) -> dict[str, Any]:
    sampler = service.store.sampler(sampler_id)
    if sampler is None:
        raise ServeError(f"sampler_id: unknown sampling session {sampler_id!r}", 404)
    return {"sampler_id": sampler_id, "base_model": sampler.base_model, "model_path": sampler.model_path}


@router.post("/asample")
def asample(body: wire.SampleBody, service: ServiceDep) -> dict[str, Any]:
    if body.sampling_session_id is None:
        raise translate.not_supported("asample without a sampling_session_id (create a sampling client first)")
    sampler = service.open_sampler(body.sampling_session_id, "sampling_session_id")
    work = translate.sample(body, service.info, service.decode, service.encode)

    def on_done(result: Any) -> tuple[bytes, str]:
        result = translate.cut_at_stop_strings(result, work.stop_strings, service.decode)
        logprobs = result.prompt_logprobs if work.prompt_logprobs else None
        logprobs = translate.masked_prompt_logprobs(logprobs, body.prompt_logprobs_last_n)
        return wire.encode_sample(result, logprobs), PROTOBUF

    request_id = service.submit("sample", sampler.sampler_id, body.seq_id, work, on_done, sampler.directory)
    return {"request_id": request_id, "sample_sequence_ids": [f"{request_id}:{i}" for i in range(work.num_samples)]}
