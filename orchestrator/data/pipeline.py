"""The training data pipeline: a corpus, tokenised and packed into fixed-length rows, batched by grain.

The corpus (`data.corpus`) is a random-access sequence of documents. Every row of the
global batch has its own stream: row `r` of `train.batch_size` reads every `batch_size`-th
document of the split from the r-th on, shuffles them per epoch, tokenises each
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

Chat rows (`data.source=chat`) are rendered with the chat template (`data.chat`) and carry a loss mask:
a target weighs 1 only where its token is one the loss trains on (`data.loss_on`). They are packed
whole, never split across rows (grain's first-fit packing; the rest of a row is padding): a
conversation longer than a row is cut to `seq_len + 1` tokens, and one left with no token to train
on is skipped, counted in `SkippedRows` and named in one warning.

The iterator of the returned dataset is a grain `DatasetIterator`: `get_state()`/`set_state()`
resume it exactly. `row_positions` / `set_row_positions` express that state per global row, which is
what checkpoints keep, so a run resumes on any number of processes.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Sequence

import grain
import jax
import numpy as np
from jax.sharding import NamedSharding

from podtrain.orchestrator.config.schema import DataConfig
from podtrain.orchestrator.data.chat import ChatTemplate, chat_row, load_chat_template
from podtrain.orchestrator.data.corpus import document_indices, open_corpus
from podtrain.orchestrator.data.tokenizers import Tokenizer

logger = logging.getLogger(__name__)
_PACKING_BINS = 8  # rows a chat stream fills at once: more bins, less padding


class SkippedRows:
    """Counts the chat rows skipped for having no token to train on within a row; warns at the first."""

    def __init__(self):
        self.count, self._lock = 0, threading.Lock()

    def add(self, where: Callable[[], str], seq_len: int, loss_on: str) -> None:
        """Counts a skipped row; `where()` names it (found only for the first: it may read the file)."""
        with self._lock:
            self.count += 1
            first = self.count == 1
        if first:
            logger.warning("data: %s has no token to train on (data.loss_on=%s) within train.seq_len=%d; "
                           "it and rows like it are skipped and counted", where(), loss_on, seq_len)


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
    if "mask" in rows:  # chat rows: only the tokens the loss trains on are targets
        same_document &= rows["mask"][:, 1:] > 0
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
    corpus: Sequence | None = None,
    skipped: SkippedRows | None = None,
) -> grain.IterDataset:
    """This process's batches of the train or eval split; `iter()` of it is a checkpointable iterator.

    The train split is shuffled with `config.seed` (a new order each epoch) and repeats `config.epochs`
    times (forever when None). The eval split keeps the corpus order and repeats forever: an eval
    takes a fixed number of batches from a fresh iterator, the same on every process.

    Args:
        config: the data config.
        tokenizer: from `data.tokenizers.load_tokenizer`; check it with `check_vocab`.
        seq_len: tokens per row (`train.seq_len`).
        global_batch: rows per step over all processes (`train.batch_size`).
        rows: the global batch rows this process loads (`process_rows`); all of them if None.
        split: "train" or "eval".
        corpus: `open_corpus(config, seq_len=seq_len)` when the caller opened it already.
        skipped: counts the chat rows skipped for having no token to train on.

    Returns:
        A grain IterDataset of batches (dicts of numpy arrays, `len(rows)` rows).

    Raises:
        ValueError: naming the key when the corpus, split or batch geometry is not as expected.
    """
    rows = range(global_batch) if rows is None else rows
    if not rows or rows.step != 1 or rows.start < 0 or rows.stop > global_batch:
        raise ValueError(f"rows: expected consecutive rows of the {global_batch} of train.batch_size, found {rows}")
    corpus = open_corpus(config, seq_len=seq_len) if corpus is None else corpus
    threads = -(-config.read_threads // len(rows)) if config.read_threads else 0
    chat = None
    if config.source == "chat":
        chat = (load_chat_template(config.tokenizer, config.chat_template), skipped or SkippedRows())
    streams = [_row_stream(corpus, config, tokenizer, seq_len=seq_len, split=split, row=row,
                           rows=global_batch, read_threads=threads, chat=chat) for row in rows]
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
        pad = {k: np.zeros(self._row_len, np.int32) for k in next(row for row in rows if row is not None)}
        rows = [pad if row is None else row for row in rows]
        return {k: np.stack([row[k] for row in rows]) for k in pad}

    def get_state(self) -> dict:
        return {"streams": [parent.get_state() for parent in self._parents], "ended": list(self._ended)}

    def set_state(self, state: dict) -> None:
        for parent, parent_state in zip(self._parents, state["streams"], strict=True):
            parent.set_state(parent_state)
        self._ended = [bool(e) for e in state["ended"]]


def _row_stream(corpus: Sequence, config: DataConfig, tokenizer: Tokenizer, *, seq_len: int, split: str, row: int,
                rows: int, read_threads: int, chat: tuple[ChatTemplate, SkippedRows] | None) -> grain.IterDataset:
    """The packed rows of global batch row `row` (of `rows`): its own documents, shuffled, tokenised, packed."""
    indices = document_indices(len(corpus), eval_fraction=config.eval_fraction, split=split,
                               process_index=row, process_count=rows, tail=config.source == "tokens",
                               source=config.source)
    docs = grain.MapDataset.source(indices)
    # Each row shuffles with its own seed: with one seed for all, rows of equal length would read the
    # same positions of their lists, and a batch would be B neighbouring documents of the corpus.
    row_seed = int(np.random.SeedSequence([config.seed, row]).generate_state(1)[0])
    docs = docs.shuffle(seed=row_seed).repeat(config.epochs) if split == "train" else docs.repeat(None)
    read_options = grain.ReadOptions(num_threads=read_threads, prefetch_buffer_size=4 * read_threads)
    if config.source == "tokens":
        return docs.map(lambda i: _window_row(corpus[i], tokenizer)).to_iter_dataset(read_options)
    if chat is not None:
        return _chat_rows(docs, corpus, tokenizer, *chat, loss_on=config.loss_on or "assistant", row_len=seq_len + 1,
                          share=len(indices), packing=config.packing, read_options=read_options)
    encoded = docs.map(lambda i: _encode(corpus[i], tokenizer, config.add_bos)).to_iter_dataset(read_options)
    return grain.experimental.ConcatThenSplitIterDataset(encoded, length_struct={"tokens": seq_len + 1})


def _chat_rows(docs: grain.MapDataset, corpus: Sequence, tokenizer: Tokenizer, template: ChatTemplate,
               skipped: SkippedRows, *, loss_on: str, row_len: int, share: int, packing: bool,
               read_options: grain.ReadOptions) -> grain.IterDataset:
    """Chat rows rendered, cut to a row, and packed whole into rows of `row_len` tokens (one a row
    without `packing`); `share` is the number of distinct rows the stream reads (a whole pass of
    skipped ones is an error, not a hang)."""

    in_a_row = [0]  # rows skipped since the last one kept: a whole pass of them would loop forever

    def encode(i):
        ids, mask = chat_row(corpus, i, template, tokenizer, loss_on)
        ids, mask = ids[:row_len], mask[:row_len]
        if mask[1:].any():  # the first token is never a target
            in_a_row[0] = 0
            return {"tokens": ids, "mask": mask.astype(np.int32)}
        skipped.add(lambda: corpus.where(i), row_len - 1, loss_on)
        in_a_row[0] += 1
        if in_a_row[0] >= share:
            raise ValueError(f"data: none of the {share} chat rows of a batch row's share has a token to train on "
                             f"(data.loss_on={loss_on}) within train.seq_len={row_len - 1}, {corpus.where(i)} "
                             "among them; raise train.seq_len or shorten the prompts")
        return None

    encoded = docs.map(encode).filter(lambda row: row is not None).to_iter_dataset(read_options)
    packed = grain.experimental.FirstFitPackIterDataset(
        encoded, length_struct={"tokens": row_len, "mask": row_len}, num_packing_bins=_PACKING_BINS if packing else 1,
        shuffle_bins=False, max_sequences_per_bin=None if packing else 1)
    return packed.map(lambda r: {k: r[k] for k in ("tokens", "tokens_segment_ids", "tokens_positions", "mask")})


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
