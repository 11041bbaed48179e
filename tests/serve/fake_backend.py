"""A pure-NumPy stand-in for the engine, to test the HTTP front end: a test double, not a model.

Its "model": the logits after token `x` are a fixed random table row `table[x]` plus the
adapter's bias vector `w` (one value per vocabulary entry). A new adapter has `w = 0`, so it
starts as the base does (as PEFT's zero-initialised B makes it), and training moves `w`:
cross-entropy falls as forward-backward and Adam steps alternate. The RL losses all use the
importance-sampling surrogate `-exp(lp - q) * A`. Save and Load write and read `adapter.npz`;
sampling is deterministic for a given seed.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from podtrain.orchestrator.serve.checks import check_work, serve_targets
from podtrain.orchestrator.serve.work import (
    BaseInfo,
    Create,
    Datum,
    EngineLost,
    EngineRestarted,
    ForwardBackward,
    ForwardBackwardResult,
    Load,
    LoadResult,
    OptimStep,
    OptimStepResult,
    Sample,
    SampledSequence,
    SampleResult,
    Save,
    ServeError,
    Unload,
    Work,
)

# Every target a client may choose on a llama model with its own LM head.
TARGETS = serve_targets("llama")


@dataclass
class _Adapter:
    rank: int
    targets: tuple[str, ...]
    w: np.ndarray
    grad: np.ndarray = field(init=False)
    m: np.ndarray = field(init=False)
    v: np.ndarray = field(init=False)
    steps: int = 0

    def __post_init__(self):
        self.grad, self.m, self.v = np.zeros_like(self.w), np.zeros_like(self.w), np.zeros_like(self.w)


class FakeBackend:
    """The `Backend` protocol over NumPy; `calls` records each `run`'s works, `running` (set by
    default) holds runs while cleared, `lose_next_run` makes the next run lose its engine, and
    every run holding a work `poisons` matches loses it too (a request that kills the workers)."""

    def __init__(self, info: BaseInfo):
        self._info = info
        self.table = np.random.default_rng(0).normal(size=(info.vocab_size, info.vocab_size)).astype(np.float32)
        self.adapters: dict[str, _Adapter] = {}
        self.calls: list[list[Work]] = []
        self.engines = 0
        self.lose_next_run: str | None = None  # the next run dies with EngineLost(this), its engine with it
        self.poisons = None  # Callable[[Work], bool]: a run holding such a work loses its engine
        self.running = threading.Event()
        self.running.set()

    def info(self) -> BaseInfo:
        return self._info

    def generation(self) -> int:
        return self.engines

    def restart(self) -> None:
        """A new engine takes over: every adapter is gone (as when the workers are lost)."""
        self.adapters.clear()
        self.engines += 1

    def check(self, work: Work) -> None:
        check_work(self._info, TARGETS, work)
        if isinstance(work, Create):
            if work.model_id in self.adapters:
                raise ServeError(f"model {work.model_id!r} already has an adapter")
        elif isinstance(work, Load) and not (Path(work.path) / "adapter.npz").exists():
            raise ServeError(f"path: no saved adapter in {work.path}")

    def run(self, works: list[Work], generation: int | None = None) -> list[object]:
        self.running.wait()
        if generation is not None and generation != self.engines:
            raise EngineRestarted()
        if self.lose_next_run is not None:
            why, self.lose_next_run = self.lose_next_run, None
            self.restart()
            raise EngineLost(why)
        self.calls.append(list(works))
        if self.poisons is not None and any(self.poisons(work) for work in works):
            self.restart()
            raise EngineLost("the engine's workers were lost during this step (rank 1: killed by SIGSEGV)")
        results: list[object] = []
        for work in works:
            try:
                results.append(getattr(self, f"_{type(work).__name__.lower()}")(work))
            except ServeError as error:
                results.append(error)
        return results

    def _need_room(self) -> None:
        if len(self.adapters) >= self._info.max_adapters:
            raise ServeError(f"all {self._info.max_adapters} adapter slots are taken")

    def _adapter(self, model_id: str | None) -> _Adapter:
        if model_id not in self.adapters:
            raise ServeError(f"model_id: no adapter {model_id!r}", 404)
        return self.adapters[model_id]

    def _logprobs(self, tokens: np.ndarray, w: np.ndarray) -> np.ndarray:
        logits = self.table[tokens] + w
        return logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)

    def _create(self, work: Create) -> None:
        self.check(work)
        self._need_room()  # as the engine: a free slot is found when the step runs
        self.adapters[work.model_id] = _Adapter(work.rank, work.targets, np.zeros(self._info.vocab_size, np.float32))

    def _forwardbackward(self, work: ForwardBackward) -> ForwardBackwardResult:
        adapter = self._adapter(work.model_id)
        outputs, total = [], 0.0
        for datum in work.data:
            logprobs, loss, grad = self._datum(datum, work.loss_fn, adapter.w)
            outputs.append({"logprobs": logprobs, "elementwise_loss": loss})
            total += float(loss.sum())
            if work.backward:
                adapter.grad += grad
        return ForwardBackwardResult(outputs=tuple(outputs), metrics={"loss:sum": total})

    def _datum(self, datum: Datum, loss_fn: str, w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per token: target logprob and loss; and the loss's gradient in `w`."""
        all_logprobs = self._logprobs(datum.tokens, w)
        targets = datum.inputs["target_tokens"]
        logprobs = all_logprobs[np.arange(len(targets)), targets]
        d_logprob_d_w = -np.exp(all_logprobs)
        d_logprob_d_w[np.arange(len(targets)), targets] += 1
        weights = datum.inputs.get("weights", np.ones_like(logprobs))
        if loss_fn == "cross_entropy":
            d_loss_d_logprob = -weights
        else:
            d_loss_d_logprob = -np.exp(logprobs - datum.inputs["logprobs"]) * datum.inputs["advantages"] * weights
        loss = -weights * logprobs if loss_fn == "cross_entropy" else d_loss_d_logprob
        return logprobs.astype(np.float32), loss.astype(np.float32), d_loss_d_logprob @ d_logprob_d_w

    def _optimstep(self, work: OptimStep) -> OptimStepResult:
        adapter, adam = self._adapter(work.model_id), work.adam
        grad, adapter.grad = adapter.grad, np.zeros_like(adapter.grad)
        norm = float(np.linalg.norm(grad))
        if adam["grad_clip_norm"] > 0 and norm > adam["grad_clip_norm"]:
            grad = grad * adam["grad_clip_norm"] / norm
        adapter.steps += 1
        adapter.m = adam["beta1"] * adapter.m + (1 - adam["beta1"]) * grad
        adapter.v = adam["beta2"] * adapter.v + (1 - adam["beta2"]) * grad**2
        m_hat = adapter.m / (1 - adam["beta1"] ** adapter.steps)
        v_hat = adapter.v / (1 - adam["beta2"] ** adapter.steps)
        update = m_hat / (np.sqrt(v_hat) + adam["eps"]) + adam["weight_decay"] * adapter.w
        adapter.w = (adapter.w - adam["learning_rate"] * update).astype(np.float32)
        return OptimStepResult(metrics={"grad_norm:max": norm})

    def _save(self, work: Save) -> None:
        adapter = self._adapter(work.model_id)
        Path(work.path).mkdir(parents=True, exist_ok=True)
        state = {"w": adapter.w, "rank": adapter.rank, "targets": np.array(adapter.targets)}
        if work.optimizer:
            state |= {"m": adapter.m, "v": adapter.v, "steps": adapter.steps}
        np.savez(Path(work.path) / "adapter.npz", **state)

    def _load(self, work: Load) -> LoadResult:
        self.check(work)
        saved = np.load(Path(work.path) / "adapter.npz")
        if work.optimizer and "m" not in saved:
            raise ServeError(f"path: {work.path} holds no optimizer state")
        if work.model_id not in self.adapters:
            self._need_room()
        adapter = _Adapter(int(saved["rank"]), tuple(str(t) for t in saved["targets"]), saved["w"].copy())
        if work.optimizer:
            adapter.m, adapter.v, adapter.steps = saved["m"].copy(), saved["v"].copy(), int(saved["steps"])
        self.adapters[work.model_id] = adapter
        return LoadResult(rank=adapter.rank, targets=adapter.targets, steps=adapter.steps)

    def _unload(self, work: Unload) -> None:
        self._adapter(work.model_id)
        del self.adapters[work.model_id]

    def _sample(self, work: Sample) -> SampleResult:
        w = np.zeros(self._info.vocab_size, np.float32) if work.model_id is None else self._adapter(work.model_id).w
        rng = np.random.default_rng(work.seed)
        sequences = tuple(self._sequence(work, w, rng) for _ in range(work.num_samples))
        prompt_logprobs = None
        if work.prompt_logprobs:
            scored = self._logprobs(work.prompt[:-1], w)[np.arange(len(work.prompt) - 1), work.prompt[1:]]
            prompt_logprobs = np.concatenate([[np.nan], scored]).astype(np.float32)
        return SampleResult(sequences=sequences, prompt_logprobs=prompt_logprobs)

    def _sequence(self, work: Sample, w: np.ndarray, rng: np.random.Generator) -> SampledSequence:
        tokens, logprobs, last = [], [], int(work.prompt[-1])
        for _ in range(work.max_tokens):
            logprob = self._logprobs(np.array([last]), w)[0]
            if work.temperature == 0:
                token = int(np.argmax(logprob))
            else:
                probs = np.exp(logprob / work.temperature)
                token = int(rng.choice(len(probs), p=probs / probs.sum()))
            tokens.append(token)
            logprobs.append(logprob[token])
            if token in work.stop_tokens:
                return SampledSequence(np.array(tokens, np.int32), np.array(logprobs, np.float32), "stop")
            last = token
        return SampledSequence(np.array(tokens, np.int32), np.array(logprobs, np.float32), "length")
