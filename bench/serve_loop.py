"""A fixed client loop for any Tinker-compatible server, driven through the official `tinker` SDK.

    .venv/bin/python bench/serve_loop.py {train,sample} URL BASE_MODEL [--adapters N] [--steps N]

`run_loop` measures LoRA training throughput: `adapters` training clients each submit one
`forward_backward` (cross-entropy on random tokens) and one `optim_step` per step, all submitted
before any is waited for so the server may batch clients together. The rows of a step are split
among the adapters (at least one each), so adapter counts up to `rows` train the same tokens per
step. The warm-up steps (the first compiles) are timed on their own; tokens/s is at the median of the
timed steps after them.

`sample_loop` measures sampling throughput: the weights of a fresh adapter are saved for sampling,
then rounds of one sample per prompt are submitted at once; the first round is timed on its own.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import time
from collections.abc import Callable

import tinker


def random_datum(rng: random.Random, tokens: int, vocab_size: int) -> tinker.Datum:
    """A next-token cross-entropy datum over `tokens` random token ids, every position weighted 1."""
    ids = [rng.randrange(vocab_size) for _ in range(tokens + 1)]
    return tinker.Datum(
        model_input=tinker.ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * tokens},
    )


def resolved(client_or_future):
    """The client itself: older SDKs return clients where newer ones return futures of them."""
    return client_or_future.result() if hasattr(client_or_future, "result") else client_or_future


def end_session(service: tinker.ServiceClient) -> None:
    """Finishes the SDK session so its heartbeats stop (older SDKs have no `close`).

    A server without the session-finish endpoint answers 404; the SDK still stops its heartbeats.
    """
    if hasattr(service, "close"):
        with contextlib.suppress(tinker.NotFoundError):
            service.close("success").result()


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def spread(seconds: list[float]) -> dict:
    """Median, quartiles and extremes of step times."""
    q = statistics.quantiles(seconds, n=4, method="inclusive") if len(seconds) > 1 else seconds * 3
    return {"median_s": statistics.median(seconds), "p25_s": q[0], "p75_s": q[2], "min_s": min(seconds),
            "max_s": max(seconds)}


def run_loop(
    base_url: str,
    base_model: str,
    *,
    adapters: int,
    steps: int,
    warmup: int = 1,
    rows: int = 8,
    tokens: int = 128,
    rank: int = 8,
    api_key: str = "tml-bench",
    seed: int = 0,
    vocab_size: int = 512,
) -> dict:
    """Trains `adapters` LoRA clients for `warmup` untimed then `steps` timed steps of `rows` x
    `tokens` tokens in all.

    Returns the first (compiling) step's seconds, every warm-up and timed step's seconds, the
    timed steps' median and spread, and tokens/s at the median step and over all timed steps.
    """
    if steps < 1 or warmup < 1:
        raise ValueError(f"steps and warmup must be at least 1, got steps={steps}, warmup={warmup}")
    rng = random.Random(seed)
    rows_per_adapter = max(1, rows // adapters)
    service = tinker.ServiceClient(base_url=base_url, api_key=api_key)
    clients = [resolved(service.create_lora_training_client(base_model=base_model, rank=rank)) for _ in range(adapters)]

    def step(batches: list[list[tinker.Datum]]) -> None:
        pairs = zip(clients, batches, strict=True)
        futures = [client.forward_backward(batch, "cross_entropy") for client, batch in pairs]
        futures += [client.optim_step(tinker.AdamParams(learning_rate=1e-4)) for client in clients]
        for future in futures:
            future.result()

    data = [[[random_datum(rng, tokens, vocab_size) for _ in range(rows_per_adapter)] for _ in clients]
            for _ in range(warmup + steps)]  # fmt: skip
    try:
        step_s = [timed(lambda batches=batches: step(batches)) for batches in data]
    finally:
        end_session(service)
    per_step = adapters * rows_per_adapter * tokens
    timed_s = step_s[warmup:]
    stats = spread(timed_s)
    return {
        "first_step_s": step_s[0],
        "tokens_per_s": per_step / stats["median_s"],
        "tokens_per_s_mean": per_step * steps / sum(timed_s),
        **stats,
        "warmup_s": step_s[:warmup],
        "step_s": timed_s,
        "steps": steps,
        "warmup": warmup,
        "adapters": adapters,
        "rows": adapters * rows_per_adapter,
        "tokens": tokens,
    }


def sample_loop(
    base_url: str,
    base_model: str,
    *,
    prompts: int,
    max_tokens: int,
    prompt_tokens: int = 32,
    rounds: int = 5,
    rank: int = 8,
    api_key: str = "tml-bench",
    seed: int = 0,
    vocab_size: int = 512,
) -> dict:
    """Samples `prompts` random prompts at once, `rounds` times, from a fresh adapter's saved weights.

    Returns the first (compiling) round's seconds, the generated tokens/s of the rounds after it and
    every round's seconds (a server that compiles per batch size shows it there).
    """
    if rounds < 2:
        raise ValueError(f"rounds must be at least 2 (one warm-up, one timed), got {rounds}")
    rng = random.Random(seed)
    service = tinker.ServiceClient(base_url=base_url, api_key=api_key)
    trainer = resolved(service.create_lora_training_client(base_model=base_model, rank=rank))
    sampler = resolved(trainer.save_weights_and_get_sampling_client())
    params = tinker.SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed)
    generated = []

    def sample_round(inputs: list[tinker.ModelInput]) -> None:
        futures = [sampler.sample(prompt, num_samples=1, sampling_params=params) for prompt in inputs]
        generated.append(sum(len(f.result().sequences[0].tokens) for f in futures))

    data = [[tinker.ModelInput.from_ints([rng.randrange(vocab_size) for _ in range(prompt_tokens)])
             for _ in range(prompts)] for _ in range(rounds)]  # fmt: skip
    try:
        round_s = [timed(lambda inputs=inputs: sample_round(inputs)) for inputs in data]
    finally:
        end_session(service)
    return {"first_s": round_s[0], "tokens_per_s": sum(generated[1:]) / sum(round_s[1:]), "round_s": round_s}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["train", "sample"])
    parser.add_argument("base_url")
    parser.add_argument("base_model")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--adapters", type=int, default=1)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    if args.command == "train":
        result = run_loop(
            args.base_url, args.base_model, adapters=args.adapters, steps=args.steps,
            warmup=args.warmup, rows=args.rows, tokens=args.tokens, rank=args.rank,
        )  # fmt: skip
    else:
        result = sample_loop(
            args.base_url, args.base_model, prompts=args.prompts, max_tokens=args.max_tokens,
            rounds=args.rounds, rank=args.rank,
        )  # fmt: skip
    print(json.dumps(result))


if __name__ == "__main__":
    main()
