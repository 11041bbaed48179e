"""Batches of uniformly random tokens: what `podtrain check` trains on, with no dataset to read."""

from __future__ import annotations

import jax
import numpy as np

from podtrain.orchestrator.train.build import Training


def random_batch(training: Training, seed: int = 0) -> dict[str, jax.Array]:
    """A (train.batch_size, train.seq_len) batch of tokens drawn uniformly below `model.vocab_size`,
    one document per row, placed with the run's batch sharding."""
    t, vocab = training.config.train, training.config.model.vocab_size
    tokens = np.random.default_rng(seed).integers(0, vocab, (t.batch_size, t.seq_len + 1), dtype=np.int32)
    batch = {
        "inputs": tokens[:, :-1],
        "targets": tokens[:, 1:],
        "weights": np.ones((t.batch_size, t.seq_len), np.float32),
        "positions": np.broadcast_to(np.arange(t.seq_len, dtype=np.int32), (t.batch_size, t.seq_len)),
        "segment_ids": np.ones((t.batch_size, t.seq_len), np.int32),
    }
    # Each process places only the rows its devices hold (multi-process correct).
    return {
        k: jax.make_array_from_callback(v.shape, training.batch_sharding, lambda index, v=v: v[index])
        for k, v in batch.items()
    }
