"""What the service refuses before anything runs, the one place a request's values are checked:
each work item against the base model (`BaseInfo`) alone, so the front end answers a bad request
with a 4xx at once, in the driver, without asking the engine. `translate` only turns the wire's
shapes into work items; the engine checks only what needs its state (a free slot, a known
adapter, a saved adapter's own rank and targets, with `check_adapter`)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from podtrain.models.architectures import ARCHITECTURES
from podtrain.orchestrator.serve import losses
from podtrain.orchestrator.serve.work import (
    BaseInfo,
    Create,
    Datum,
    ForwardBackward,
    OptimStep,
    Sample,
    ServeError,
    Work,
)


def check_work(info: BaseInfo, targets: Sequence[str], work: Work) -> None:
    """Raises ServeError (400) naming the field of `work` that the service cannot run; `targets`
    are the adapter targets the service holds."""
    if isinstance(work, Create):
        check_adapter(info, targets, work.rank, work.targets)
    elif isinstance(work, ForwardBackward):
        losses.loss_config(work.loss_fn, work.loss_fn_config)
        if not work.data:
            raise ServeError("data: expected at least one datum, found none")
        for i, datum in enumerate(work.data):
            _check_datum(info, i, datum, work.loss_fn)
    elif isinstance(work, OptimStep):
        for key, value in work.adam.items():
            if not math.isfinite(value):
                raise ServeError(f"adam_params.{key}: expected a finite number, found {value!r}")
    elif isinstance(work, Sample):
        _check_sample(info, work)


def check_adapter(info: BaseInfo, targets: Sequence[str], rank: int, chosen: Sequence[str]) -> None:
    """An adapter of `rank` on the targets `chosen`: what the service's slots can hold."""
    if not 1 <= rank <= info.max_rank:
        raise ServeError(f"lora_config.rank: expected 1 to {info.max_rank}, found {rank} (serve.max_rank is "
                         f"{info.max_rank})")
    unknown = [t for t in chosen if t not in targets]
    if unknown or not chosen:
        raise ServeError(f"lora targets: expected some of {list(targets)}, found {list(chosen)}")


def serve_targets(model_type: str, *, attn: bool = True, mlp: bool = True, unembed: bool = True) -> tuple[str, ...]:
    """The adapter targets of Tinker's `train_attn` / `train_mlp` / `train_unembed` switches, as
    the architecture names them (`Architecture.adapter_targets`). The LM head's adapter, on a model
    with tied embeddings, adapts the output projection alone (as PEFT's does)."""
    targets = ARCHITECTURES[model_type].adapter_targets.chosen(attn=attn, mlp=mlp, unembed=unembed)
    if not targets:
        raise ServeError("lora_config: expected at least one of train_attn, train_mlp, train_unembed")
    return targets


def slot_targets(model) -> tuple[str, ...]:
    """Every target the adapter slots of a service on `model` (a ModelConfig) hold."""
    return serve_targets(model.model_type)


def _check_ids(info: BaseInfo, what: str, ids: np.ndarray) -> None:
    bad = ids[(ids < 0) | (ids >= info.vocab_size)]
    if bad.size:
        raise ServeError(f"{what}: token ids must be in [0, {info.vocab_size}), found {int(bad[0])}")


def _check_tokens(info: BaseInfo, what: str, tokens: np.ndarray, *, sampled: bool = False) -> None:
    if tokens.ndim != 1 or len(tokens) == 0:
        raise ServeError(f"{what}: expected at least one token, found shape {tokens.shape}")
    limit, key = (info.sample_tokens(), "max_sample_tokens") if sampled else (info.max_seq_len, "max_seq_len")
    if len(tokens) > limit:
        raise ServeError(f"{what}: {len(tokens)} tokens exceed serve.{key} ({limit})")
    _check_ids(info, what, tokens)


def _check_datum(info: BaseInfo, i: int, datum: Datum, loss_fn: str) -> None:
    _check_tokens(info, f"data[{i}].model_input", datum.tokens)
    needed, allowed = losses.REQUIRED[loss_fn], losses.REQUIRED[loss_fn] + losses.OPTIONAL[loss_fn]
    missing = [k for k in needed if k not in datum.inputs]
    if missing:
        raise ServeError(f"data[{i}].loss_fn_inputs: {loss_fn} needs {list(needed)}, missing {missing}")
    extra = [k for k in datum.inputs if k not in allowed]
    if extra:
        raise ServeError(f"data[{i}].loss_fn_inputs: {loss_fn} takes {list(allowed)}, found {extra}")
    for key, value in datum.inputs.items():
        if value.shape != datum.tokens.shape:
            raise ServeError(f"data[{i}].loss_fn_inputs.{key}: expected {len(datum.tokens)} values, one per "
                             f"model_input token, found shape {tuple(value.shape)}")
        if key == "target_tokens":
            _check_ids(info, f"data[{i}].loss_fn_inputs['target_tokens']", value)
        elif not np.all(np.isfinite(value)):
            raise ServeError(f"data[{i}].loss_fn_inputs.{key}: expected finite numbers, found NaN or inf")


def _check_sample(info: BaseInfo, work: Sample) -> None:
    _check_tokens(info, "prompt", work.prompt, sampled=True)
    if work.num_samples < 1:
        raise ServeError(f"num_samples: expected at least 1, found {work.num_samples}")
    if work.max_tokens < 1:
        raise ServeError(f"sampling_params.max_tokens: expected a positive integer, found {work.max_tokens}")
    if len(work.prompt) + work.max_tokens > info.sample_tokens():
        raise ServeError(f"prompt ({len(work.prompt)} tokens) plus sampling_params.max_tokens ({work.max_tokens}) "
                         f"exceeds the {info.sample_tokens()} tokens a sampled sequence may hold "
                         "(serve.max_sample_tokens)")
    if not work.temperature >= 0:
        raise ServeError(f"sampling_params.temperature: expected 0 or more, found {work.temperature}")
    if not 0 < work.top_p <= 1:
        raise ServeError(f"sampling_params.top_p: expected a value in (0, 1], found {work.top_p}")
    if work.top_k != -1 and work.top_k < 1:
        raise ServeError(f"sampling_params.top_k: expected -1 (no limit) or at least 1, found {work.top_k}")
    _check_ids(info, "sampling_params.stop", np.asarray(work.stop_tokens, np.int64))
    if not all(work.stop_strings):
        raise ServeError("sampling_params.stop: a stop string must not be empty")
