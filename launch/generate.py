"""`podtrain generate -c <preset> checkpoint=<dir> prompt=<text> [...]`: continue prompts with a model.

`checkpoint=` is a podtrain run, checkpoint or step directory or a Hugging Face directory (see
`orchestrator.load`). `prompt=` may be repeated and `prompts_file=` adds one prompt per line: all go
through one batched `models.generate.generate` call, BOS first when `data.add_bos` says so or, for
an HF directory, when its tokenizer.json puts BOS first (as Llama 3's does) or its
tokenizer_config.json's `add_bos_token` is true. Generation stops at the EOS ids unless
`stop=<id,id>` names others (`stop=` alone: none); greedy unless `temperature=` > 0.
`layer_weights=stacked` keeps decode from making per-layer copies of the weights on CPU;
`cache_reads=filled|all|kernel` says how decode steps read the cache and
`decode_matmuls=xla|kernel` how they multiply by the weights (default `auto` for both: see
`models.generate.generate`).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import jax

from podtrain.models.generate import (
    CACHE_READS_CHOICES,
    DECODE_MATMULS,
    LAYER_WEIGHTS,
    Sampling,
    check_kernel_matmuls,
    check_kernel_reads,
    generate,
)
from podtrain.orchestrator.config import ConfigError, load_config, override_keys
from podtrain.orchestrator.load import load_checkpoint_tokenizer, load_model
from podtrain.orchestrator.tokenizers import check_vocab
from podtrain.sharding.rules import use_rules

USAGE = ("podtrain generate -c <preset> checkpoint=<dir> prompt=<text> [prompt=...] [prompts_file=<path>] "
         "[max_new_tokens=N] [temperature=T] [top_k=K] [top_p=P] [seed=S] [stop=<id,id>] [step=N] "
         "[layer_weights=auto|split|stacked] [cache_reads=auto|filled|all|kernel] [decode_matmuls=auto|xla|kernel]")
# key -> (parse, valid, what it expects); `prompt` may be given more than once.
NUMBERS = {
    "max_new_tokens": (int, lambda v: v >= 1, "a positive integer"),
    "temperature": (float, lambda v: v >= 0, "a number >= 0 (0 = greedy)"),
    "top_k": (int, lambda v: v >= 0, "an integer >= 0 (0 = all tokens)"),
    "top_p": (float, lambda v: 0 < v <= 1, "a number in (0, 1]"),
    "seed": (int, lambda v: True, "an integer"),
    "step": (int, lambda v: v >= 0, "a non-negative integer"),
}
# key -> the values it takes (its default first)
CHOICES = {"layer_weights": LAYER_WEIGHTS, "cache_reads": CACHE_READS_CHOICES, "decode_matmuls": DECODE_MATMULS}
GENERATE_KEYS = {"checkpoint", "prompt", "prompts_file", "stop", *CHOICES, *NUMBERS}


@dataclasses.dataclass(frozen=True)
class Request:
    """What `podtrain generate` was asked, apart from the config."""

    checkpoint: str
    prompts: list[str]
    step: int | None = None
    max_new_tokens: int = 64
    sampling: Sampling = Sampling()
    seed: int = 0
    stop: tuple[int, ...] | None = None
    layer_weights: str = "auto"
    cache_reads: str = "auto"
    decode_matmuls: str = "auto"


def _parse(key: str, raw: str):
    parse, valid, expected = NUMBERS[key]
    try:
        value = parse(raw)
    except ValueError:
        value = None
    if value is None or not valid(value):
        raise ConfigError(f"{key}= expects {expected}, found {raw!r}")
    return value


def split_generate_args(overrides: list[str]) -> tuple[Request, list[str]]:
    """Takes the generate keys out of the overrides (the rest are config overrides) and checks them."""
    found, prompts, rest = {}, [], []
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or key not in GENERATE_KEYS:
            rest.append(item)
        elif key == "prompt":
            prompts.append(value)
        elif key in found:
            raise ConfigError(f"{key}= given twice ({found[key]!r} and {value!r})")
        else:
            found[key] = value
    if "prompts_file" in found:
        path = Path(found["prompts_file"]).expanduser()
        if not path.is_file():
            raise ConfigError(f"prompts_file={found['prompts_file']}: no such file")
        prompts += [line for line in path.read_text().splitlines() if line.strip()]
    if not found.get("checkpoint"):
        raise ConfigError(f"checkpoint= expects a run, checkpoint or Hugging Face directory, found none; "
                          f"usage: {USAGE}")
    if not prompts or "" in prompts:
        raise ConfigError(f"prompt= expects a non-empty prompt (or give prompts_file=<path>), found "
                          f"{'an empty one' if prompts else 'none'}; usage: {USAGE}")
    numbers = {key: _parse(key, found[key]) for key in NUMBERS if key in found}
    sampling = Sampling(**{k: numbers.pop(k) for k in ("temperature", "top_k", "top_p") if k in numbers})
    stop = None
    if "stop" in found:
        ids = [part.strip() for part in found["stop"].split(",") if part.strip()]
        if not all(part.isdigit() for part in ids):
            raise ConfigError(f"stop= expects comma-separated token ids (e.g. stop=2,7), found {found['stop']!r}")
        stop = tuple(int(part) for part in ids)
    choices = {key: found.get(key, values[0]) for key, values in CHOICES.items()}
    for key, value in choices.items():
        if value not in CHOICES[key]:
            raise ConfigError(f"{key}= expects one of {', '.join(CHOICES[key])}, found {value!r}")
    return Request(found["checkpoint"], prompts, sampling=sampling, stop=stop, **choices, **numbers), rest


def run_command(args) -> int:
    request, overrides = split_generate_args(args.overrides)
    config = load_config(args.config, overrides, hint_keys=GENERATE_KEYS)
    tokenizer, stop, add_bos = load_checkpoint_tokenizer(config, request.checkpoint)
    model_keys = [key.removeprefix("model.") for key in override_keys(overrides) if key.startswith("model.")]
    model, mesh, vocab_size = load_model(config, request.checkpoint, request.step, model_keys)
    try:
        check_vocab(tokenizer, vocab_size)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    stop = stop if request.stop is None else request.stop
    if any(t >= vocab_size for t in stop):
        raise ConfigError(f"stop={','.join(map(str, stop))}: token ids must be below the vocabulary size {vocab_size}")
    prompts = [[tokenizer.bos_id] * add_bos + tokenizer.encode(text).tolist() for text in request.prompts]
    empty = [text for text, ids in zip(request.prompts, prompts, strict=True) if not ids]
    if empty:
        raise ConfigError(f"prompt={empty[0]!r}: expected text that tokenises to at least one token, found none")
    start = time.perf_counter()
    checks = {"cache_reads": check_kernel_reads, "decode_matmuls": check_kernel_matmuls}
    for key, check in checks.items():
        if getattr(request, key) == "kernel":
            try:
                check(model)
            except ValueError as e:
                raise ConfigError(str(e)) from None
    with jax.set_mesh(mesh), use_rules(config.sharding.rules):
        outputs = generate(model, prompts, max_new_tokens=request.max_new_tokens, sampling=request.sampling,
                           stop_tokens=stop, pad_id=tokenizer.pad_id, seed=request.seed,
                           layer_weights=request.layer_weights, cache_reads=request.cache_reads,
                           decode_matmuls=request.decode_matmuls)
    seconds = time.perf_counter() - start
    for i, (text, tokens) in enumerate(zip(request.prompts, outputs, strict=True), 1):
        ended = "stopped" if tokens and tokens[-1] in stop else "max_new_tokens"
        print(f"--- prompt {i} ---\n{text}\n--- completion {i} ({len(tokens)} tokens, {ended}) ---\n"
              f"{tokenizer.decode(tokens)}")
    total = sum(map(len, outputs))
    print(f"generated {total} tokens for {len(outputs)} prompt{'s' * (len(outputs) != 1)} in {seconds:.2f} s: "
          f"{total / seconds:,.1f} tokens/s (compilation included)")
    return 0
