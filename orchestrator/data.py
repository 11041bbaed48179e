"""The training data pipeline: a corpus, tokenised and packed into fixed-length rows, batched by grain.

A corpus is a random-access sequence of documents (text, or token windows for pre-tokenised data).
Every row of the global batch has its own stream: row `r` of `train.batch_size` reads every
`batch_size`-th document of the split from the r-th on, shuffles them per epoch, tokenises each
(BOS optional, EOS always) and packs them with grain's concat-then-split into rows of `seq_len + 1`
tokens. A process reads only the streams of its own rows and interleaves them into batches, so
the global batch of every step is the same whatever the number of processes (a 2-host run sees
exactly the data of a 1-host run). A process's rows are the ones its devices hold under the batch
sharding (`process_rows`): processes that hold the same rows (a `tp` axis spanning hosts) load the
same ones. A background thread prefetches batches. A batch holds int32 `inputs`, `targets`,
`positions`, `segment_ids` and float32 `weights`, each (rows of this process, seq_len):

- `segment_ids` number the documents of a row from 1 (0 is padding), so attention stays within one;
  `positions` restart at 0 with each segment (a document cut at a row's end goes on in the next
  row as a new segment);
- `weights` are 1 where a target belongs to the same document as its input, else 0 (across a
  document boundary and on padding); padding appears only at the end of a finite number of epochs.

The iterator of the returned dataset is a grain `DatasetIterator`: `get_state()`/`set_state()`
resume it exactly. `row_positions` / `set_row_positions` express that state per global row, which is
what checkpoints keep, so a run resumes on any number of processes.
"""

from __future__ import annotations

import functools
import glob
import json
import os
import sysconfig
from collections.abc import Sequence
from pathlib import Path

import grain
import jax
import numpy as np
from jax.sharding import NamedSharding

from orchestrator.config import DataConfig
from orchestrator.tokenizers import Tokenizer

SPLITS = ("train", "eval")
_SUFFIXES = {"text": "", "jsonl": ".jsonl", "parquet": ".parquet", "array_record": ".array_record", "tokens": ".npy"}


class _FileTexts:
    """One document per file, read as UTF-8 (undecodable bytes become U+FFFD)."""

    def __init__(self, files: list[Path]):
        self.files = files

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> str:
        return self.files[i].read_bytes().decode("utf-8", errors="replace")


class _JsonlTexts:
    """One document per non-blank line of JSONL files, found through an index of line offsets."""

    def __init__(self, files: list[Path], field: str):
        self.files, self.field = files, field
        self.offsets = [_line_offsets(f) for f in files]
        self.ends = np.cumsum([len(o) for o in self.offsets])
        for f, offsets in enumerate(self.offsets):
            if len(offsets):  # a wrong text_field fails here, not hours into training
                self._read(f, 0)

    def __len__(self) -> int:
        return int(self.ends[-1])

    def __getitem__(self, i: int) -> str:
        return self._read(*_locate(self.ends, i))

    def _read(self, f: int, k: int) -> str:
        path, offset = self.files[f], int(self.offsets[f][k])
        with open(path, "rb") as fh:
            fh.seek(offset)
            line = fh.readline()
        where = lambda: f"{path}, line {_line_number(path, offset)}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where()}: expected a JSON object, found invalid JSON ({e.msg})") from None
        if not isinstance(record, dict) or self.field not in record:
            found = f"keys {sorted(record)}" if isinstance(record, dict) else type(record).__name__
            raise ValueError(f"{where()}: data.text_field={self.field!r} not found; the line has {found}")
        if not isinstance(record[self.field], str):
            kind = type(record[self.field]).__name__
            raise ValueError(f"{where()}: data.text_field={self.field!r} should hold a string, found {kind}")
        return record[self.field]


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
        self.records = grain.sources.ArrayRecordDataSource([str(f) for f in files])

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> str:
        return self.records[i].decode("utf-8", errors="replace")


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


def _line_offsets(path: Path) -> np.ndarray:
    offsets, position = [], 0
    with open(path, "rb") as fh:
        for line in fh:
            if line.strip():
                offsets.append(position)
            position += len(line)
    return np.asarray(offsets, np.int64)


def _line_number(path: Path, offset: int) -> int:
    return path.read_bytes()[:offset].count(b"\n") + 1


def _load_tokens(path: Path) -> np.ndarray:
    """A memory-mapped (streams, ids) view of a `.npy` token array."""
    array = np.load(path, mmap_mode="r")
    if array.ndim not in (1, 2) or not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"{path}: expected a 1-D or 2-D integer token array, found {array.ndim}-D {array.dtype}")
    return array.reshape(1, -1) if array.ndim == 1 else array


def _walk(root: Path, suffix: str, skip_dirs: tuple[str, ...] = ()) -> list[Path]:
    """Files under `root` ending in `suffix`, hidden entries skipped, in a deterministic order."""
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
            raise ValueError(f"data.path={path!r}: expected {suffix or 'any'} files in this directory, found none")
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
        return _FileTexts(_walk(root, ".py", skip_dirs=("site-packages", "dist-packages", "__pycache__")))
    files = _resolve_files(config.source, config.path)
    corpus = {
        "text": lambda: _FileTexts(files),
        "jsonl": lambda: _JsonlTexts(files, config.text_field),
        "parquet": lambda: _ArrowTexts(files, config.text_field),
        "array_record": lambda: _RecordTexts(files),
        "tokens": lambda: _TokenWindows(files, seq_len + 1),
    }[config.source]()
    if not len(corpus):
        unit = f"windows of train.seq_len+1={seq_len + 1} ids" if config.source == "tokens" else "documents"
        raise ValueError(f"data.path={config.path!r}: expected {unit} in {len(files)} file(s), found none")
    return corpus


def document_indices(
    num_docs: int, *, eval_fraction: float, split: str, process_index: int = 0, process_count: int = 1,
    tail: bool = False,
) -> np.ndarray:
    """The corpus indices of one share (one batch row's stream) of the train or eval split.

    Document `i` is held out for eval when `floor((i+1) * eval_fraction) > floor(i * eval_fraction)`,
    which spreads `floor(num_docs * eval_fraction)` eval documents evenly over the corpus order; with
    `tail`, the last `floor(num_docs * eval_fraction)` are (for token windows, whose documents run
    across neighbouring windows: a held-out window then borders training ones only once).
    Share `p` of `n` takes every n-th document of its split from the p-th on.

    Raises:
        ValueError: when the split is unknown or leaves a share without documents.
    """
    if split not in SPLITS:
        raise ValueError(f"split: expected one of {list(SPLITS)}, found {split!r}")
    i = np.arange(num_docs)
    if tail:
        is_eval = i >= num_docs - int(np.floor(num_docs * eval_fraction))
    else:
        is_eval = np.floor((i + 1) * eval_fraction) > np.floor(i * eval_fraction)
    chosen = i[is_eval] if split == "eval" else i[~is_eval]
    if len(chosen) < process_count:
        raise ValueError(
            f"the {split} split has {len(chosen)} documents ({num_docs} in the corpus, "
            f"data.eval_fraction={eval_fraction}), fewer than the {process_count} batch rows (train.batch_size) "
            "that each need one; use a larger corpus, a smaller train.batch_size or change data.eval_fraction"
        )
    return chosen[process_index::process_count]


def _encode(text: str, tokenizer: Tokenizer, add_bos: bool) -> dict[str, np.ndarray]:
    parts = [[tokenizer.bos_id]] if add_bos else []
    return {"tokens": np.concatenate([*parts, tokenizer.encode(text), [tokenizer.eos_id]]).astype(np.int32)}


def _positions(segment_ids: np.ndarray) -> np.ndarray:
    """Each token's offset from the start of its segment (along the last axis)."""
    index = np.broadcast_to(np.arange(segment_ids.shape[-1]), segment_ids.shape)
    starts = np.concatenate([np.ones_like(segment_ids[..., :1], bool), np.diff(segment_ids) != 0], axis=-1)
    return (index - np.maximum.accumulate(np.where(starts, index, 0), axis=-1)).astype(np.int32)


def _window_row(window: np.ndarray, tokenizer: Tokenizer) -> dict[str, np.ndarray]:
    """A pre-tokenised window as a packed row: a new segment starts after each EOS."""
    if window.min() < 0 or window.max() >= tokenizer.vocab_size:  # in the file's own dtype: nothing wrapped yet
        bad = window[(window < 0) | (window >= tokenizer.vocab_size)][0]
        raise ValueError(
            f"data.path: token id {bad} is outside the vocabulary of data.tokenizer (0..{tokenizer.vocab_size - 1})"
        )
    window = window.astype(np.int32)
    segment_ids = np.concatenate([[1], 1 + np.cumsum(window[:-1] == tokenizer.eos_id)]).astype(np.int32)
    return {"tokens": window, "tokens_segment_ids": segment_ids, "tokens_positions": _positions(segment_ids)}


def _training_batch(rows: dict[str, np.ndarray], pad_id: int) -> dict[str, np.ndarray]:
    """Packed rows of seq_len+1 tokens -> inputs, targets, positions, segment_ids, weights (B, seq_len)."""
    segment_ids = rows["tokens_segment_ids"]
    tokens = np.where(segment_ids > 0, rows["tokens"], pad_id).astype(np.int32)
    same_document = (segment_ids[:, 1:] == segment_ids[:, :-1]) & (segment_ids[:, 1:] > 0)
    return {
        "inputs": tokens[:, :-1],
        "targets": tokens[:, 1:],
        "positions": rows["tokens_positions"][:, :-1].astype(np.int32),
        "segment_ids": segment_ids[:, :-1].astype(np.int32),
        "weights": same_document.astype(np.float32),
    }


def make_dataset(
    config: DataConfig,
    tokenizer: Tokenizer,
    *,
    seq_len: int,
    global_batch: int,
    rows: range | None = None,
    split: str = "train",
) -> grain.IterDataset:
    """This process's batches of the train or eval split; `iter()` of it is a checkpointable iterator.

    The train split is shuffled with `config.seed` (a new order each epoch) and repeats `config.epochs`
    times (forever when None). The eval split keeps the corpus order and repeats forever: an eval
    takes a fixed number of batches from a fresh iterator, the same on every process.

    Args:
        config: the data config.
        tokenizer: from `orchestrator.tokenizers.load_tokenizer`; check it with `check_vocab`.
        seq_len: tokens per row (`train.seq_len`).
        global_batch: rows per step over all processes (`train.batch_size`).
        rows: the global batch rows this process loads (`process_rows`); all of them if None.
        split: "train" or "eval".

    Returns:
        A grain IterDataset of batches (dicts of numpy arrays, `len(rows)` rows).

    Raises:
        ValueError: naming the key when the corpus, split or batch geometry is not as expected.
    """
    rows = range(global_batch) if rows is None else rows
    if not rows or rows.step != 1 or rows.start < 0 or rows.stop > global_batch:
        raise ValueError(f"rows: expected consecutive rows of the {global_batch} of train.batch_size, found {rows}")
    corpus = open_corpus(config, seq_len=seq_len)
    threads = -(-config.read_threads // len(rows)) if config.read_threads else 0
    streams = [_row_stream(corpus, config, tokenizer, seq_len=seq_len, split=split, row=row,
                           rows=global_batch, read_threads=threads) for row in rows]
    batches = _ZipRows(streams, row_len=seq_len + 1).map(functools.partial(_training_batch, pad_id=tokenizer.pad_id))
    return grain.experimental.ThreadPrefetchIterDataset(batches, prefetch_buffer_size=config.prefetch)


class _ZipRows(grain.IterDataset):
    """Batch k holds row k of every stream, in stream order; a stream that has ended gives padding rows."""

    def __init__(self, streams: Sequence[grain.IterDataset], *, row_len: int):
        super().__init__(list(streams))
        self._row_len = row_len

    def __iter__(self) -> _ZipRowsIterator:
        return _ZipRowsIterator([iter(stream) for stream in self.parents], self._row_len)


class _ZipRowsIterator(grain.DatasetIterator):
    def __init__(self, parents: list[grain.DatasetIterator], row_len: int):
        super().__init__(parents)
        self._row_len = row_len
        self._ended = [False] * len(parents)

    def __next__(self) -> dict[str, np.ndarray]:
        rows = []
        for j, parent in enumerate(self._parents):
            row = None
            if not self._ended[j]:
                try:
                    row = next(parent)
                except StopIteration:
                    self._ended[j] = True
            rows.append(row)
        if all(row is None for row in rows):
            raise StopIteration
        pad = {k: np.zeros(self._row_len, np.int32) for k in ("tokens", "tokens_segment_ids", "tokens_positions")}
        rows = [pad if row is None else row for row in rows]
        return {k: np.stack([row[k] for row in rows]) for k in pad}

    def get_state(self) -> dict:
        return {"streams": [parent.get_state() for parent in self._parents], "ended": list(self._ended)}

    def set_state(self, state: dict) -> None:
        for parent, parent_state in zip(self._parents, state["streams"], strict=True):
            parent.set_state(parent_state)
        self._ended = [bool(e) for e in state["ended"]]


def _row_stream(corpus: Sequence, config: DataConfig, tokenizer: Tokenizer, *, seq_len: int, split: str, row: int,
                rows: int, read_threads: int) -> grain.IterDataset:
    """The packed rows of global batch row `row` (of `rows`): its own documents, shuffled, tokenised, packed."""
    indices = document_indices(len(corpus), eval_fraction=config.eval_fraction, split=split,
                               process_index=row, process_count=rows, tail=config.source == "tokens")
    docs = grain.MapDataset.source(indices)
    # Each row shuffles with its own seed: with one seed for all, rows of equal length would read the
    # same positions of their lists, and a batch would be B neighbouring documents of the corpus.
    row_seed = int(np.random.SeedSequence([config.seed, row]).generate_state(1)[0])
    docs = docs.shuffle(seed=row_seed).repeat(config.epochs) if split == "train" else docs.repeat(None)
    read_options = grain.ReadOptions(num_threads=read_threads, prefetch_buffer_size=4 * read_threads)
    if config.source == "tokens":
        return docs.map(lambda i: _window_row(corpus[i], tokenizer)).to_iter_dataset(read_options)
    encoded = docs.map(lambda i: _encode(corpus[i], tokenizer, config.add_bos)).to_iter_dataset(read_options)
    return grain.experimental.ConcatThenSplitIterDataset(encoded, length_struct={"tokens": seq_len + 1})


def process_rows(sharding: NamedSharding, global_batch: int) -> range:
    """The rows of a (global_batch, ...) batch that this process's devices hold under `sharding`.

    Processes whose devices hold the same rows (a batch axis not split over every process, e.g. `tp`
    spanning hosts) get the same range and so load the same data.

    Raises:
        ValueError: the process's rows are not one consecutive range (a device order that
            interleaves processes along the batch axis), which the data pipeline cannot load.
    """
    indices = sharding.addressable_devices_indices_map((global_batch, 1)).values()
    return consecutive_rows([(i[0].start or 0, global_batch if i[0].stop is None else i[0].stop) for i in indices],
                            global_batch)


def consecutive_rows(intervals: Sequence[tuple[int, int]], global_batch: int) -> range:
    """The union of row intervals `[start, stop)` as one range; ValueError if it has a gap."""
    intervals = sorted(set(intervals))
    end = intervals[0][0]
    for start, stop in intervals:
        if start > end:
            raise ValueError(f"this process's devices hold rows {intervals} of the {global_batch} of "
                             f"train.batch_size, not one consecutive range; order the mesh so that each "
                             f"process holds neighbouring batch shards")
        end = max(end, stop)
    return range(intervals[0][0], end)


def to_global_batch(local_batch: dict[str, np.ndarray], sharding: NamedSharding, global_batch: int | None = None
                    ) -> dict[str, jax.Array]:
    """Assembles every process's `local_batch` (its `process_rows`) into global arrays laid out by `sharding`.

    Each process's rows land on the batch shards its own devices hold; processes that hold the same
    rows pass the same rows. `global_batch` defaults to this process's rows (one process).
    """
    out = {}
    for key, value in local_batch.items():
        shape = (global_batch or value.shape[0], *value.shape[1:])
        out[key] = jax.make_array_from_process_local_data(sharding, value, shape)
    return out


def row_positions(iterator: grain.DatasetIterator, rows: range) -> dict[str, dict]:
    """The position of each of `rows` in an iterator of `make_dataset(..., rows=rows)`, keyed by the
    global row (as a string, for JSON): what a checkpoint keeps, independent of the process layout."""
    state = iterator.get_state()
    return {str(row): {"stream": stream, "ended": ended}
            for row, stream, ended in zip(rows, state["streams"], state["ended"], strict=True)}


def set_row_positions(iterator: grain.DatasetIterator, rows: range, positions: dict[str, dict], *,
                      global_batch: int) -> None:
    """Moves an iterator of `make_dataset(..., rows=rows)` to the positions `row_positions` recorded
    (possibly by other processes, for other rows too).

    Args:
        iterator: the iterator to move.
        rows: the global batch rows it loads.
        positions: every global row's position, as `row_positions` of all processes recorded it.
        global_batch: this run's `train.batch_size`, which the positions must have been saved with
            (row r reads documents r, r+B, ... of its split, so its stream depends on B).

    Raises:
        ValueError: the positions were saved with another global batch size, or a row of `rows` has none.
    """
    if len(positions) != global_batch:
        raise ValueError(f"the saved data position has {len(positions)} rows, but this run has train.batch_size="
                         f"{global_batch}: resume with the train.batch_size it was saved with ({len(positions)})")
    missing = [row for row in rows if str(row) not in positions]
    if missing:
        raise ValueError(f"the saved data position has {len(positions)} rows and none for rows {missing[:8]} of "
                         f"this run: resume with the train.batch_size it was saved with ({len(positions)})")
    picked = [positions[str(row)] for row in rows]
    iterator.set_state({"streams": [_stream_state(p["stream"]) for p in picked], "ended": [p["ended"] for p in picked]})


def _stream_state(state: dict) -> dict:
    """A row stream's state as grain wrote it, from its JSON form: grain's concat-then-split marks an
    empty remainder with the tuple (-1, -1) and compares with it, so the JSON list [-1, -1] would
    restore as a one-token remainder (the row would then differ from an uninterrupted run's)."""
    if "remainder_slices" not in state:
        return state
    return {**state, "remainder_slices": {k: tuple(v) for k, v in state["remainder_slices"].items()}}

