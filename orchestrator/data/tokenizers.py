"""Tokenisers for the data pipeline: a built-in byte-level one and any HF `tokenizer.json`.

Both give `encode(text) -> int32 ids` without special tokens (the pipeline adds BOS and EOS itself),
`encode_with_offsets` (the characters each id comes from, for chat loss masks), `decode(ids)`,
the ids of their special tokens and `vocab_size`, one more than the largest id they
can produce. `check_vocab` compares that with the model's embedding table.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import ClassVar, Protocol

import numpy as np
import tokenizers
from tokenizers import processors

from podtrain.models.hf_read import is_hf_directory, read_json_object
from podtrain.orchestrator.common.errors import ConfigError


class Tokenizer(Protocol):
    """What the data pipeline needs from a tokeniser."""

    vocab_size: int
    pad_id: int
    bos_id: int | None
    eos_id: int

    def encode(self, text: str) -> np.ndarray: ...

    def encode_with_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]: ...

    def decode(self, ids) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, then PAD=256, BOS=257, EOS=258: `vocab_size` is 259. Needs no files."""

    pad_id: ClassVar[int] = 256
    bos_id: ClassVar[int] = 257
    eos_id: ClassVar[int] = 258
    vocab_size: ClassVar[int] = 259

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)

    def encode_with_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """The ids and, for each, the (start, end) characters of `text` it comes from."""
        lengths = np.fromiter((len(c.encode("utf-8")) for c in text), np.int64, len(text))
        chars = np.repeat(np.arange(len(text)), lengths)
        return self.encode(text), np.stack([chars, chars + 1], axis=-1).reshape(-1, 2)

    def decode(self, ids) -> str:
        """The text of the byte ids; special ids are dropped and broken UTF-8 becomes U+FFFD."""
        ids = np.asarray(ids)
        return ids[ids < 256].astype(np.uint8).tobytes().decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face `tokenizers` tokeniser read from a `tokenizer.json` file.

    Padding (which always has loss weight 0) uses the EOS id.
    """

    def __init__(self, path: str | Path, *, eos_token: str, bos_token: str | None = None):
        self.path = Path(path)
        self._tokenizer = _read_tokenizer(self.path, f"data.tokenizer={str(path)!r}")
        vocab = self._tokenizer.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values()) + 1
        self.eos_id = self._special_id(vocab, "eos_token", eos_token)
        self.bos_id = None if bos_token is None else self._special_id(vocab, "bos_token", bos_token)
        self.pad_id = self.eos_id
        self.eos_token, self.bos_token = eos_token, bos_token

    def _special_id(self, vocab: dict[str, int], key: str, token: str) -> int:
        if token not in vocab:
            raise ValueError(f"data.{key}={token!r} is not in the vocabulary of {self.path}; give a token it has")
        return vocab[token]

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tokenizer.encode(text, add_special_tokens=False).ids, np.int32)

    def encode_with_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """The ids and, for each, the (start, end) characters of `text` it comes from."""
        encoding = self._tokenizer.encode(text, add_special_tokens=False)
        return np.asarray(encoding.ids, np.int32), np.asarray(encoding.offsets, np.int64).reshape(-1, 2)

    def adds_bos(self) -> bool:
        """Whether the file's post-processor starts an encoding with the BOS token (Llama 3's
        `TemplateProcessing` does; transformers' tokenizer then puts BOS before a prompt)."""
        ids = self._tokenizer.encode("a", add_special_tokens=True).ids
        return self.bos_id is not None and bool(ids) and ids[0] == self.bos_id

    def hf_files(self, *, add_bos: bool, chat_template: str | None = None) -> dict[str, bytes]:
        """tokenizer.json and tokenizer_config.json for an HF export, so that transformers'
        tokenizer encodes as training did: with `add_bos`, a post-processor that puts BOS first
        (unless the file's own does); the special tokens named; a tokenizer_config.json beside the
        file kept for its other keys (a chat template, say); `chat_template`, the template chat
        rows were rendered with, as its chat template."""
        tokenizer = tokenizers.Tokenizer.from_str(self._tokenizer.to_str())
        if add_bos and not self.adds_bos():
            bos = processors.TemplateProcessing(single=f"{self.bos_token} $A", pair=f"{self.bos_token} $A $B:1",
                                                special_tokens=[(self.bos_token, self.bos_id)])
            own = tokenizer.post_processor
            tokenizer.post_processor = bos if own is None else processors.Sequence([own, bos])
        dropped = ("tokenizer_class", "add_bos_token", "add_eos_token", "auto_map", "tokenizer_file")
        special = {k: v for k, v in _read_json(self.path.parent / "tokenizer_config.json").items() if k not in dropped}
        special |= {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": self.eos_token}
        special.setdefault("pad_token", self.eos_token)  # what the data pipeline pads with
        if chat_template is not None:
            special["chat_template"] = chat_template
        if self.bos_token is not None:
            special["bos_token"] = self.bos_token
        return {"tokenizer.json": tokenizer.to_str().encode(),
                "tokenizer_config.json": (json.dumps(special, indent=2) + "\n").encode()}

    def decode(self, ids) -> str:
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)


def load_tokenizer(name: str, *, eos_token: str | None = None, bos_token: str | None = None) -> Tokenizer:
    """The tokeniser `data.tokenizer` names.

    Args:
        name: "byte" for `ByteTokenizer`, or a `tokenizer.json` file (or a directory holding one).
        eos_token: the end-of-document token of a `tokenizer.json` tokeniser (required for one).
        bos_token: its beginning-of-document token (needed only when documents start with BOS).

    Raises:
        ValueError: naming the key, when the file is missing or a special token is not in the vocabulary.
    """
    if name == "byte":
        return ByteTokenizer()
    path = Path(name)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"data.tokenizer={name!r}: expected 'byte' or a tokenizer.json file, found no such file")
    if eos_token is None:
        raise ValueError(f"data.eos_token: required with data.tokenizer={name!r} (e.g. '</s>' or '<|end_of_text|>')")
    return HFTokenizer(path, eos_token=eos_token, bos_token=bos_token)


def check_vocab(tokenizer: Tokenizer, model_vocab_size: int) -> None:
    """Raises ValueError when the tokeniser can produce ids the model's embedding table lacks."""
    if tokenizer.vocab_size > model_vocab_size:
        raise ValueError(
            f"the tokenizer's vocabulary ({tokenizer.vocab_size} ids) exceeds model.vocab_size={model_vocab_size}; "
            f"set model.vocab_size >= {tokenizer.vocab_size} or use a smaller tokenizer"
        )


def _read_tokenizer(path: Path, what: str) -> tokenizers.Tokenizer:
    try:
        return tokenizers.Tokenizer.from_file(str(path))
    except Exception as e:  # the Rust side raises a bare Exception
        raise ValueError(f"{what}: not a valid tokenizer.json ({e})") from None


def _read_json(path: Path) -> dict:
    """A JSON object file, {} when there is none; ValueError naming the file when it is not JSON."""
    return read_json_object(path) if path.is_file() else {}


def _token_text(token) -> str | None:
    """A special token of tokenizer_config.json: a string, or a dict with its "content"."""
    return token.get("content") if isinstance(token, dict) else token


def hf_directory_tokenizer(directory: Path) -> tuple[HFTokenizer, tuple[int, ...], bool]:
    """(tokenizer, stop ids, add BOS?) from an HF directory's tokenizer.json and the special tokens that
    its tokenizer_config.json names (else the ids config.json names). BOS goes first when
    tokenizer.json's post-processor adds it (as transformers' tokenizer does, whatever
    `add_bos_token` says) or tokenizer_config.json's `add_bos_token` is true."""
    special, hf_config = _read_json(directory / "tokenizer_config.json"), _read_json(directory / "config.json")
    vocab = _read_tokenizer(directory / "tokenizer.json", str(directory / "tokenizer.json"))
    ids = {key: hf_config.get(f"{key}_token_id") for key in ("eos", "bos")}
    ids = {key: [found] if isinstance(found, int) else list(found or []) for key, found in ids.items()}
    names = {key: _token_text(special.get(f"{key}_token")) or (vocab.id_to_token(ids[key][0]) if ids[key] else None)
             for key in ids}
    eos, bos = names["eos"], names["bos"]
    if eos is None:
        raise ValueError("no EOS token in tokenizer_config.json (eos_token) or config.json (eos_token_id); "
                         "add one there")
    tokenizer = HFTokenizer(directory / "tokenizer.json", eos_token=eos, bos_token=bos)
    add_bos = special.get("add_bos_token") is True or tokenizer.adds_bos()
    return tokenizer, tuple(dict.fromkeys([tokenizer.eos_id, *ids["eos"]])), add_bos


def checkpoint_tokenizer(checkpoint: str, data) -> tuple[Tokenizer, tuple[int, ...], bool]:
    """(tokenizer, default stop ids, add BOS?) for a model read from `checkpoint`: an HF
    directory's own tokenizer.json (with the EOS and BOS its tokenizer_config.json / config.json
    name), else the tokenizer `data` (the config's data section) names."""
    directory = Path(checkpoint).expanduser()
    if checkpoint and is_hf_directory(checkpoint) and (directory / "tokenizer.json").is_file():
        try:
            tokenizer, stop, add_bos = hf_directory_tokenizer(directory)
        except ValueError as e:
            raise ConfigError(f"checkpoint={directory}: {e}") from None
        add_bos = add_bos or data.add_bos
        if add_bos and tokenizer.bos_id is None:
            raise ConfigError(f"data.add_bos: the tokenizer of checkpoint={directory} names no BOS token "
                              "(tokenizer_config.json bos_token or config.json bos_token_id); unset data.add_bos")
        return tokenizer, stop, add_bos
    try:
        tokenizer = load_tokenizer(data.tokenizer, eos_token=data.eos_token, bos_token=data.bos_token)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return tokenizer, (tokenizer.eos_id,), data.add_bos
