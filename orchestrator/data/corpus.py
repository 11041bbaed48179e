"""A corpus: the documents of `data.path` in a fixed order, read lazily, and its train/eval splits.

`open_corpus` gives a random-access sequence of documents: texts (a text file's documents are byte
ranges indexed when it opens, as `data.documents` says; JSONL lines, Parquet rows, ArrayRecord
records) or int32 token windows for pre-tokenised data. Opening checks what can fail early: paths
that match nothing, an empty corpus, files that are not UTF-8 text (their first bytes), a JSON field
or Parquet column that is not there; a document that turns out not to decode when it is read is an
error naming its file and where. `document_indices` splits the corpus into train and eval documents
and shares them among the batch rows. Nothing here needs JAX, so the driver can check a corpus
before it starts anything.
"""

from __future__ import annotations

import array
import codecs
import glob
import itertools
import json
import mmap
import os
import re
import sysconfig
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from podtrain.orchestrator.config.schema import DataConfig

SPLITS = ("train", "eval")
_SUFFIXES = {"text": ("",), "jsonl": (".jsonl",), "parquet": (".parquet",), "array_record": (".array_record",),
             "tokens": (".npy",), "chat": (".jsonl", ".parquet")}
_HEAD_BYTES = 8192  # what opening a corpus checks of each text file
_BLANK_LINES = re.compile(rb"\n(?:[^\S\n]*\n)+")  # a line's end, then lines that are empty or whitespace only
_NON_BLANK = re.compile(rb"\S")
_BLANK_BYTES = b" \t\n\r\f\v"


class _TextRanges:
    """Documents that are byte ranges of UTF-8 files, read lazily; undecodable bytes are an error
    naming the file and where (or, `lenient`, become U+FFFD)."""

    def __init__(self, files: list[Path], ranges: list[np.ndarray], *, lenient: bool = False):
        self.files, self.lenient = files, lenient
        self.ends = np.cumsum([len(r) for r in ranges])
        self.ranges = np.concatenate(ranges)  # (documents, 2): start and stop offsets

    def __len__(self) -> int:
        return int(self.ends[-1])

    def __getitem__(self, i: int) -> str:
        path = self.files[_locate(self.ends, i)[0]]
        start, stop = (int(x) for x in self.ranges[i])
        with open(path, "rb") as fh:
            fh.seek(start)
            data = fh.read(stop - start)
        if self.lenient:
            return data.decode("utf-8", errors="replace")
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(_not_utf8(path, start + e.start, data[e.start])) from None


class _JsonlRecords:
    """One JSON object per non-blank line of JSONL files, found through an index of line offsets."""

    def __init__(self, files: list[Path]):
        self.files = files
        self.offsets = [_line_offsets(f) for f in files]
        self.ends = np.cumsum([len(o) for o in self.offsets])

    def __len__(self) -> int:
        return int(self.ends[-1])

    def __getitem__(self, i: int) -> dict:
        return self.read(*_locate(self.ends, i))

    def where(self, i: int) -> str:
        return self.place(*_locate(self.ends, i))

    def place(self, f: int, k: int) -> str:
        return f"{self.files[f]}, line {_line_number(self.files[f], int(self.offsets[f][k]))}"

    def read(self, f: int, k: int) -> dict:
        path, offset = self.files[f], int(self.offsets[f][k])
        with open(path, "rb") as fh:
            fh.seek(offset)
            line = fh.readline()
        try:
            text = line.decode("utf-8").removeprefix("\ufeff" if offset == 0 else "")
        except UnicodeDecodeError as e:
            raise ValueError(_not_utf8(path, offset + e.start, line[e.start])) from None
        try:
            record = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{self.place(f, k)}: expected a JSON object, found invalid JSON ({e.msg})") from None
        return record


class _JsonlTexts:
    """One document per non-blank line of JSONL files: the string under `field`."""

    def __init__(self, files: list[Path], field: str):
        self.records, self.field = _JsonlRecords(files), field
        for f, offsets in enumerate(self.records.offsets):
            if len(offsets):  # a wrong text_field fails here, not hours into training
                self._text(f, 0)

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> str:
        return self._text(*_locate(self.records.ends, i))

    def _text(self, f: int, k: int) -> str:
        record = self.records.read(f, k)
        where = lambda: self.records.place(f, k)
        if not isinstance(record, dict) or self.field not in record:
            found = f"keys {sorted(record)}" if isinstance(record, dict) else type(record).__name__
            raise ValueError(f"{where()}: data.text_field={self.field!r} not found; the line has {found}")
        if not isinstance(record[self.field], str):
            kind = type(record[self.field]).__name__
            raise ValueError(f"{where()}: data.text_field={self.field!r} should hold a string, found {kind}")
        return record[self.field]


class _ChatRows:
    """Chat rows (JSON objects) of JSONL and Parquet files, in file order; `where(i)` names a row's place."""

    def __init__(self, files: list[Path]):
        self.parts = [_parquet_table(f) if f.suffix == ".parquet" else _JsonlRecords([f]) for f in files]
        self.files = files
        self.ends = np.cumsum([len(part) for part in self.parts])

    def __len__(self) -> int:
        return int(self.ends[-1])

    def __getitem__(self, i: int):
        f, k = _locate(self.ends, i)
        part = self.parts[f]
        return part[k] if isinstance(part, _JsonlRecords) else part.slice(k, 1).to_pylist()[0]

    def where(self, i: int) -> str:
        f, k = _locate(self.ends, i)
        part = self.parts[f]
        return part.where(k) if isinstance(part, _JsonlRecords) else f"{self.files[f]}, row {k}"


def _parquet_table(path: Path):
    import pyarrow.parquet as pq  # only Parquet files need pyarrow; it is slow to import

    return pq.read_table(path)


class _ArrowTexts:
    """One document per row of a string column (all files' columns held in memory by Arrow)."""

    def __init__(self, files: list[Path], column: str):
        import pyarrow as pa  # only the parquet source needs pyarrow; it is slow to import
        import pyarrow.parquet as pq

        chunks = []
        for path in files:
            schema = pq.read_schema(path)
            if column not in schema.names:
                raise ValueError(f"{path}: data.text_field={column!r} is not a column; found columns {schema.names}")
            kind = schema.field(column).type
            if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
                raise ValueError(f"{path}: data.text_field={column!r} should be a string column, found {kind}")
            values = pq.read_table(path, columns=[column]).column(0)
            if values.null_count:
                found = f"{values.null_count} nulls"
                raise ValueError(f"{path}: data.text_field={column!r} should hold a string in every row, found {found}")
            chunks.extend(values.cast(pa.large_string()).chunks)
        self.column = pa.chunked_array(chunks, type=pa.large_string())

    def __len__(self) -> int:
        return len(self.column)

    def __getitem__(self, i: int) -> str:
        return self.column[i].as_py()


class _RecordTexts:
    """One document per record of ArrayRecord files, read as UTF-8."""

    def __init__(self, files: list[Path]):
        import grain  # only this source needs grain here

        self.files = files
        self.sources = [grain.sources.ArrayRecordDataSource([str(f)]) for f in files]
        self.ends = np.cumsum([len(source) for source in self.sources])

    def __len__(self) -> int:
        return int(self.ends[-1])

    def __getitem__(self, i: int) -> str:
        f, k = _locate(self.ends, i)
        record = self.sources[f][k]
        try:
            return record.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{self.files[f]}, record {k}: expected UTF-8 text, found byte 0x{record[e.start]:02x} "
                             f"at byte {e.start} of the record") from None


class _TokenWindows:
    """Consecutive, non-overlapping windows of `length` ids cut from each token stream (a remainder is dropped)."""

    def __init__(self, files: list[Path], length: int):
        self.length = length
        self.arrays = [_load_tokens(f) for f in files]
        self.ends = np.cumsum([a.shape[0] * (a.shape[1] // length) for a in self.arrays])

    def __len__(self) -> int:
        return int(self.ends[-1])

    def __getitem__(self, i: int) -> np.ndarray:
        f, k = _locate(self.ends, i)
        array = self.arrays[f]
        row, window = divmod(k, array.shape[1] // self.length)
        return np.asarray(array[row, window * self.length : (window + 1) * self.length])  # int32 once checked


def _locate(ends: np.ndarray, i: int) -> tuple[int, int]:
    """(file, index within that file) of item `i`, given the running item count `ends` over files."""
    f = int(np.searchsorted(ends, i, side="right"))
    return f, int(i - (ends[f - 1] if f else 0))


def _check_head(path: Path, head: bytes, expected: str) -> None:
    """Raises ValueError naming `path` when `head`, its first bytes, are not UTF-8 text (a NUL byte,
    or bytes that do not decode): a binary file fails when the corpus opens, not during training."""
    nul = head.find(b"\0")
    if nul >= 0:
        raise ValueError(f"{path}: expected {expected}, found a NUL byte at byte offset {nul} (a binary file?); "
                         "leave it out of data.path")
    try:  # incremental: a character cut at the end of `head` is not an error unless the file ends there
        codecs.getincrementaldecoder("utf-8")().decode(head, final=len(head) < _HEAD_BYTES)
    except UnicodeDecodeError as e:
        raise ValueError(_not_utf8(path, e.start, head[e.start])) from None


def _not_utf8(path: Path, offset: int, byte: int) -> str:
    """The error for `byte`, at byte `offset` of `path`, which does not decode as UTF-8."""
    with open(path, "rb") as fh:
        before = fh.read(offset)
    line, column = before.count(b"\n") + 1, offset - before.rfind(b"\n")
    return (f"{path}, line {line}: expected UTF-8 text, found byte 0x{byte:02x} at column {column} (byte offset "
            f"{offset}); convert the file to UTF-8 or leave it out of data.path")


def _text_ranges(path: Path, documents: str, window_bytes: int) -> np.ndarray:
    """The (start, stop) byte offsets of the documents of one text file, found by scanning a memory
    map of it. `documents` is "file", "paragraphs", "windows" or "auto" (a lone file: paragraphs
    when there are several, else windows)."""
    with open(path, "rb") as fh:
        _check_head(path, fh.read(_HEAD_BYTES), "a UTF-8 text file")
        size = os.fstat(fh.fileno()).st_size
        if documents == "file":
            return np.array([[0, size]], np.int64)
        if not size:
            return np.zeros((0, 2), np.int64)
        with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as text:
            if documents != "windows":
                found = _paragraphs(text, size)
                if documents == "paragraphs" or len(found) > 1:
                    return found
            return _windows(text, size, window_bytes)


def _paragraphs(text: mmap.mmap, size: int) -> np.ndarray:
    """The paragraphs of `text` (runs of lines separated by blank ones), each from the start of its
    first line to its last non-blank byte."""
    spans, start = array.array("q"), 0
    gaps = itertools.chain((m.span() for m in _BLANK_LINES.finditer(text)), [(size, size)])
    for stop, next_start in gaps:
        first = _NON_BLANK.search(text, start, stop)
        if first:  # the text before the first gap or after the last may be blank lines only
            begin = max(start, text.rfind(b"\n", start, first.start()) + 1)
            while text[stop - 1] in _BLANK_BYTES:
                stop -= 1
            spans.extend((begin, stop))
        start = next_start
    return np.array(spans, np.int64).reshape(-1, 2)


def _windows(text: mmap.mmap, size: int, window_bytes: int) -> np.ndarray:
    """Consecutive pieces of at most `window_bytes` bytes covering `text`, each ending after its last
    newline, else before the character that the window's end would cut."""
    spans, start = array.array("q"), 0
    while start < size:
        stop = min(start + window_bytes, size)
        if stop < size:
            newline = text.rfind(b"\n", start, stop)
            if newline >= 0:
                stop = newline + 1
            else:  # back to the start of the character that `stop` falls in (a UTF-8 continuation byte)
                while stop > start + 1 and text[stop] & 0xC0 == 0x80:
                    stop -= 1
        spans.extend((start, stop))
        start = stop
    return np.array(spans, np.int64).reshape(-1, 2)


def _line_offsets(path: Path) -> np.ndarray:
    offsets, position = [], 0
    with open(path, "rb") as fh:
        _check_head(path, fh.read(_HEAD_BYTES), "JSON lines (UTF-8 text)")
        fh.seek(0)
        for line in fh:
            if line.strip():
                offsets.append(position)
            position += len(line)
    return np.asarray(offsets, np.int64)


def _line_number(path: Path, offset: int) -> int:
    with open(path, "rb") as fh:
        return fh.read(offset).count(b"\n") + 1


def _load_tokens(path: Path) -> np.ndarray:
    """A memory-mapped (streams, ids) view of a `.npy` token array."""
    tokens = np.load(path, mmap_mode="r")
    if tokens.ndim not in (1, 2) or not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"{path}: expected a 1-D or 2-D integer token array, found {tokens.ndim}-D {tokens.dtype}")
    return tokens.reshape(1, -1) if tokens.ndim == 1 else tokens


def _walk(root: Path, suffix: str | tuple[str, ...], skip_dirs: tuple[str, ...] = ()) -> list[Path]:
    """Files under `root` ending in `suffix` (or one of them), hidden entries skipped, in a deterministic order."""
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in skip_dirs)
        found += [Path(folder, name) for name in sorted(files) if name.endswith(suffix) and not name.startswith(".")]
    return found


def _resolve_files(source: str, path: str) -> list[Path]:
    suffix = _SUFFIXES[source]
    if any(c in path for c in "*?["):
        files = sorted(p for p in map(Path, glob.glob(path, recursive=True)) if p.is_file())
        if not files:
            raise ValueError(f"data.path={path!r}: expected the glob to match {source} files, it matched none")
    elif Path(path).is_dir():
        files = _walk(Path(path), suffix)
        if not files:
            raise ValueError(f"data.path={path!r}: expected {' or '.join(suffix) or 'any'} files in this directory, "
                             "found none")
    elif Path(path).is_file():
        files = [Path(path)]
    else:
        raise ValueError(f"data.path={path!r}: expected a file, directory or glob, found no such path")
    return files


def open_corpus(config: DataConfig, *, seq_len: int) -> Sequence:
    """The documents of `config` in their fixed corpus order, read lazily.

    Args:
        config: the data config (`source`, `path`, `text_field`).
        seq_len: the training sequence length; "tokens" corpora are cut into windows of seq_len+1 ids.

    Returns:
        A sequence of texts, or of int32 token windows for the "tokens" source.

    Raises:
        ValueError: naming the key and file when the path, a file or the corpus is not as expected.
    """
    config.validate()
    if config.source == "stdlib":
        root = Path(sysconfig.get_paths()["stdlib"])
        files = _walk(root, ".py", skip_dirs=("site-packages", "dist-packages", "__pycache__"))
        return _TextRanges(files, [np.array([[0, f.stat().st_size]], np.int64) for f in files], lenient=True)
    files = _resolve_files(config.source, config.path)
    documents = "file" if config.documents == "auto" and len(files) > 1 else config.documents
    corpus = {
        "text": lambda: _TextRanges(files, [_text_ranges(f, documents, config.window_bytes) for f in files]),
        "jsonl": lambda: _JsonlTexts(files, config.text_field),
        "parquet": lambda: _ArrowTexts(files, config.text_field),
        "array_record": lambda: _RecordTexts(files),
        "tokens": lambda: _TokenWindows(files, seq_len + 1),
        "chat": lambda: _ChatRows(files),
    }[config.source]()
    if not len(corpus):
        unit = f"windows of train.seq_len+1={seq_len + 1} ids" if config.source == "tokens" else "documents"
        raise ValueError(f"data.path={config.path!r}: expected {unit} in {len(files)} file(s), found none")
    return corpus


def document_indices(
    num_docs: int, *, eval_fraction: float, split: str, process_index: int = 0, process_count: int = 1,
    tail: bool = False, source: str | None = None,
) -> np.ndarray:
    """The corpus indices of one share (one batch row's stream) of the train or eval split.

    Document `i` is held out for eval when `floor((i+1) * eval_fraction) > floor(i * eval_fraction)`,
    which spreads `floor(num_docs * eval_fraction)` eval documents evenly over the corpus order; with
    `tail`, the last `floor(num_docs * eval_fraction)` are (for token windows, whose documents run
    across neighbouring windows: a held-out window then borders training ones only once).
    Share `p` of `n` takes every n-th document of its split from the p-th on; an eval split of
    fewer than `n` documents is shared (share `p` takes eval document `p mod len(split)`), since
    the eval stream repeats anyway. `source` (`data.source`) only tailors the advice of an error.

    Raises:
        ValueError: when the split is unknown, the eval split is empty or the train split leaves a
            share without documents.
    """
    if split not in SPLITS:
        raise ValueError(f"split: expected one of {list(SPLITS)}, found {split!r}")
    i = np.arange(num_docs)
    if tail:
        is_eval = i >= num_docs - int(np.floor(num_docs * eval_fraction))
    else:
        is_eval = np.floor((i + 1) * eval_fraction) > np.floor(i * eval_fraction)
    chosen = i[is_eval] if split == "eval" else i[~is_eval]
    counts = f"({num_docs} in the corpus, data.eval_fraction={eval_fraction})"
    if split == "eval":
        if not len(chosen):
            raise ValueError(f"the eval split has no documents {counts}: raise data.eval_fraction so that it holds "
                             "out at least one, or set train.eval_every=0 to train without evals")
        return chosen[process_index % len(chosen) :: process_count]
    if len(chosen) < process_count:
        more = ", cut the text into more documents (data.documents, data.window_bytes)" if source == "text" else ""
        raise ValueError(
            f"the train split has {len(chosen)} documents {counts}, fewer than the {process_count} batch rows "
            f"(train.batch_size) that each need one; use a larger corpus{more}, a smaller train.batch_size or "
            "a smaller data.eval_fraction"
        )
    return chosen[process_index::process_count]
