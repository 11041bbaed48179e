"""What the service refuses before anything runs: each work item checked against the base model
(`BaseInfo`) alone, so the front end answers a bad request with a 4xx at once, in the driver,
without asking the engine."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from podtrain.models.lora import ATTENTION_TARGETS, MLA_TARGETS, MLP_TARGETS
from podtrain.orchestrator.serve import losses
from podtrain.orchestrator.serve.work import BaseInfo, Create, Datum, ForwardBackward, Sample, ServeError, Work


def check_work(info: BaseInfo, targets: Sequence[str], work: Work) -> None:
    """Raises ServeError (400) naming the field of `work` that the service cannot run; `targets`
    are the adapter targets the service holds."""
    if isinstance(work, Create):
        if not 1 <= work.rank <= info.max_rank:
            raise ServeError(f"lora_config.rank: expected 1 to {info.max_rank} (serve.max_rank), found {work.rank}")
        unknown = [t for t in work.targets if t not in targets]
        if unknown or not work.targets:
            raise ServeError(f"lora targets: expected some of {list(targets)}, found {list(work.targets)}")
    elif isinstance(work, ForwardBackward):
        losses.loss_config(work.loss_fn, work.loss_fn_config)
        if not work.data:
            raise ServeError("data: expected at least one datum, found none")
        for i, datum in enumerate(work.data):
            _check_datum(info, i, datum, work.loss_fn)
    elif isinstance(work, Sample):
        _check_sample(info, work)


def serve_targets(model_type: str, *, attn: bool = True, mlp: bool = True, unembed: bool = True) -> tuple[str, ...]:
    """The adapter targets of Tinker's `train_attn` / `train_mlp` / `train_unembed` switches.
    DeepSeek-V3's attention targets are MLA's projections; its MLP targets are the dense and
    shared-expert MLPs and the routed experts. The LM head's adapter, on a model with tied
    embeddings, adapts the output projection alone (as PEFT's does)."""
    deepseek = model_type == "deepseek_v3"
    attention = (*MLA_TARGETS, "o_proj") if deepseek else ATTENTION_TARGETS
    feed_forward = (*MLP_TARGETS, "experts") if deepseek else MLP_TARGETS
    targets = (*(attention if attn else ()), *(feed_forward if mlp else ()), *(("lm_head",) if unembed else ()))
    if not targets:
        raise ServeError("lora_config: expected at least one of train_attn, train_mlp, train_unembed")
    return targets


def slot_targets(model) -> tuple[str, ...]:
    """Every target the adapter slots of a service on `model` (a ModelConfig) hold."""
    return serve_targets(model.model_type)


def _check_tokens(info: BaseInfo, what: str, tokens: np.ndarray, *, sampled: bool = False) -> None:
    if tokens.ndim != 1 or len(tokens) == 0:
        raise ServeError(f"{what}: expected a non-empty list of token ids, found shape {tokens.shape}")
    limit, key = (info.sample_tokens(), "max_sample_tokens") if sampled else (info.max_seq_len, "max_seq_len")
    if len(tokens) > limit:
        raise ServeError(f"{what}: {len(tokens)} tokens exceed serve.{key} ({limit})")
    bad = tokens[(tokens < 0) | (tokens >= info.vocab_size)]
    if bad.size:
        raise ServeError(f"{what}: token ids must be in [0, {info.vocab_size}), found {bad[:5].tolist()}")


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
            _check_tokens(info, f"data[{i}].loss_fn_inputs.target_tokens", value)
        elif not np.all(np.isfinite(value)):
            raise ServeError(f"data[{i}].loss_fn_inputs.{key}: expected finite numbers, found NaN or inf")


def _check_sample(info: BaseInfo, work: Sample) -> None:
    _check_tokens(info, "prompt", work.prompt, sampled=True)
    if work.num_samples < 1:
        raise ServeError(f"num_samples: expected a positive integer, found {work.num_samples}")
    if work.max_tokens < 1:
        raise ServeError(f"sampling_params.max_tokens: expected a positive integer, found {work.max_tokens}")
    if len(work.prompt) + work.max_tokens > info.sample_tokens():
        raise ServeError(f"sampling_params.max_tokens: the prompt's {len(work.prompt)} tokens and "
                         f"{work.max_tokens} new ones exceed serve.max_sample_tokens ({info.sample_tokens()})")
    if not work.temperature >= 0:
        raise ServeError(f"sampling_params.temperature: expected a number >= 0, found {work.temperature}")
    if not 0 < work.top_p <= 1:
        raise ServeError(f"sampling_params.top_p: expected a number in (0, 1], found {work.top_p}")
    if work.top_k < -1:
        raise ServeError(f"sampling_params.top_k: expected -1 (all) or a positive integer, found {work.top_k}")
    bad = [t for t in work.stop_tokens if not 0 <= t < info.vocab_size]
    if bad:
        raise ServeError(f"sampling_params.stop: token ids must be in [0, {info.vocab_size}), found {bad}")
