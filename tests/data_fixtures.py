"""What the data tests share: a small corpus, a byte tokenizer and helpers that read batches back."""

import json

import grain
import numpy as np

from podtrain.orchestrator.data.pipeline import DataConfig, make_dataset
from podtrain.orchestrator.data.tokenizers import ByteTokenizer

BYTE = ByteTokenizer()
DOCS = [f"document {i}: " + "xyz" * (i % 7) for i in range(20)]


def open_dataset(config: DataConfig, *, seq_len=16, global_batch=2, tokenizer=BYTE, **kwargs) -> grain.IterDataset:
    return make_dataset(config, tokenizer, seq_len=seq_len, global_batch=global_batch, **kwargs)


def take_batches(dataset: grain.IterDataset, n: int | None = None) -> list[dict]:
    """`n` batches (all of them when None) of a fresh iterator, which is closed afterwards."""
    iterator = iter(dataset)
    try:
        return [next(iterator) for _ in range(n)] if n else list(iterator)
    finally:
        iterator.close()


def batch_texts(batches: list[dict]) -> list[str]:
    """The documents in byte-tokenised batches, rebuilt from each row's stream of packed rows (padding dropped)."""
    rows = np.stack([np.concatenate([b["inputs"], b["targets"][:, -1:]], axis=1) for b in batches])
    ids = rows.transpose(1, 0, 2).ravel()  # row stream by row stream
    ids = ids[ids != BYTE.pad_id]
    ends = np.flatnonzero(ids == BYTE.eos_id)
    return [BYTE.decode(doc) for doc in np.split(ids, ends + 1)[:-1]]


def write_text_files(root, docs=DOCS):
    root.mkdir()
    for i, doc in enumerate(docs):
        (root / f"doc{i:02d}.txt").write_text(doc)
    return root


def write_jsonl(path, docs=DOCS, field="text"):
    path.write_text("".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return path
