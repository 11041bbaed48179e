"""SDK requests turned into work items.

Only the request's shape is judged here: options and inputs the service does not offer, values of
the wrong type, what a work item cannot carry (the optimizer's type, the base model's name, a
checkpoint's name). Every value a work item carries is checked in one place, `checks.check_work`,
which the front end runs before it queues the item (`Backend.check`). Token ids stay int64 until
the engine packs them, so none wraps into the vocabulary before it is checked.
"""

from __future__ import annotations

import dataclasses
import re
import secrets
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from podtrain.orchestrator.serve.checks import serve_targets
from podtrain.orchestrator.serve.wire import LoraBody, SampleBody, WireDatum, WireForwardBackward
from podtrain.orchestrator.serve.work import (
    ADAM_KEYS,
    BaseInfo,
    Create,
    Datum,
    ForwardBackward,
    Sample,
    SampledSequence,
    SampleResult,
    ServeError,
)

Decode = Callable[[Sequence[int]], str]  # token ids to text, special tokens kept
Encode = Callable[[str], Sequence[int]]  # text to token ids, no special tokens added

ADAM_DEFAULTS = {"learning_rate": 1e-4, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0,
                 "grad_clip_norm": 0.0}
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def not_supported(what: str) -> ServeError:
    return ServeError(f"{what} is not supported by podtrain serve")


def lora_targets(info: BaseInfo, lora: LoraBody) -> tuple[str, ...]:
    """The HF module names LoRA adapts for the SDK's train_attn / train_mlp / train_unembed."""
    return serve_targets(info.model_type, attn=lora.train_attn, mlp=lora.train_mlp, unembed=lora.train_unembed)


def create(model_id: str, lora: LoraBody | None, optimizer: Mapping[str, Any] | None, info: BaseInfo) -> Create:
    if lora is None:
        raise not_supported("full fine-tuning (create_model without lora_config)")
    check_optimizer(optimizer)
    seed = lora.seed if lora.seed is not None else secrets.randbelow(2**31)
    return Create(model_id=model_id, rank=lora.rank, targets=lora_targets(info, lora), seed=seed)


def check_optimizer(optimizer: Mapping[str, Any] | None) -> None:
    kind = (optimizer or {}).get("type", "adamw")
    if kind != "adamw":
        raise not_supported(f"optimizer {kind!r} (only adamw)")


def check_base_model(base_model: str | None, info: BaseInfo) -> None:
    if base_model is not None and base_model != info.base_model:
        raise ServeError(f"base_model: this service holds {info.base_model!r}, found {base_model!r}")


def checkpoint_name(name: str | None, field: str) -> str:
    if name is None or not _NAME.fullmatch(name):
        raise ServeError(f"{field}: expected a checkpoint name of letters, digits, '.', '_' or '-', found {name!r}")
    return name


def adam(params: Mapping[str, Any] | None, optimizer_params: Mapping[str, Any] | None) -> dict[str, float]:
    if optimizer_params is not None:
        raise not_supported(f"optimizer {optimizer_params.get('type')!r} (only AdamParams)")
    values = dict(ADAM_DEFAULTS)
    for key, value in (params or {}).items():
        if key not in ADAM_KEYS:
            raise ServeError(f"adam_params: unknown field {key!r}; expected some of {list(ADAM_KEYS)}")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ServeError(f"adam_params.{key}: expected a finite number, found {value!r}")
        values[key] = float(value)
    return values


def forward_backward(request: WireForwardBackward) -> ForwardBackward:
    """The work item of a forward(_backward) request."""
    data = tuple(_datum(index, datum) for index, datum in enumerate(request.data))
    return ForwardBackward(model_id=request.model_id, data=data, loss_fn=request.loss_fn,
                           loss_fn_config=dict(request.loss_fn_config) or None, backward=not request.forward_only)


def _datum(index: int, datum: WireDatum) -> Datum:
    """One datum as int64 tokens and targets and float32 inputs."""
    where = f"data[{index}]"
    other = [kind for kind in datum.chunk_kinds if kind != "encoded_text"]
    if other:
        raise not_supported(f"{where}.model_input: {other[0]} chunks (only encoded text)")
    for name, array in datum.inputs.items():
        field = f"{where}.loss_fn_inputs['{name}']"
        if name == "target_tokens":
            if not np.issubdtype(array.dtype, np.integer):
                raise ServeError(f"{field}: expected int64 token ids, found {array.dtype}")
        elif not np.issubdtype(array.dtype, np.floating):
            raise ServeError(f"{field}: expected float32 values, found {array.dtype}")
        elif not np.isfinite(array).all():
            bad = array[~np.isfinite(array)][0]
            raise ServeError(f"{field}: expected finite numbers, found {bad} at index "
                             f"{int(np.flatnonzero(~np.isfinite(array.ravel()))[0])}")
    inputs = {name: array.astype(np.int64 if name == "target_tokens" else np.float32)
              for name, array in datum.inputs.items()}
    return Datum(tokens=datum.tokens.astype(np.int64), inputs=inputs)


def prompt_tokens(chunks: list[dict[str, Any]]) -> np.ndarray:
    tokens: list[int] = []
    for chunk in chunks:
        kind = chunk.get("type", "encoded_text")
        if kind != "encoded_text":
            raise not_supported(f"prompt: {kind} chunks (only encoded text)")
        values = chunk.get("tokens", [])
        if not all(isinstance(token, int) and not isinstance(token, bool) for token in values):
            raise ServeError("prompt: expected integer token ids")
        tokens += values
    return np.asarray(tokens, np.int64)


def sample(body: SampleBody, info: BaseInfo, decode: Decode | None = None, encode: Encode | None = None) -> Sample:
    """The sample request as a work item of the base model (the scheduler puts in the adapter slot
    of the sampler's weights)."""
    _refuse_unsupported_sampling(body)
    prompt = prompt_tokens(body.prompt.chunks)
    params = body.sampling_params
    max_tokens = _number(params, "max_tokens", Sample.max_tokens, int)
    temperature, top_p = _number(params, "temperature", 1.0, float), _number(params, "top_p", 1.0, float)
    top_k = _number(params, "top_k", -1, int)
    last_n = body.prompt_logprobs_last_n
    if last_n is not None and not (body.prompt_logprobs and 1 <= last_n < len(prompt)):
        raise ServeError(f"prompt_logprobs_last_n: expected 1 to {len(prompt) - 1} with prompt_logprobs, "
                         f"found {last_n}")
    seed = _number(params, "seed", None, int)
    stop_tokens, stop_strings = stops(params.get("stop"), info, decode)
    return Sample(model_id=None, prompt=prompt, num_samples=body.num_samples, max_tokens=max_tokens,
                  temperature=temperature, top_p=top_p, top_k=top_k, stop_tokens=stop_tokens,
                  stop_strings=stop_strings, stop_sequences=string_sequences(stop_strings, info, decode, encode),
                  seed=seed, prompt_logprobs=bool(body.prompt_logprobs))


def _number(params: Mapping[str, Any], key: str, default: float | None, kind: type) -> Any:
    """`params[key]` (its default when absent or None) as an int or a float."""
    value = params.get(key)
    if value is None:
        return default
    integral = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not integral):
        raise ServeError(f"sampling_params.{key}: expected {'an integer' if kind is int else 'a number'}, "
                         f"found {value!r}")
    return kind(value)


def _refuse_unsupported_sampling(body: SampleBody) -> None:
    if body.topk_prompt_logprobs or body.topk_sample_logprobs:
        raise not_supported("top-k logprobs (topk_prompt_logprobs, topk_sample_logprobs)")
    if body.target_prompt_logprobs is not None:
        raise not_supported("target_prompt_logprobs")
    if body.prompt_alt_tokens_k:
        raise not_supported("prompt_alt_tokens_k")
    if body.record_stability_info:
        raise not_supported("record_stability_info")


def stops(stop: Any, info: BaseInfo, decode: Decode | None) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """(stop token ids, stop strings) of the SDK's `stop`: None stops at end of sequence, token ids
    at those, strings (one or a list) where the sampled text first holds one, or at end of sequence."""
    if stop is None:
        return tuple(info.eos_token_ids), ()
    items = [stop] if isinstance(stop, str) else list(stop)
    strings = [item for item in items if isinstance(item, str)]
    if not strings:
        if not all(isinstance(item, int) and not isinstance(item, bool) for item in items):
            raise ServeError(f"sampling_params.stop: expected token ids or strings, found {items!r}")
        return tuple(items), ()
    if len(strings) < len(items):
        raise ServeError(f"sampling_params.stop: expected token ids or strings, found both: {items!r}")
    if decode is None:
        raise not_supported("sampling_params.stop as strings without a tokenizer on the service (serve.tokenizer)")
    return tuple(info.eos_token_ids), tuple(strings)


def string_sequences(strings: tuple[str, ...], info: BaseInfo, decode: Decode | None,
                     encode: Encode | None) -> tuple[tuple[int, ...], ...]:
    """Each stop string's own token ids, where their text holds the string: the engine stops a row
    that samples them, early (a string the model writes with other tokens is still found by
    `cut_at_stop_strings`, in the whole budget's text)."""
    if decode is None or encode is None:
        return ()
    sequences = []
    for string in strings:
        ids = tuple(int(i) for i in encode(string)) if string else ()
        if ids and all(0 <= i < info.vocab_size for i in ids) and string in decode(ids):
            sequences.append(ids)
    return tuple(sequences)


def cut_at_stop_strings(result: SampleResult, strings: tuple[str, ...], decode: Decode) -> SampleResult:
    """Each sequence up to the token whose text completes its first stop string (kept, as a stop
    token is), with stop reason "stop"; sequences whose text holds none as they are."""
    if not strings:
        return result

    def holds(tokens: np.ndarray) -> bool:
        text = decode(tokens)
        return any(s in text for s in strings)

    cut = []
    for seq in result.sequences:
        if not holds(seq.tokens):
            cut.append(seq)
            continue
        shortest, longest = 1, len(seq.tokens)  # the text of a longer prefix holds what a shorter one does
        while shortest < longest:
            middle = (shortest + longest) // 2
            shortest, longest = (shortest, middle) if holds(seq.tokens[:middle]) else (middle + 1, longest)
        cut.append(SampledSequence(seq.tokens[:longest], seq.logprobs[:longest], "stop"))
    return dataclasses.replace(result, sequences=tuple(cut))


def masked_prompt_logprobs(logprobs: np.ndarray | None, last_n: int | None) -> np.ndarray | None:
    """The prompt logprobs with all but the last `last_n` blanked (NaN), as `prompt_logprobs_last_n` asks."""
    if logprobs is None or last_n is None:
        return logprobs
    masked = np.array(logprobs, np.float32)
    masked[: len(masked) - last_n] = np.nan
    return masked
