"""`podtrain generate -c <preset> checkpoint=<dir> prompt=<text> [...]`: continue prompts with a model.

`checkpoint=` is a podtrain run directory, checkpoint directory or step folder (its params are
restored onto the mesh of `-c` and the overrides, as `podtrain export` does: the newest committed
step unless `step=`), or a Hugging Face directory with config.json (then its tokenizer.json, if it
has one, with the EOS and BOS tokens its tokenizer_config.json / config.json name; else the
config's `data.tokenizer`). `prompt=` may be repeated and `prompts_file=` adds one prompt per
line: all prompts go through one batched `models.generate.generate` call, with BOS first when
`data.add_bos` (or an HF tokenizer_config.json's `add_bos_token`) says so. Generation stops at the
EOS ids unless `stop=<id,id>` names others (`stop=` alone: none). Sampling is greedy unless
`temperature=` > 0.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import jax
from flax import nnx
from jax.sharding import Mesh

from launch.export import restore_model
from models import from_hf
from models.generate import Sampling, generate
from orchestrator.config import Config, ConfigError, load_config
from orchestrator.tokenizers import Tokenizer, check_vocab, hf_directory_tokenizer, load_tokenizer
from sharding.mesh import build_mesh, resolve_axis_sizes
from sharding.rules import use_rules

USAGE = ("podtrain generate -c <preset> checkpoint=<dir> prompt=<text> [prompt=...] [prompts_file=<path>] "
         "[max_new_tokens=N] [temperature=T] [top_k=K] [top_p=P] [seed=S] [stop=<id,id>] [step=N]")
# key -> (parse, valid, what it expects); `prompt` may be given more than once.
NUMBERS = {
    "max_new_tokens": (int, lambda v: v >= 1, "a positive integer"),
    "temperature": (float, lambda v: v >= 0, "a number >= 0 (0 = greedy)"),
    "top_k": (int, lambda v: v >= 0, "an integer >= 0 (0 = all tokens)"),
    "top_p": (float, lambda v: 0 < v <= 1, "a number in (0, 1]"),
    "seed": (int, lambda v: True, "an integer"),
    "step": (int, lambda v: v >= 0, "a non-negative integer"),
}
GENERATE_KEYS = {"checkpoint", "prompt", "prompts_file", "stop", *NUMBERS}


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
    return Request(found["checkpoint"], prompts, sampling=sampling, stop=stop, **numbers), rest


def load_tokenizer_for(config: Config, request: Request) -> tuple[Tokenizer, tuple[int, ...], bool]:
    """(tokenizer, default stop ids, add BOS?): an HF checkpoint's own tokenizer.json, else the config's."""
    directory = Path(request.checkpoint).expanduser()
    if (directory / "config.json").is_file() and (directory / "tokenizer.json").is_file():
        try:
            tokenizer, stop, add_bos = hf_directory_tokenizer(directory)
        except ValueError as e:
            raise ConfigError(f"checkpoint={directory}: {e}") from None
        add_bos = add_bos or config.data.add_bos
        if add_bos and tokenizer.bos_id is None:
            raise ConfigError(f"data.add_bos: the tokenizer of checkpoint={directory} names no BOS token "
                              "(tokenizer_config.json bos_token or config.json bos_token_id); unset data.add_bos")
        return tokenizer, stop, add_bos
    try:
        tokenizer = load_tokenizer(config.data.tokenizer, eos_token=config.data.eos_token,
                                   bos_token=config.data.bos_token)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return tokenizer, (tokenizer.eos_id,), config.data.add_bos


def load_model(config: Config, request: Request) -> tuple[nnx.Module, Mesh, int]:
    """(model, mesh, vocabulary size) of `checkpoint=`, its params sharded on the config's mesh."""
    directory = Path(request.checkpoint).expanduser()
    if (directory / "config.json").is_file():
        if request.step is not None:
            raise ConfigError(f"step={request.step}: {directory} is a Hugging Face directory, which has no steps")
        try:
            sizes = resolve_axis_sizes(dataclasses.asdict(config.mesh), jax.device_count())
            mesh = build_mesh(sizes, num_slices=config.cluster.num_slices)
            model_config, model = from_hf(directory, mesh=mesh, rules=config.sharding.rules)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        return model, mesh, model_config.vocab_size
    training, model, _ = restore_model(config, request.checkpoint, request.step)
    return model, training.mesh, config.model.vocab_size


def run_command(args) -> int:
    request, overrides = split_generate_args(args.overrides)
    config = load_config(args.config, overrides)
    tokenizer, stop, add_bos = load_tokenizer_for(config, request)
    model, mesh, vocab_size = load_model(config, request)
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
    with jax.set_mesh(mesh), use_rules(config.sharding.rules):
        outputs = generate(model, prompts, max_new_tokens=request.max_new_tokens, sampling=request.sampling,
                           stop_tokens=stop, pad_id=tokenizer.pad_id, seed=request.seed)
    seconds = time.perf_counter() - start
    for i, (text, tokens) in enumerate(zip(request.prompts, outputs, strict=True), 1):
        ended = "stopped" if tokens and tokens[-1] in stop else "max_new_tokens"
        print(f"--- prompt {i} ---\n{text}\n--- completion {i} ({len(tokens)} tokens, {ended}) ---\n"
              f"{tokenizer.decode(tokens)}")
    total = sum(map(len, outputs))
    print(f"generated {total} tokens for {len(outputs)} prompt{'s' * (len(outputs) != 1)} in {seconds:.2f} s: "
          f"{total / seconds:,.1f} tokens/s (compilation included)")
    return 0
