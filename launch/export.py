"""`podtrain export -c <preset> checkpoint=<dir> out=<dir> [step=N] [adapter=true]`: weights as HF safetensors.

`checkpoint=`, `out=`, `step=` and `adapter=` are short for the `export` section's keys (`ExportConfig`).
`checkpoint=` may name a run directory (its `checkpoints/` is used), a checkpoint directory, or
one step folder inside it. The newest committed step is exported unless `step=` names one. Only
the parameters are read (never the optimizer state), each straight into its sharding on the
mesh of `-c` and the overrides, then `models.to_hf` writes them. The model section of the config
must equal the one the checkpoint was trained with (apart from compute dtype, remat and the
like); any difference is an error that names it. The training tokenizer (`data.tokenizer`) goes
along: its BOS / EOS ids into config.json and, for a tokenizer.json, that file (putting BOS first
when `data.add_bos` is on) and a tokenizer_config.json, so that transformers' AutoTokenizer loads
it; the built-in byte tokenizer has no HF files. A LoRA run (the `lora.*` keys it was trained
with) exports its base with the adapters merged into it, or with `adapter=true` the adapters alone
in the PEFT format.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from pathlib import Path

from podtrain.launch.command_keys import command_overrides, text_value
from podtrain.models import to_hf
from podtrain.models.lora import to_peft
from podtrain.orchestrator.common.errors import ConfigError
from podtrain.orchestrator.config.compose import load_config
from podtrain.orchestrator.config.schema import Config, ExportConfig
from podtrain.orchestrator.data.chat import load_chat_template
from podtrain.orchestrator.data.tokenizers import HFTokenizer, load_tokenizer
from podtrain.orchestrator.placed.restore import checkpoint_step, restore_model

USAGE = "podtrain export -c <preset> checkpoint=<dir> out=<dir> [step=N] [adapter=true]"
KEYS = tuple(f.name for f in dataclasses.fields(ExportConfig))


def export_overrides(overrides: list[str]) -> list[str]:
    """The command line's overrides with `checkpoint=`, `out=` and `step=` as `export.*` overrides."""
    return command_overrides(overrides, "export", KEYS, convert={"checkpoint": text_value, "out": text_value})


def check_request(request: ExportConfig) -> None:
    """Raises ConfigError naming the key when `export.checkpoint` or `export.out` is not given."""
    expected = {"checkpoint": "a run, checkpoint or step directory", "out": "a new or empty directory"}
    for key, what in expected.items():
        if not getattr(request, key):
            raise ConfigError(f"export.{key}: expects {what}, found none (usage: {USAGE})")


def check_out(raw: str) -> Path:
    """`out=` as a path, checked before any work: a new or empty directory that can be created."""
    out = Path(raw).expanduser()
    existing = next(p for p in (out, *out.parents) if p.exists())
    if not existing.is_dir():
        what = "is a file" if existing == out else f"lies under {existing}, which is a file"
        raise ConfigError(f"out={raw}: {what}; expected a new or empty directory")
    if existing == out and any(out.iterdir()):
        raise ConfigError(f"out={raw}: directory exists and is not empty; choose a new path")
    try:  # what to_hf will do: create the parent, then a staging directory in it
        out.parent.mkdir(parents=True, exist_ok=True)
        os.rmdir(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    except OSError as e:
        raise ConfigError(f"out={raw}: cannot create a directory in {out.parent} ({e.strerror})") from None
    return out


def tokenizer_export(config: Config) -> tuple[dict, dict[str, bytes]]:
    """(config.json keys, files) for the training tokenizer `data.*` names: its BOS / EOS ids,
    and for a tokenizer.json its files, set to put BOS first when `data.add_bos` is on and, for
    chat data, to carry the chat template the rows were rendered with."""
    data = config.data
    try:
        tokenizer = load_tokenizer(data.tokenizer, eos_token=data.eos_token, bos_token=data.bos_token)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    ids = {"eos_token_id": tokenizer.eos_id}
    if tokenizer.bos_id is not None:
        ids["bos_token_id"] = tokenizer.bos_id
    if isinstance(tokenizer, HFTokenizer):
        try:  # the template chat rows were rendered with goes along
            template = load_chat_template(data.tokenizer, data.chat_template).source if data.source == "chat" else None
        except ValueError as e:
            raise ConfigError(str(e)) from None
        return ids, tokenizer.hf_files(add_bos=data.add_bos, chat_template=template)
    return ids, {}


def run_command(args) -> int:
    config = load_config(args.config, export_overrides(args.overrides), hint_keys=KEYS)
    request = config.export
    check_request(request)
    directory, _ = checkpoint_step(request.checkpoint, request.step)  # its errors before any work
    out = check_out(request.out)
    config_extra, tokenizer_files = tokenizer_export(config)
    if request.adapter:
        if not config.lora.rank:
            raise ConfigError("export.adapter: writes a LoRA run's adapters, but lora.rank=0; pass the lora.* keys "
                              "the run was trained with")
        _, model, step = restore_model(config, request.checkpoint, request.step, merge=False)
        try:
            to_peft(model, config.model, config.lora, out, base=config.lora.base)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        files = sorted(out.iterdir())
        print(f"exported the adapters of step {step} of {directory} to {out} in the PEFT format: "
              f"{', '.join(f.name for f in files)}")
        print(f"load them with peft.PeftModel.from_pretrained(<the base model>, {os.fspath(out)!r})")
        return 0
    if config.model.tie_word_embeddings and config.lora.wants("lm_head"):
        raise ConfigError("export.adapter: this run's LM head adapter cannot be merged into a model whose head is "
                          "its embedding (model.tie_word_embeddings); export the adapters with export.adapter=true")
    _, model, step = restore_model(config, request.checkpoint, request.step)
    to_hf(model, config.model, out, config_extra=config_extra, files=tokenizer_files)
    files = sorted(out.iterdir())
    size = sum(f.stat().st_size for f in files)
    print(f"exported step {step} of {directory} to {out}: {len(files)} files, {size / 2**20:.1f} MiB "
          f"({', '.join(f.name for f in files)})")
    print(f"load it with transformers.AutoModelForCausalLM.from_pretrained({os.fspath(out)!r})"
          + (" and AutoTokenizer.from_pretrained(the same)" if tokenizer_files else
             f" (data.tokenizer={config.data.tokenizer} has no HF tokenizer files)"))
    return 0
