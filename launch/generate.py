"""`podtrain generate -c <preset> checkpoint=<dir> prompt=<text> [...]`: continue prompts with a model.

The command's keys are the `generate` section of the config (`GenerateConfig`); `checkpoint=`,
`prompt=` (repeatable, collected into `generate.prompts`), `max_new_tokens=` and the others are
short for `generate.<key>=`, and `stop=2,7` for `generate.stop=[2,7]`. `checkpoint=` is a podtrain
run, checkpoint or step directory or a Hugging Face directory (see `orchestrator/inference/load.py`). All
prompts, with those of `prompts_file=` (one per line), go through one batched
`models.generate.generate` call, BOS first when `data.add_bos` says so or, for an HF directory,
when its tokenizer.json puts BOS first (as Llama 3's does) or its tokenizer_config.json's
`add_bos_token` is true. Generation stops at the EOS ids unless `stop=<id,id>` names others
(`stop=` alone: none); greedy unless `temperature=` > 0. `adapter=` applies a PEFT LoRA adapter
directory to the model (a LoRA run's own checkpoint needs none: its `lora.*` keys bring its adapters).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import jax

from podtrain.launch.command_keys import command_overrides, text_value
from podtrain.models.generate import generate
from podtrain.orchestrator.common.errors import ConfigError
from podtrain.orchestrator.config.compose import load_config, override_keys
from podtrain.orchestrator.config.schema import GenerateConfig
from podtrain.orchestrator.data.tokenizers import check_vocab, checkpoint_tokenizer
from podtrain.orchestrator.inference.load import load_model
from podtrain.orchestrator.placed.restore import with_peft_adapter
from podtrain.sharding.rules import use_rules

USAGE = ("podtrain generate -c <preset> checkpoint=<dir> prompt=<text> [prompt=...] [prompts_file=<path>] "
         "[max_new_tokens=N] [temperature=T] [top_k=K] [top_p=P] [seed=S] [stop=<id,id>] [step=N] [adapter=<dir>]")
KEYS = tuple(f.name for f in dataclasses.fields(GenerateConfig))


def stop_value(raw: str) -> str:
    """`stop=2,7` as the override value `[2, 7]` (`stop=` alone: `[]`, no stop tokens)."""
    ids = [part.strip() for part in raw.split(",") if part.strip()]
    if not all(part.isdigit() for part in ids):
        raise ConfigError(f"generate.stop: expects comma-separated token ids (e.g. stop=2,7), found {raw!r}")
    return f"[{', '.join(ids)}]"


def generate_overrides(overrides: list[str]) -> list[str]:
    """The command line's overrides with the command's short keys as `generate.*` overrides."""
    return command_overrides(overrides, "generate", KEYS, collect={"prompt": "prompts"},
                             convert={"checkpoint": text_value, "prompts_file": text_value, "adapter": text_value,
                                      "stop": stop_value})


def read_prompts(request: GenerateConfig) -> list[str]:
    """`generate.prompts`, then one prompt per non-blank line of `generate.prompts_file`; checks
    that a checkpoint and at least one prompt are given."""
    if not request.checkpoint:
        raise ConfigError(f"generate.checkpoint: expects a run, checkpoint or Hugging Face directory, found none; "
                          f"usage: {USAGE}")
    prompts = list(request.prompts)
    if request.prompts_file is not None:
        path = Path(request.prompts_file).expanduser()
        if not path.is_file():
            raise ConfigError(f"generate.prompts_file={request.prompts_file}: no such file")
        prompts += [line for line in path.read_text().splitlines() if line.strip()]
    if not prompts:
        raise ConfigError(f"generate.prompts: expects a non-empty prompt (prompt=<text> or prompts_file=<path>), "
                          f"found none; usage: {USAGE}")
    return prompts


def run_command(args) -> int:
    overrides = generate_overrides(args.overrides)
    config = load_config(args.config, overrides, hint_keys=[*KEYS, "prompt"])
    request = config.generate
    texts = read_prompts(request)
    tokenizer, stop, add_bos = checkpoint_tokenizer(request.checkpoint, config.data)
    model_keys = [key.removeprefix("model.") for key in override_keys(overrides) if key.startswith("model.")]
    model, mesh, vocab_size = load_model(config, request.checkpoint, request.step, model_keys)
    if request.adapter:
        model = with_peft_adapter(model, request.adapter, config.sharding.rules)
    try:
        check_vocab(tokenizer, vocab_size)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    stop = stop if request.stop is None else tuple(request.stop)
    if any(t >= vocab_size for t in stop):
        source = "" if request.stop is not None else " (the tokenizer's EOS ids)"
        raise ConfigError(f"generate.stop: expects token ids below the vocabulary size {vocab_size}, found "
                          f"{','.join(map(str, stop))}{source}")
    prompts = [[tokenizer.bos_id] * add_bos + tokenizer.encode(text).tolist() for text in texts]
    empty = [text for text, ids in zip(texts, prompts, strict=True) if not ids]
    if empty:
        raise ConfigError(f"generate.prompts: expects text that tokenises to at least one token, found {empty[0]!r}")
    start = time.perf_counter()
    with jax.set_mesh(mesh), use_rules(config.sharding.rules):
        outputs = generate(model, prompts, max_new_tokens=request.max_new_tokens, sampling=request.sampling(),
                           stop_tokens=stop, pad_id=tokenizer.pad_id, seed=request.seed)
    seconds = time.perf_counter() - start
    for i, (text, tokens) in enumerate(zip(texts, outputs, strict=True), 1):
        ended = "stopped" if tokens and tokens[-1] in stop else "max_new_tokens"
        print(f"--- prompt {i} ---\n{text}\n--- completion {i} ({len(tokens)} tokens, {ended}) ---\n"
              f"{tokenizer.decode(tokens)}")
    total = sum(map(len, outputs))
    print(f"generated {total} tokens for {len(outputs)} prompt{'s' * (len(outputs) != 1)} in {seconds:.2f} s: "
          f"{total / seconds:,.1f} tokens/s (compilation included)")
    return 0
