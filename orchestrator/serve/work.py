"""What the service's front end asks of its engine: work items, their results, and the backend
interface between them.

The front end (HTTP, sessions, futures) turns each SDK request into one work item; the backend
checks it at once (`check`: a bad request is a `ServeError`, a 4xx, before anything runs) and runs
ordered lists of them as engine steps (`run`). Items are plain picklable values, since the driver
sends each step to every host's worker.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np


class ServeError(Exception):
    """A request the service refuses: `status` is the HTTP status (4xx), the message is what the client shows."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


class EngineLost(ServeError):
    """The engine's processes were lost during a step (503): nothing of the step is known to have
    run, and the adapters come back from their saves on the engine that replaces it."""

    def __init__(self, message: str):
        super().__init__(message, status=503)


class EngineRestarted(Exception):
    """`Backend.run` ran nothing: another engine (with empty slots) took over since `generation`."""


@dataclass(frozen=True)
class BaseInfo:
    """The base model the service holds."""

    base_model: str  # the name clients pass as `base_model`
    tokenizer_id: str  # what `transformers.AutoTokenizer.from_pretrained` loads (an HF id or a directory)
    model_type: str  # "llama", "qwen3", "deepseek_v3"
    vocab_size: int
    max_seq_len: int  # the longest training row
    max_rank: int
    max_adapters: int
    eos_token_ids: tuple[int, ...] = ()  # where sampling stops when the client names no stop tokens
    max_sample_tokens: int = 0  # the longest sampled sequence, prompt plus new tokens (0: max_seq_len)
    max_live_adapters: int = 0  # how many adapters may be alive, paged beyond the slots (0: max_adapters)

    def live_adapters(self) -> int:
        return self.max_live_adapters or self.max_adapters

    def sample_tokens(self) -> int:
        return self.max_sample_tokens or self.max_seq_len


@dataclass(frozen=True)
class Datum:
    """One training row: `tokens` (T,) int64 model input and `inputs`, the loss's per-token inputs
    (`target_tokens` int64, `weights`, `logprobs`, `advantages` float32), each (T,)."""

    tokens: np.ndarray
    inputs: dict[str, np.ndarray]


@dataclass(frozen=True)
class Create:
    """A new adapter in a free slot, initialised as PEFT does from `seed`."""

    model_id: str
    rank: int
    targets: tuple[str, ...]  # HF module names (`models.lora.TARGETS`)
    seed: int = 0


@dataclass(frozen=True)
class ForwardBackward:
    """Logprobs and the loss of `data` under the adapter; with `backward`, its gradient is added to
    the adapter's pending gradient (applied by the next `OptimStep`)."""

    model_id: str
    data: tuple[Datum, ...]
    loss_fn: str
    loss_fn_config: dict[str, float] | None = None
    backward: bool = True


# Tinker's AdamParams: what an `OptimStep` carries.
ADAM_KEYS = ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm")


@dataclass(frozen=True)
class OptimStep:
    """One Adam step of the adapter on its pending gradient: `adam` holds learning_rate, beta1,
    beta2, eps, weight_decay and grad_clip_norm (Tinker's `AdamParams`)."""

    model_id: str
    adam: dict[str, float]


@dataclass(frozen=True)
class Sample:
    """`num_samples` continuations of `prompt` under the adapter (`model_id` None: the base model)."""

    model_id: str | None
    prompt: np.ndarray  # (P,) int64
    num_samples: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_tokens: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()  # cut by the front end from the sampled tokens' text
    # The stop strings' own token ids: a row that samples one of them stops there (the front end's
    # cut still decides where the text first holds a string).
    stop_sequences: tuple[tuple[int, ...], ...] = ()
    seed: int | None = None
    prompt_logprobs: bool = False

    def all_stops(self) -> list[tuple[int, ...]]:
        """The stop tokens (each a sequence of one) and the stop strings' token sequences."""
        return [(token,) for token in self.stop_tokens] + [tuple(q) for q in self.stop_sequences]


@dataclass(frozen=True)
class Save:
    """The adapter saved under the directory `path`: with `optimizer`, its whole training state
    (`save_state`); without, its weights as a PEFT adapter (`save_weights_for_sampler`)."""

    model_id: str
    path: str
    optimizer: bool


@dataclass(frozen=True)
class Load:
    """The state saved at `path` loaded into the adapter `model_id` (a new slot when it has none,
    with the saved rank and targets); with `optimizer`, its Adam state too."""

    model_id: str
    path: str
    optimizer: bool


@dataclass(frozen=True)
class Unload:
    """The adapter's slot freed."""

    model_id: str


Work = Create | ForwardBackward | OptimStep | Sample | Save | Load | Unload


@dataclass(frozen=True)
class ForwardBackwardResult:
    """Per datum, `logprobs` and `elementwise_loss` (T,) float32; `metrics` as Tinker names them
    (`loss:sum`)."""

    outputs: tuple[dict[str, np.ndarray], ...]
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class SampledSequence:
    tokens: np.ndarray  # (n,) int32
    logprobs: np.ndarray  # (n,) float32
    stop_reason: str  # "stop" or "length"


@dataclass(frozen=True)
class SampleResult:
    sequences: tuple[SampledSequence, ...]
    prompt_logprobs: np.ndarray | None = None  # (P,) float32, NaN at position 0


@dataclass(frozen=True)
class OptimStepResult:
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class LoadResult:
    rank: int
    targets: tuple[str, ...]
    steps: int = 0  # the optimizer steps the saved adapter had taken


class Backend(Protocol):
    """The engine as the front end sees it: one base model, many adapter slots."""

    def info(self) -> BaseInfo: ...

    def generation(self) -> int:
        """Which engine runs the steps: a new number each time a new engine (every slot empty)
        takes over, as after its processes were lost and restarted."""

    def check(self, work: Work) -> None:
        """Raises `ServeError` for an item the engine would refuse; cheap, runs nothing."""

    def run(self, works: list[Work], generation: int | None = None) -> list[object]:
        """Runs `works` in order as one or more engine steps; per item, its result or the
        `ServeError` that refused it (one item's error never affects another's). Raises
        `EngineLost` when the engine died during the step, and, given the `generation` the works
        were planned for, `EngineRestarted` (running nothing) when another engine has taken over."""
