"""The engine's work items packed into padded host arrays, and sampled rows read back: each row
(a datum of a forward/backward pass, or one sample) takes its adapter's slot, rank and scale, its
loss or sampling settings and its tokens; row and token counts are padded to powers of two so that
few shapes are compiled."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from podtrain.orchestrator.serve import losses
from podtrain.orchestrator.serve.programs import Batch, SampleBatch, bucket

# The smallest padded token count of a training row or a prompt.
MIN_TOKENS = 16


def train_batch(works, chunk, loaded, alpha: float) -> Batch:
    """The rows `chunk` ((item index, datum index, datum) each) of forward/backward items as one
    padded batch; `loaded`: model id -> its `LoadedAdapter` (in a device slot)."""
    b = bucket(len(chunk))
    t = bucket(max(len(d.tokens) for _, _, d in chunk), MIN_TOKENS)
    arrays = {name: np.zeros((b, t), np.float32) for name in ("weights", "sampling_lp", "advantages", "real")}
    tokens, targets = np.zeros((b, t), np.int32), np.zeros((b, t), np.int32)
    per_row = {name: np.zeros(b, np.float32) for name in ("scale", "low", "high", "beta", "train")}
    slot_ix, rank, loss_ix = np.zeros(b, np.int32), np.ones(b, np.int32), np.zeros(b, np.int32)
    per_row["scale"][:] = 1.0
    for r, (index, _, datum) in enumerate(chunk):
        work, n = works[index], len(datum.tokens)
        slot = loaded[work.model_id]
        config = losses.loss_config(work.loss_fn, work.loss_fn_config)
        tokens[r, :n], targets[r, :n] = datum.tokens, datum.inputs["target_tokens"]
        arrays["weights"][r, :n] = datum.inputs.get("weights", 1.0) if work.loss_fn == "cross_entropy" else 0.0
        arrays["sampling_lp"][r, :n] = datum.inputs.get("logprobs", 0.0)
        arrays["advantages"][r, :n] = datum.inputs.get("advantages", 0.0)
        arrays["real"][r, :n] = 1.0
        slot_ix[r], rank[r], loss_ix[r] = slot.index, slot.rank, losses.NAMES.index(work.loss_fn)
        per_row["scale"][r] = alpha / slot.rank
        per_row["low"][r] = config.get("clip_low_threshold", 0.0)
        per_row["high"][r] = config.get("clip_high_threshold", 0.0)
        per_row["beta"][r] = config.get("beta", 0.0)
        per_row["train"][r] = 1.0 if work.backward else 0.0
    return Batch(tokens=tokens, targets=targets, slot=slot_ix, rank=rank, loss=loss_ix, **arrays, **per_row)


class Samples(NamedTuple):
    """Sampling rows packed: the batch, each item's stop sequences, the padded count of new tokens,
    whether any row filters (top-k or top-p) and whether any item wants its prompt's logprobs."""

    batch: SampleBatch
    stops: dict[int, list[tuple[int, ...]]]
    new_tokens: int
    filtered: bool
    prompt_logprobs: bool


def sample_batch(works, chunk, loaded, alpha: float, seed: Callable[[object, int], int]) -> Samples:
    """The rows `chunk` ((item index, sample number) each) of sample items as one padded batch;
    `seed(work, k)` is sample k's seed."""
    b = bucket(len(chunk))
    p = bucket(max(len(works[i].prompt) for i, _ in chunk), MIN_TOKENS)
    new = bucket(max(works[i].max_tokens for i, _ in chunk), MIN_TOKENS)
    row_stops = {i: works[i].all_stops() for i, _ in chunk}
    stops = bucket(max([len(v) for v in row_stops.values()] + [1]), 8)
    longest = bucket(max([len(q) for v in row_stops.values() for q in v] + [1]))
    prompt = np.zeros((b, p), np.int32)
    length, slot_ix, rank, top_k = (np.ones(b, np.int32) for _ in range(4))
    slot_ix[:], top_k[:] = 0, 0
    scale, temperature, top_p = np.zeros(b, np.float32), np.zeros(b, np.float32), np.ones(b, np.float32)
    seeds, stop, max_tokens = np.zeros(b, np.int32), np.full((b, stops, longest), -1, np.int32), np.ones(b, np.int32)
    for r, (index, k) in enumerate(chunk):
        work = works[index]
        n = len(work.prompt)
        prompt[r, :n], length[r] = work.prompt, n
        if work.model_id is not None:
            slot = loaded[work.model_id]
            slot_ix[r], rank[r], scale[r] = slot.index, slot.rank, alpha / slot.rank
        temperature[r], top_p[r] = work.temperature, work.top_p
        top_k[r] = max(work.top_k, 0)
        seeds[r] = seed(work, k)
        for j, sequence in enumerate(row_stops[index]):
            stop[r, j, longest - len(sequence):] = sequence
        max_tokens[r] = work.max_tokens
    batch = SampleBatch(prompt=prompt, length=length, slot=slot_ix, scale=scale, rank=rank, temperature=temperature,
                        top_k=top_k, top_p=top_p, seed=seeds, stop=stop, max_tokens=max_tokens)
    filtered = bool(np.any(top_k[:len(chunk)] > 0) or np.any(top_p[:len(chunk)] < 1))
    return Samples(batch, row_stops, new, filtered, any(works[i].prompt_logprobs for i, _ in chunk))


def stop_at(row: list[int], stops: list[tuple[int, ...]]) -> int | None:
    """The length of `row` up to and including the first stop sequence it ends with, or None."""
    return next((i for i in range(1, len(row) + 1) if any(
        i >= len(q) and tuple(row[i - len(q):i]) == q for q in stops)), None)
