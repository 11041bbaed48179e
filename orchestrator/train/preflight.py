"""The checks a run's inputs pass before anything is written, reserved or started.

`check_inputs(config, run_dir)` finds what would otherwise fail only after hosts were reserved,
processes started and files written: the data (a missing path, an empty, binary or too small corpus),
the tokenizer and the model's vocabulary, the sample prompt, and the checkpoint directory (a file in
its path, no write access, `checkpoint.resume` asking for a step that is not there, a checkpoint of
another model or batch size). It reads, and never writes. The driver runs it before it connects to
Ray, `podtrain train cluster=none` before it trains, and each worker process before it joins the JAX
world, so every process of a gang fails the same way, at once, with the same line.
"""

from __future__ import annotations

import dataclasses
import errno
import os
from collections.abc import Sequence
from pathlib import Path

from podtrain.orchestrator.checkpoint.resume import check_resume_matches, committed_steps, resume_step
from podtrain.orchestrator.checkpoint.rundir import checkpoint_directory
from podtrain.orchestrator.common.errors import ConfigError
from podtrain.orchestrator.config.schema import Config
from podtrain.orchestrator.data.chat import chat_row, load_chat_template
from podtrain.orchestrator.data.corpus import document_indices, open_corpus
from podtrain.orchestrator.data.tokenizers import Tokenizer, check_vocab, load_tokenizer


@dataclasses.dataclass
class Inputs:
    """What the data checks opened, for the run to use rather than open again."""

    corpus: Sequence
    tokenizer: Tokenizer


def evals_enabled(config: Config) -> bool:
    """Whether the run computes eval losses: every `train.eval_every` steps, from a held-out split."""
    return config.train.eval_every > 0 and config.data.eval_fraction > 0


def check_inputs(config: Config, run_dir: str | os.PathLike, *, data: bool = True) -> Inputs | None:
    """Raises ConfigError for the first mistake found in `config`'s checkpoints and (with `data`) its
    data; returns the opened corpus and tokenizer, or None without `data`."""
    check_checkpoints(config, run_dir)
    return check_data(config) if data else None


def check_checkpoints(config: Config, run_dir: str | os.PathLike) -> None:
    """The checkpoint directory can be created and written, and holds what `checkpoint.resume` asks for."""
    directory = checkpoint_directory(config.checkpoint.dir, run_dir)
    if "://" not in directory:  # URLs (gs://) are checked by Orbax when the run opens them
        _check_creatable(directory)
    steps = committed_steps(directory)
    step = resume_step(config.checkpoint.resume, directory, steps)
    if step is not None:
        check_resume_matches(directory, step, config)


def _check_creatable(directory: str) -> None:
    """ConfigError unless `directory` is a directory this process may write, or could be created."""
    existing = Path(directory)
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        reason = os.strerror(errno.ENOTDIR)
    elif not os.access(existing, os.W_OK | os.X_OK):
        reason = os.strerror(errno.EACCES)
    else:
        return
    raise ConfigError(f"checkpoint.dir={directory}: cannot create or write the checkpoint directory ({reason}): "
                      "expected a directory podtrain can create and write; fix the path or its permissions, or "
                      "set another checkpoint.dir")


def check_data(config: Config) -> Inputs:
    """Opens the corpus and tokenizer and checks that every split the run reads has documents for
    each batch row, that chat rows have a template that renders the first, and that the sample
    prompt tokenises."""
    try:
        tokenizer = load_tokenizer(config.data.tokenizer, eos_token=config.data.eos_token,
                                   bos_token=config.data.bos_token)
        check_vocab(tokenizer, config.model.vocab_size)
        corpus = open_corpus(config.data, seq_len=config.train.seq_len)
        for split in ("train", "eval") if evals_enabled(config) else ("train",):
            document_indices(len(corpus), eval_fraction=config.data.eval_fraction, split=split,
                             process_count=config.train.batch_size, tail=config.data.source == "tokens",
                             source=config.data.source)
        if config.data.source == "chat":  # a missing template or a row it cannot render fails here
            template = load_chat_template(config.data.tokenizer, config.data.chat_template)
            chat_row(corpus, 0, template, tokenizer, config.data.loss_on or "assistant")
    except ValueError as e:  # bad paths, empty corpora, vocab sizes: the user's input
        raise ConfigError(str(e)) from None
    if config.train.sample_prompt:
        sample_prompt_ids(config, tokenizer)
    return Inputs(corpus, tokenizer)


def sample_prompt_ids(config: Config, tokenizer: Tokenizer) -> list[int]:
    """`train.sample_prompt` as token ids, with BOS first when the documents start with one."""
    ids = [tokenizer.bos_id] * config.data.add_bos + tokenizer.encode(config.train.sample_prompt).tolist()
    if not ids:
        raise ConfigError(f"train.sample_prompt={config.train.sample_prompt!r}: expected text that tokenises to at "
                          "least one token, found none")
    return ids
