"""What the tinker SDK sends and accepts: its JSON request bodies, and the protobuf messages it
insists on for `forward_backward` requests and for forward-backward and sampling results.

The SDK (0.38) always sends `forward_backward` as `application/x-protobuf` and refuses a JSON
`ForwardBackwardOutput` or `SampleResponse`, so those three use the SDK's own schema
(`tinker.proto.tinker_public_pb2`, `schema`); everything else is JSON.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict

from podtrain.orchestrator.serve.work import ForwardBackwardResult, SampleResult, ServeError

PROTOBUF = "application/x-protobuf"
JSON = "application/json"


class Body(BaseModel):
    """A request body: unknown fields are ignored, as the SDK adds fields across versions."""

    model_config = ConfigDict(extra="ignore", protected_namespaces=())


class CreateSessionBody(Body):
    user_metadata: dict[str, Any] | None = None


class SessionBody(Body):
    session_id: str


class LoraBody(Body):
    rank: int
    seed: int | None = None
    train_mlp: bool = True
    train_attn: bool = True
    train_unembed: bool = True


class CreateModelBody(Body):
    session_id: str
    model_seq_id: int
    base_model: str
    user_metadata: dict[str, Any] | None = None
    lora_config: LoraBody | None = None
    optimizer_config: dict[str, Any] | None = None


class ModelBody(Body):
    model_id: str


class OptimStepBody(Body):
    model_id: str
    seq_id: int | None = None
    adam_params: dict[str, Any] | None = None
    optimizer_params: dict[str, Any] | None = None


class SaveWeightsBody(Body):
    model_id: str
    path: str | None = None
    seq_id: int | None = None
    overwrite: bool = False


class SaveForSamplerBody(Body):
    model_id: str
    path: str | None = None
    seq_id: int | None = None
    sampling_session_seq_id: int | None = None
    kind: str = "snapshot"


class LoadWeightsBody(Body):
    model_id: str | None = None
    seq_id: int | None = None
    session_id: str | None = None
    model_seq_id: int | None = None
    base_model: str | None = None
    user_metadata: dict[str, Any] | None = None
    path: str
    optimizer: bool
    optimizer_config: dict[str, Any] | None = None


class CreateSamplingSessionBody(Body):
    session_id: str
    sampling_session_seq_id: int
    base_model: str | None = None
    model_path: str | None = None


class PromptBody(Body):
    chunks: list[dict[str, Any]]


class SampleBody(Body):
    num_samples: int = 1
    prompt: PromptBody
    sampling_params: dict[str, Any]
    base_model: str | None = None
    model_path: str | None = None
    sampling_session_id: str | None = None
    seq_id: int | None = None
    prompt_logprobs: bool | None = None
    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0
    target_prompt_logprobs: dict[str, Any] | None = None
    prompt_alt_tokens_k: int = 0
    prompt_logprobs_last_n: int | None = None
    record_stability_info: bool | None = None


class RetrieveBody(Body):
    request_id: str


class WeightsInfoBody(Body):
    tinker_path: str


@dataclass(frozen=True)
class WireDatum:
    """One datum as sent: the kind of each model-input chunk, the tokens of its text chunks, and
    its loss inputs as arrays."""

    chunk_kinds: tuple[str, ...]
    tokens: np.ndarray
    inputs: dict[str, np.ndarray]


@dataclass(frozen=True)
class WireForwardBackward:
    model_id: str
    seq_id: int
    loss_fn: str
    loss_fn_config: dict[str, float | str]
    forward_only: bool
    data: tuple[WireDatum, ...]


def schema():
    """The SDK's protobuf module (importing it imports the whole SDK: seconds, so the service
    imports it when it starts rather than at its first request)."""
    from tinker.proto import tinker_public_pb2

    return tinker_public_pb2


def decode_forward_backward(body: bytes) -> WireForwardBackward:
    """The SDK's protobuf `ForwardBackwardRequest`."""
    pb = schema()
    message = pb.ForwardBackwardRequest()
    try:
        message.ParseFromString(body)
    except Exception as error:
        raise ServeError(f"forward_backward: body is not a protobuf ForwardBackwardRequest ({error})") from error
    config: dict[str, float | str] = dict(message.loss_fn_config)
    for key, value in message.loss_fn_config_v2.items():
        config[key] = value.text if value.WhichOneof("value") == "text" else value.number
    data = tuple(_datum(pb, index, datum) for index, datum in enumerate(message.data))
    return WireForwardBackward(message.model_id, message.seq_id, message.loss_fn, config, message.forward_only, data)


def _buffer(where: str, data: bytes, dtype) -> np.ndarray:
    """`data` as an array of `dtype`; a ServeError naming the field when its length is not a
    whole number of elements."""
    dtype = np.dtype(dtype)
    if len(data) % dtype.itemsize:
        raise ServeError(f"{where}: {len(data)} bytes are not a whole number of {dtype.name} values "
                         f"({dtype.itemsize} bytes each)")
    return np.frombuffer(data, dtype)


def _datum(pb, index: int, datum) -> WireDatum:
    kinds = tuple(chunk.WhichOneof("chunk") or "empty" for chunk in datum.model_input)
    texts = [_buffer(f"data[{index}].model_input.chunks[{i}].tokens", chunk.encoded_text.tokens, np.int32)
             for i, chunk in enumerate(datum.model_input) if chunk.WhichOneof("chunk") == "encoded_text"]
    tokens = np.concatenate(texts) if texts else np.zeros((0,), np.int32)
    inputs = {name: _tensor(pb, f"data[{index}].loss_fn_inputs['{name}']", tensor)
              for name, tensor in datum.loss_fn_inputs.items()}
    return WireDatum(kinds, tokens, inputs)


def _tensor(pb, where: str, tensor) -> np.ndarray:
    dtypes = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}
    if tensor.dtype not in dtypes:
        raise ServeError(f"{where}: expected a float32 or int64 tensor, found dtype {pb.DType.Name(tensor.dtype)}")
    dtype = np.dtype(dtypes[tensor.dtype])
    shape = tuple(tensor.shape)
    if tensor.WhichOneof("encoding") == "sparse_csr":
        return _dense_from_csr(where, tensor.sparse_csr, dtype, shape)
    values = _buffer(where, tensor.dense, dtype)
    if shape and int(np.prod(shape)) != values.size:
        raise ServeError(f"{where}: shape {list(shape)} does not match its {values.size} values")
    return values.reshape(shape) if shape else values


def _dense_from_csr(where: str, csr, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    if len(shape) != 2:
        raise ServeError(f"{where}: a sparse tensor needs a 2-D shape, found {list(shape)}")
    values = _buffer(f"{where}.values", csr.values, dtype)
    rows = _buffer(f"{where}.crow_indices", csr.crow_indices, np.int64)
    cols = _buffer(f"{where}.col_indices", csr.col_indices, np.int64)
    # Row pointers from 0 to the number of values, never decreasing; columns within the shape.
    if (len(rows) != shape[0] + 1 or len(cols) != len(values) or rows[0] != 0 or rows[-1] != len(values)
            or (np.diff(rows) < 0).any() or (len(cols) and (cols.min() < 0 or cols.max() >= shape[1]))):
        raise ServeError(f"{where}: sparse indices do not fit shape {list(shape)} (row pointers from 0 to the "
                         f"{len(values)} values, never decreasing; columns in [0, {shape[1]}))")
    dense = np.zeros(shape, dtype)
    dense[np.repeat(np.arange(shape[0]), np.diff(rows)), cols] = values
    return dense


def encode_forward_backward(result: ForwardBackwardResult) -> bytes:
    """`ForwardBackwardOutput`: one `ArrayRecord` whose fields batch every datum's arrays."""
    pb = schema()
    message = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    for key, value in result.metrics.items():
        message.metrics[key] = float(value)
    record = message.loss_fn_outputs.add(num_datums=len(result.outputs))
    for name in result.outputs[0] if result.outputs else ():
        arrays = [np.asarray(output[name]) for output in result.outputs]
        integer = np.issubdtype(arrays[0].dtype, np.integer)
        arrays = [array.astype(np.int64 if integer else np.float32).ravel() for array in arrays]
        offsets = np.cumsum([0] + [array.nbytes for array in arrays]).astype(np.int64)
        record.fields[name].CopyFrom(pb.BatchedTensor(
            data=b"".join(array.tobytes() for array in arrays), offsets=offsets.tobytes(),
            dtype=pb.DTYPE_INT64 if integer else pb.DTYPE_FLOAT32))
    return message.SerializeToString()


def encode_sample(result: SampleResult, prompt_logprobs: np.ndarray | None) -> bytes:
    """`SampleResponse`; `prompt_logprobs` as the client asked for them (None: not asked)."""
    pb = schema()
    message = pb.SampleResponse()
    stop_reasons = {"stop": pb.STOP_REASON_STOP, "length": pb.STOP_REASON_LENGTH}
    for sequence in result.sequences:
        message.sequences.add(stop_reason=stop_reasons[sequence.stop_reason],
                              tokens=np.asarray(sequence.tokens, np.int32).tobytes(),
                              logprobs=np.asarray(sequence.logprobs, np.float32).tobytes())
    if prompt_logprobs is not None:
        message.prompt_logprobs = np.asarray(prompt_logprobs, np.float32).tobytes()
    return message.SerializeToString()
