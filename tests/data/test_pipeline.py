"""The data pipeline: packing, process sharding, the eval split, exact resume, global batches."""

import dataclasses
import json

import grain
import jax
import numpy as np
import pytest
from data_fixtures import BYTE, DOCS, batch_texts, open_dataset, take_batches, write_jsonl, write_text_files
from jax.sharding import NamedSharding, PartitionSpec
from omegaconf import OmegaConf

from podtrain.orchestrator.data.corpus import document_indices, open_corpus
from podtrain.orchestrator.data.pipeline import (
    DataConfig,
    consecutive_rows,
    process_rows,
    row_positions,
    set_row_positions,
    to_global_batch,
)

# Packing.


@pytest.mark.parametrize("add_bos", [False, True])
def test_packing_two_documents_by_hand(tmp_path, add_bos):
    corpus = write_text_files(tmp_path / "docs", ["ab", "cd"])
    config = DataConfig(source="text", path=str(corpus), eval_fraction=0.0, epochs=1, add_bos=add_bos)
    seq_len = 4 if add_bos else 3
    # One batch row: its stream packs both documents into two consecutive rows.
    batches = take_batches(open_dataset(config, seq_len=seq_len, global_batch=1))
    assert len(batches) == 2
    batch = {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}
    first, second = ("ab", "cd") if BYTE.decode(batch["inputs"][0]).startswith("a") else ("cd", "ab")
    bos = [BYTE.bos_id] if add_bos else []
    x, y = [*bos, *BYTE.encode(first)], [*bos, *BYTE.encode(second)]
    e, p = BYTE.eos_id, BYTE.pad_id
    tokens = np.array([x + [e] + y[:1], y[1:] + [e, p, p]])  # rows of seq_len + 1 tokens
    np.testing.assert_array_equal(batch["inputs"], tokens[:, :-1])
    np.testing.assert_array_equal(batch["targets"], tokens[:, 1:])
    n = len(x)
    np.testing.assert_array_equal(batch["segment_ids"], [[1] * (n + 1), [1] * n + [0]])
    np.testing.assert_array_equal(batch["positions"], [list(range(n + 1)), list(range(n)) + [0]])
    np.testing.assert_array_equal(batch["weights"], [[1] * n + [0], [1] * (n - 1) + [0, 0]])


def test_packed_rows_restart_positions_per_document_and_never_weigh_across_one(tmp_path):
    config = DataConfig(source="jsonl", path=str(write_jsonl(tmp_path / "d.jsonl")), eval_fraction=0.0, epochs=2)
    batches = take_batches(open_dataset(config, seq_len=16, global_batch=4))
    for b in batches:
        assert {k: (v.shape, v.dtype) for k, v in b.items()} == {
            **{k: ((4, 16), np.int32) for k in ("inputs", "targets", "positions", "segment_ids")},
            "weights": ((4, 16), np.float32),
        }
        seg, pos = b["segment_ids"], b["positions"]
        new_segment = np.diff(seg, axis=1) != 0
        np.testing.assert_array_equal(new_segment, b["inputs"][:, :-1] == BYTE.eos_id)
        np.testing.assert_array_equal(pos[:, 1:], np.where(new_segment | (seg[:, 1:] == 0), 0, pos[:, :-1] + 1))
        np.testing.assert_array_equal(b["inputs"][:, 1:], b["targets"][:, :-1])
        crosses = (b["inputs"] == BYTE.eos_id) | (b["targets"] == BYTE.pad_id)
        np.testing.assert_array_equal(b["weights"], np.where(crosses, 0.0, 1.0))
    assert sorted(batch_texts(batches)) == sorted(DOCS * 2)


def test_epochs_are_reshuffled_with_the_seed(tmp_path):
    config = DataConfig(source="jsonl", path=str(write_jsonl(tmp_path / "d.jsonl")), eval_fraction=0.0, epochs=2)
    texts = batch_texts(take_batches(open_dataset(config, global_batch=1)))
    assert texts[:20] != texts[20:] and sorted(texts[:20]) == sorted(texts[20:]) == sorted(DOCS)
    assert texts == batch_texts(take_batches(open_dataset(config, global_batch=1)))
    other_seed = dataclasses.replace(config, seed=1)
    assert texts != batch_texts(take_batches(open_dataset(other_seed, global_batch=1)))


# Sharding by process and the eval split.


def test_document_indices_split_and_shard_disjointly_and_cover_the_corpus():
    shares = lambda split: [
        document_indices(103, eval_fraction=0.1, split=split, process_index=p, process_count=3) for p in range(3)
    ]
    train, held = shares("train"), shares("eval")
    everything = np.concatenate(train + held)
    assert sorted(everything) == list(range(103))
    assert sum(map(len, held)) == 10 and max(map(len, train)) - min(map(len, train)) <= 1


def test_processes_read_disjoint_documents_that_cover_the_split(tmp_path):
    config = DataConfig(source="jsonl", path=str(write_jsonl(tmp_path / "d.jsonl")), eval_fraction=0.2, epochs=1)
    per_process = []
    for p in range(2):
        batches = take_batches(open_dataset(config, global_batch=4, rows=range(2 * p, 2 * p + 2)))
        assert batches[0]["inputs"].shape == (2, 16)
        per_process.append(set(batch_texts(batches)))
    held = set(batch_texts(take_batches(open_dataset(config, global_batch=1, split="eval"), 20)))
    assert not per_process[0] & per_process[1] and not held & (per_process[0] | per_process[1])
    assert per_process[0] | per_process[1] | held == set(DOCS) and len(held) == 4


def test_an_eval_split_smaller_than_the_batch_is_shared_by_the_rows(tmp_path):
    """Documents 4 and 9 are held out: row r of 8 reads eval document r mod 2 (the eval stream repeats)."""
    assert [document_indices(10, eval_fraction=0.2, split="eval", process_index=r, process_count=8).tolist()
            for r in range(8)] == [[4], [9]] * 4
    config = DataConfig(source="jsonl", path=str(write_jsonl(tmp_path / "d.jsonl", DOCS[:10])), eval_fraction=0.2)
    (batch,) = take_batches(open_dataset(config, global_batch=8, split="eval"), 1)
    assert [BYTE.decode(row) for row in batch["inputs"]] == [DOCS[4][:16], DOCS[9][:16]] * 4


@pytest.mark.parametrize("eval_fraction", [0.0, 0.01])
def test_an_empty_eval_split_names_both_keys(tmp_path, eval_fraction):
    config = DataConfig(source="jsonl", path=str(write_jsonl(tmp_path / "d.jsonl")), eval_fraction=eval_fraction)
    with pytest.raises(ValueError, match=rf"^the eval split has no documents \(20 in the corpus, data.eval_fraction="
                                         rf"{eval_fraction}\): raise data.eval_fraction .* set train.eval_every=0"):
        open_dataset(config, split="eval")
    assert take_batches(open_dataset(config), 1)[0]["inputs"].shape == (2, 16)


# Resume.


@pytest.mark.parametrize("prefetch, read_threads", [(0, 0), (2, 2)])
def test_restored_iterator_continues_with_identical_batches(tmp_path, prefetch, read_threads):
    docs = ["x" * n + f" doc {n}" for n in np.random.default_rng(0).integers(0, 40, 30)]
    config = DataConfig(source="jsonl", path=str(write_jsonl(tmp_path / "d.jsonl", docs)), prefetch=prefetch,
                        read_threads=read_threads)
    iterator = iter(open_dataset(config))
    for _ in range(7):
        next(iterator)
    state = json.loads(json.dumps(iterator.get_state()))
    expected = [next(iterator) for _ in range(25)]  # past the end of the first epoch
    iterator.close()
    restored = iter(open_dataset(config))
    restored.set_state(state)
    for want in expected:
        got = next(restored)
        for key in want:
            np.testing.assert_array_equal(got[key], want[key])
    restored.close()


def test_row_positions_of_two_processes_resume_one_process_and_back(tmp_path):
    """Positions are kept per global row, so a run saved by 2 processes (2 rows each) resumes on 1
    process (4 rows), and one saved by 1 resumes on 2, with the batches an uninterrupted run reads."""
    docs = ["y" * n + f" doc {n}" for n in np.random.default_rng(1).integers(0, 30, 40)]
    config = DataConfig(source="jsonl", path=str(write_jsonl(tmp_path / "d.jsonl", docs)), prefetch=2)
    whole = iter(open_dataset(config, global_batch=4))
    halves = [iter(open_dataset(config, global_batch=4, rows=range(2 * p, 2 * p + 2))) for p in range(2)]
    for _ in range(5):
        got = [next(half) for half in halves]
        want = next(whole)
        np.testing.assert_array_equal(np.concatenate([g["inputs"] for g in got]), want["inputs"])
    saved = {**row_positions(halves[0], range(0, 2)), **row_positions(halves[1], range(2, 4))}
    assert sorted(saved) == ["0", "1", "2", "3"]
    one = iter(open_dataset(config, global_batch=4))
    set_row_positions(one, range(4), json.loads(json.dumps(saved)), global_batch=4)
    expected = [next(whole) for _ in range(6)]
    for want in expected[:3]:
        np.testing.assert_array_equal(next(one)["inputs"], want["inputs"])
    back = [iter(open_dataset(config, global_batch=4, rows=range(2 * p, 2 * p + 2))) for p in range(2)]
    for p, it in enumerate(back):
        set_row_positions(it, range(2 * p, 2 * p + 2), row_positions(one, range(4)), global_batch=4)
    for want in expected[3:]:
        np.testing.assert_array_equal(np.concatenate([next(it)["inputs"] for it in back]), want["inputs"])
    other = iter(open_dataset(config, global_batch=6, rows=range(4, 6)))
    with pytest.raises(ValueError, match=r"has 4 rows, but this run has train.batch_size=6: .* saved with \(4\)"):
        set_row_positions(other, range(4, 6), saved, global_batch=6)
    for it in [whole, *halves, one, *back, other]:
        it.close()


def test_positions_saved_with_another_batch_size_are_refused(tmp_path):
    """Row r reads documents r, r+B, ...: with B=2 the positions of B=4's rows 0 and 1 point into other lists."""
    config = DataConfig(source="jsonl", path=str(write_jsonl(tmp_path / "d.jsonl")))
    four = iter(open_dataset(config, global_batch=4))
    next(four)
    saved = json.loads(json.dumps(row_positions(four, range(4))))
    expected = next(four)
    two = iter(open_dataset(config, global_batch=2))
    with pytest.raises(ValueError, match=r"^the saved data position has 4 rows, but this run has train.batch_size=2: "
                                         r"resume with the train.batch_size it was saved with \(4\)$"):
        set_row_positions(two, range(2), saved, global_batch=2)
    again = iter(open_dataset(config, global_batch=4))
    set_row_positions(again, range(4), saved, global_batch=4)
    np.testing.assert_array_equal(next(again)["inputs"], expected["inputs"])
    for it in [four, two, again]:
        it.close()


def test_token_windows_hold_out_the_corpus_tail_for_eval():
    """Documents run across neighbouring token windows: the held-out windows are one block at the end,
    not windows spread between training ones."""
    held = document_indices(100, eval_fraction=0.1, split="eval", tail=True)
    train = np.concatenate([document_indices(100, eval_fraction=0.1, split="train", process_index=p, process_count=3,
                                             tail=True) for p in range(3)])
    assert held.tolist() == list(range(90, 100)) and sorted(train.tolist()) == list(range(90))


def test_a_batch_mixes_documents_from_all_over_the_corpus(tmp_path):
    """Row r reads documents r, r + B, r + 2B, ... in its own shuffled order: the rows of one batch
    are not B neighbouring documents (as they were when every row shuffled with the same seed)."""
    docs = [f"document {i:02d}" for i in range(64)]  # 11 bytes + EOS: one document per row of 11
    config = DataConfig(source="jsonl", path=str(write_jsonl(tmp_path / "d.jsonl", docs)), eval_fraction=0.0)
    for batch in take_batches(open_dataset(config, seq_len=11, global_batch=8), 3):
        numbers = [int(bytes(row[9:11].tolist()).decode()) for row in batch["inputs"]]
        assert [n % 8 for n in numbers] == list(range(8))  # row r holds a document r + kB
        assert len({n // 8 for n in numbers}) > 2, numbers  # from several places of the corpus


def test_process_rows_follow_the_batch_sharding():
    mesh = jax.make_mesh((4, 2), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    assert process_rows(NamedSharding(mesh, PartitionSpec("fsdp", None)), 8) == range(8)  # one process: all rows
    # Devices of one process holding rows [0, 2) and [2, 4) twice (a tp pair): rows 0-3.
    assert consecutive_rows([(0, 2), (0, 2), (2, 4), (2, 4)], 8) == range(0, 4)
    with pytest.raises(ValueError, match=r"rows \[\(0, 2\), \(4, 6\)\] of the 8 of train.batch_size, not one"):
        consecutive_rows([(0, 2), (4, 6)], 8)


def test_iterator_checkpoints_inside_an_orbax_composite(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    dataset = open_dataset(DataConfig(source="jsonl", path=str(write_jsonl(tmp_path / "d.jsonl"))))
    iterator = iter(dataset)
    for _ in range(3):
        next(iterator)
    with ocp.CheckpointManager(tmp_path / "ckpt") as manager:
        manager.save(3, args=ocp.args.Composite(data=grain.checkpoint.CheckpointSave(iterator)))
        manager.wait_until_finished()
        expected = next(iterator)
        restored = iter(dataset)
        manager.restore(3, args=ocp.args.Composite(data=grain.checkpoint.CheckpointRestore(restored)))
    np.testing.assert_array_equal(next(restored)["inputs"], expected["inputs"])
    iterator.close()
    restored.close()


# The embedded default and global arrays.


def test_stdlib_default_yields_batches_and_fits_the_config_schema():
    config = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(DataConfig), {"epochs": 2}))
    assert config == DataConfig(epochs=2) and config.source == "stdlib"
    assert len(open_corpus(config, seq_len=64)) > 100
    train = take_batches(open_dataset(config, seq_len=64), 2)
    held = take_batches(open_dataset(config, seq_len=64, split="eval"), 1)
    assert train[1]["inputs"].shape == held[0]["inputs"].shape == (2, 64)
    assert train[1]["weights"].sum() > 0 and held[0]["weights"].sum() > 0


def test_to_global_batch_places_rows_with_the_sharding():
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    sharding = NamedSharding(mesh, PartitionSpec("data", None))
    local = {"inputs": np.arange(8 * 4, dtype=np.int32).reshape(8, 4), "weights": np.ones((8, 4), np.float32)}
    batch = to_global_batch(local, sharding)
    assert batch["inputs"].sharding == sharding and batch["weights"].dtype == np.float32
    np.testing.assert_array_equal(np.asarray(batch["inputs"]), local["inputs"])
