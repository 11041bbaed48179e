"""The data pipeline: every source, packing, process sharding, eval split, exact resume, errors, tokenisers."""

import dataclasses
import json

import grain
import jax
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tokenizers
from array_record.python.array_record_module import ArrayRecordWriter
from jax.sharding import NamedSharding, PartitionSpec
from omegaconf import OmegaConf

from podtrain.orchestrator.corpus import document_indices, open_corpus
from podtrain.orchestrator.data import (
    DataConfig,
    consecutive_rows,
    make_dataset,
    process_rows,
    row_positions,
    set_row_positions,
    to_global_batch,
)
from podtrain.orchestrator.tokenizers import ByteTokenizer, check_vocab, load_tokenizer

BYTE = ByteTokenizer()
DOCS = [f"document {i}: " + "xyz" * (i % 7) for i in range(20)]


def _dataset(config: DataConfig, *, seq_len=16, global_batch=2, tokenizer=BYTE, **kwargs) -> grain.IterDataset:
    return make_dataset(config, tokenizer, seq_len=seq_len, global_batch=global_batch, **kwargs)


def _batches(dataset: grain.IterDataset, n: int | None = None) -> list[dict]:
    """`n` batches (all of them when None) of a fresh iterator, which is closed afterwards."""
    iterator = iter(dataset)
    try:
        return [next(iterator) for _ in range(n)] if n else list(iterator)
    finally:
        iterator.close()


def _texts(batches: list[dict]) -> list[str]:
    """The documents in byte-tokenised batches, rebuilt from each row's stream of packed rows (padding dropped)."""
    rows = np.stack([np.concatenate([b["inputs"], b["targets"][:, -1:]], axis=1) for b in batches])
    ids = rows.transpose(1, 0, 2).ravel()  # row stream by row stream
    ids = ids[ids != BYTE.pad_id]
    ends = np.flatnonzero(ids == BYTE.eos_id)
    return [BYTE.decode(doc) for doc in np.split(ids, ends + 1)[:-1]]


def _write_text_files(root, docs=DOCS):
    root.mkdir()
    for i, doc in enumerate(docs):
        (root / f"doc{i:02d}.txt").write_text(doc)
    return root


def _write_jsonl(path, docs=DOCS, field="text"):
    path.write_text("".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return path


# Tokenisers.


def test_byte_tokenizer_round_trips_utf8_and_has_259_ids():
    text = "héllo, wörld ✓"
    ids = BYTE.encode(text)
    assert ids.dtype == np.int32 and ids.max() < 256
    assert BYTE.decode(np.concatenate([ids, [BYTE.eos_id]])) == text
    assert (BYTE.vocab_size, BYTE.pad_id, BYTE.bos_id, BYTE.eos_id) == (259, 256, 257, 258)


def test_check_vocab_names_both_sizes():
    check_vocab(BYTE, 259)
    with pytest.raises(ValueError, match=r"vocabulary \(259 ids\) exceeds model.vocab_size=256"):
        check_vocab(BYTE, 256)


@pytest.fixture
def hf_tokenizer_file(tmp_path):
    vocab = {"<unk>": 0, "</s>": 1, "<s>": 2, "hello": 3, "world": 4, "again": 5}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(["</s>", "<s>"])
    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))
    return path


def test_hf_tokenizer_json_loads_and_feeds_the_pipeline(tmp_path, hf_tokenizer_file):
    tokenizer = load_tokenizer(str(hf_tokenizer_file.parent), eos_token="</s>", bos_token="<s>")
    assert (tokenizer.vocab_size, tokenizer.eos_id, tokenizer.bos_id) == (6, 1, 2)
    assert tokenizer.encode("hello world again").tolist() == [3, 4, 5]
    assert tokenizer.decode([3, 4]) == "hello world"
    check_vocab(tokenizer, 6)
    corpus = _write_text_files(tmp_path / "docs", ["hello world", "again hello"])
    config = DataConfig(source="text", path=str(corpus), tokenizer=str(hf_tokenizer_file), eos_token="</s>",
                        bos_token="<s>", add_bos=True, eval_fraction=0.0, epochs=1)
    (batch,) = _batches(_dataset(config, tokenizer=tokenizer, seq_len=9, global_batch=1))
    row = np.concatenate([batch["inputs"][0], batch["targets"][0, -1:]])
    assert sorted([row[:4].tolist(), row[4:8].tolist()]) == [[2, 3, 4, 1], [2, 5, 3, 1]]


@pytest.mark.parametrize(
    "name, kwargs, needle",
    [
        ("missing.json", {"eos_token": "</s>"}, "data.tokenizer='missing.json': expected 'byte' or a tokenizer.json"),
        (None, {}, "data.eos_token: required with data.tokenizer="),
        (None, {"eos_token": "<eos>"}, "data.eos_token='<eos>' is not in the vocabulary"),
    ],
)
def test_tokenizer_errors_name_the_key(hf_tokenizer_file, name, kwargs, needle):
    with pytest.raises(ValueError) as info:
        load_tokenizer(name or str(hf_tokenizer_file), **kwargs)
    assert needle in str(info.value)


# Sources: one epoch gives back every training document exactly once.


def _source_config(tmp_path, source):
    if source == "text":
        return DataConfig(source="text", path=str(_write_text_files(tmp_path / "docs")))
    if source == "glob":
        _write_text_files(tmp_path / "docs")
        (tmp_path / "docs" / "skip.md").write_text("not matched")
        return DataConfig(source="text", path=str(tmp_path / "docs" / "*.txt"))
    if source == "jsonl":
        _write_jsonl(tmp_path / "a.jsonl", DOCS[:12])
        with open(_write_jsonl(tmp_path / "b.jsonl", DOCS[12:]), "a") as f:
            f.write("\n  \n")  # blank lines are skipped
        return DataConfig(source="jsonl", path=str(tmp_path))
    if source == "array_record":
        writer = ArrayRecordWriter(str(tmp_path / "docs.array_record"), "group_size:1")
        for doc in DOCS:
            writer.write(doc.encode())
        writer.close()
        return DataConfig(source="array_record", path=str(tmp_path))
    pq.write_table(pa.table({"id": range(len(DOCS)), "content": DOCS}), tmp_path / "docs.parquet", row_group_size=7)
    return DataConfig(source="parquet", path=str(tmp_path / "docs.parquet"), text_field="content")


@pytest.mark.parametrize("source", ["text", "glob", "jsonl", "parquet", "array_record"])
def test_each_text_source_yields_every_document_once_per_epoch(tmp_path, source):
    config = _source_config(tmp_path, source)
    assert sorted(open_corpus(config, seq_len=16)[i] for i in range(len(DOCS))) == sorted(DOCS)
    single = dataclasses.replace(config, eval_fraction=0.0, epochs=1)
    assert sorted(_texts(_batches(_dataset(single, global_batch=3)))) == sorted(DOCS)


@pytest.mark.parametrize("shape", [(1, 33), (3, 11)])
def test_token_arrays_are_cut_into_rows_with_segments_at_eos(tmp_path, shape):
    stream = np.arange(np.prod(shape), dtype=np.uint16).reshape(shape) % 200
    stream[..., 4] = BYTE.eos_id
    np.save(tmp_path / "tokens.npy", stream.squeeze(0) if shape[0] == 1 else stream)
    config = DataConfig(source="tokens", path=str(tmp_path), eval_fraction=0.0, epochs=1)
    batches = _batches(_dataset(config, seq_len=4, global_batch=3))
    rows = np.concatenate([np.concatenate([b["inputs"], b["targets"][:, -1:]], axis=1) for b in batches])
    windows = stream[:, : shape[1] // 5 * 5].reshape(-1, 5)
    assert sorted(map(tuple, rows)) == sorted(map(tuple, windows))
    for b in batches:
        eos_input = b["inputs"] == BYTE.eos_id
        np.testing.assert_array_equal(b["weights"], np.where(eos_input, 0.0, 1.0))
        np.testing.assert_array_equal(b["segment_ids"], 1 + np.cumsum(eos_input, axis=1) - eos_input)
        new_segment = np.diff(b["segment_ids"], axis=1) != 0
        np.testing.assert_array_equal(b["positions"][:, 1:], np.where(new_segment, 0, b["positions"][:, :-1] + 1))


# Text files: UTF-8 only, cut into documents as data.documents says.


def _text(path, **kwargs) -> DataConfig:
    return DataConfig(source="text", path=str(path), **kwargs)


def _write(path, content: str | bytes):
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return path


@pytest.mark.parametrize(
    "name, content, needle",
    [
        ("libfoo.so", b"\x7fELF\x02\x01\x01\x00" + bytes(range(256)),
         "libfoo.so: expected a UTF-8 text file, found a NUL byte at byte offset 7 (a binary file?)"),
        ("latin1.txt", "caf\u00e9\nna\u00efve".encode("latin-1"),
         "latin1.txt, line 1: expected UTF-8 text, found byte 0xe9 at column 4 (byte offset 3)"),
        ("cut.txt", b"ends inside a character \xc3",
         "cut.txt, line 1: expected UTF-8 text, found byte 0xc3 at column 25"),
        ("d.jsonl", b'{"text": 1}\n\x00\x00', "d.jsonl: expected JSON lines (UTF-8 text), found a NUL byte"),
        ("d.jsonl", b'{"text": "a"}\n{"text": "b"}\n{"text": "caf\xbe"}\n',
         "d.jsonl, line 3: expected UTF-8 text, found byte 0xbe at column 14 (byte offset 41)"),
    ],
)
def test_a_file_that_is_not_utf8_text_is_refused_when_the_corpus_opens(tmp_path, name, content, needle):
    corpus = _write_text_files(tmp_path / "docs", DOCS[:3])
    _write(corpus / name, content)
    source = "jsonl" if name.endswith(".jsonl") else "text"
    with pytest.raises(ValueError) as info:
        open_corpus(DataConfig(source=source, path=str(corpus)), seq_len=16)
    assert needle in str(info.value)


def test_text_is_decoded_strictly_when_read_and_a_character_may_straddle_the_checked_head(tmp_path):
    root = tmp_path / "docs"
    root.mkdir()
    straddling = "a" * 8191 + "\u00e9" + "b"  # the two bytes of U+00E9 are bytes 8191 and 8192
    _write(root / "a.txt", straddling)
    _write(root / "b.txt", b"x\n" * 5000 + b"y\xbez\n")  # a bad byte after the bytes checked at open
    corpus = open_corpus(_text(root), seq_len=16)
    assert corpus[0] == straddling
    with pytest.raises(ValueError, match=r"b.txt, line 5001: expected UTF-8 text, found byte 0xbe at column 2 "
                                         r"\(byte offset 10001\); convert the file to UTF-8"):
        corpus[1]
    lines = [json.dumps({"text": f"line {i}"}).encode() + b"\n" for i in range(600)]
    _write(tmp_path / "d.jsonl", b"".join(lines) + b'{"text": "\xff"}\n')
    jsonl = open_corpus(DataConfig(source="jsonl", path=str(tmp_path / "d.jsonl")), seq_len=16)
    with pytest.raises(ValueError, match=r"d.jsonl, line 601: expected UTF-8 text, found byte 0xff at column 11"):
        jsonl[600]
    writer = ArrayRecordWriter(str(tmp_path / "r.array_record"), "group_size:1")
    for record in (b"fine", b"ab\xfe"):
        writer.write(record)
    writer.close()
    records = open_corpus(DataConfig(source="array_record", path=str(tmp_path / "r.array_record")), seq_len=16)
    assert records[0] == "fine"
    with pytest.raises(ValueError, match=r"r.array_record, record 1: expected UTF-8 text, found byte 0xfe at byte 2"):
        records[1]


def test_the_stdlib_source_reads_files_in_other_encodings_leniently(tmp_path, monkeypatch):
    """A few of Python's own test files are Latin-1 or KOI8-R: the default corpus keeps them as they read."""
    _write(tmp_path / "module_iso_8859_1.py", "# caf\u00e9\n".encode("latin-1"))
    monkeypatch.setattr("podtrain.orchestrator.corpus.sysconfig.get_paths", lambda: {"stdlib": str(tmp_path)})
    assert list(open_corpus(DataConfig(), seq_len=16)) == ["# caf\ufffd\n"]


PLAY = ("First Citizen:\nBefore we proceed any further, hear me speak.\n\n  \t\nAll:\r\nSpeak, speak.\r\n\r\n\n\n"
        "First Citizen:\n  You are all resolved rather to die than to famish?   \n")
SCENES = ["First Citizen:\nBefore we proceed any further, hear me speak.", "All:\r\nSpeak, speak.",
          "First Citizen:\n  You are all resolved rather to die than to famish?"]


@pytest.mark.parametrize("documents", ["auto", "paragraphs"])
def test_one_file_with_blank_lines_is_cut_into_paragraphs_and_trains(tmp_path, documents):
    config = _text(_write(tmp_path / "play.txt", "\n \n" + PLAY), documents=documents, eval_fraction=0.0, epochs=1)
    assert list(open_corpus(config, seq_len=16)) == SCENES
    assert sorted(_texts(_batches(_dataset(config, global_batch=3)))) == sorted(SCENES)


def test_several_files_are_one_document_each_unless_cut_explicitly(tmp_path):
    root = _write_text_files(tmp_path / "docs", [PLAY, "one\n\ntwo\n"])
    assert list(open_corpus(_text(root), seq_len=16)) == [PLAY, "one\n\ntwo\n"]
    assert list(open_corpus(_text(root, documents="paragraphs"), seq_len=16)) == [*SCENES, "one", "two"]


def test_windows_end_after_their_last_newline_or_before_a_cut_character(tmp_path):
    # bytes: a b \n c d e [U+00E9: 2 bytes] f g; the second window would end inside U+00E9.
    small = _text(_write(tmp_path / "small.txt", "ab\ncde\u00e9fg"), documents="windows", window_bytes=4)
    assert list(open_corpus(small, seq_len=16)) == ["ab\n", "cde", "\u00e9fg"]
    line = "na\u00efve caf\u00e9 \u2713 \U0001f600 " * 9  # 1-, 2-, 3- and 4-byte characters
    text = "".join(line[: 40 + 7 * i] + ("\n" if i % 3 else "") for i in range(60))
    config = _text(_write(tmp_path / "prose.txt", text), window_bytes=64)  # auto: no blank line, so windows
    docs = list(open_corpus(config, seq_len=16))
    assert "".join(docs) == text and len(docs) > 60
    start = 0
    for doc in docs[:-1]:
        piece = text.encode()[start : start + 64]
        assert len(doc.encode()) <= 64
        assert doc.endswith("\n") == (b"\n" in piece), (start, doc)
        start += len(doc.encode())


def test_one_file_as_one_document_cannot_fill_the_batch_rows(tmp_path):
    config = _text(_write(tmp_path / "play.txt", PLAY), documents="file")
    with pytest.raises(ValueError, match=r"the train split has 1 documents \(1 in the corpus, data.eval_fraction="
                                         r"0.01\), fewer than the 4 batch rows .*\(data.documents, "):
        _dataset(config, global_batch=4)
    assert len(open_corpus(dataclasses.replace(config, documents="auto"), seq_len=16)) == 3


# Packing.


@pytest.mark.parametrize("add_bos", [False, True])
def test_packing_two_documents_by_hand(tmp_path, add_bos):
    corpus = _write_text_files(tmp_path / "docs", ["ab", "cd"])
    config = DataConfig(source="text", path=str(corpus), eval_fraction=0.0, epochs=1, add_bos=add_bos)
    seq_len = 4 if add_bos else 3
    # One batch row: its stream packs both documents into two consecutive rows.
    batches = _batches(_dataset(config, seq_len=seq_len, global_batch=1))
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
    config = DataConfig(source="jsonl", path=str(_write_jsonl(tmp_path / "d.jsonl")), eval_fraction=0.0, epochs=2)
    batches = _batches(_dataset(config, seq_len=16, global_batch=4))
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
    assert sorted(_texts(batches)) == sorted(DOCS * 2)


def test_epochs_are_reshuffled_with_the_seed(tmp_path):
    config = DataConfig(source="jsonl", path=str(_write_jsonl(tmp_path / "d.jsonl")), eval_fraction=0.0, epochs=2)
    texts = _texts(_batches(_dataset(config, global_batch=1)))
    assert texts[:20] != texts[20:] and sorted(texts[:20]) == sorted(texts[20:]) == sorted(DOCS)
    assert texts == _texts(_batches(_dataset(config, global_batch=1)))
    other_seed = dataclasses.replace(config, seed=1)
    assert texts != _texts(_batches(_dataset(other_seed, global_batch=1)))


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
    config = DataConfig(source="jsonl", path=str(_write_jsonl(tmp_path / "d.jsonl")), eval_fraction=0.2, epochs=1)
    per_process = []
    for p in range(2):
        batches = _batches(_dataset(config, global_batch=4, rows=range(2 * p, 2 * p + 2)))
        assert batches[0]["inputs"].shape == (2, 16)
        per_process.append(set(_texts(batches)))
    held = set(_texts(_batches(_dataset(config, global_batch=1, split="eval"), 20)))
    assert not per_process[0] & per_process[1] and not held & (per_process[0] | per_process[1])
    assert per_process[0] | per_process[1] | held == set(DOCS) and len(held) == 4


def test_an_eval_split_smaller_than_the_batch_is_shared_by_the_rows(tmp_path):
    """Documents 4 and 9 are held out: row r of 8 reads eval document r mod 2 (the eval stream repeats)."""
    assert [document_indices(10, eval_fraction=0.2, split="eval", process_index=r, process_count=8).tolist()
            for r in range(8)] == [[4], [9]] * 4
    config = DataConfig(source="jsonl", path=str(_write_jsonl(tmp_path / "d.jsonl", DOCS[:10])), eval_fraction=0.2)
    (batch,) = _batches(_dataset(config, global_batch=8, split="eval"), 1)
    assert [BYTE.decode(row) for row in batch["inputs"]] == [DOCS[4][:16], DOCS[9][:16]] * 4


@pytest.mark.parametrize("eval_fraction", [0.0, 0.01])
def test_an_empty_eval_split_names_both_keys(tmp_path, eval_fraction):
    config = DataConfig(source="jsonl", path=str(_write_jsonl(tmp_path / "d.jsonl")), eval_fraction=eval_fraction)
    with pytest.raises(ValueError, match=rf"^the eval split has no documents \(20 in the corpus, data.eval_fraction="
                                         rf"{eval_fraction}\): raise data.eval_fraction .* set train.eval_every=0"):
        _dataset(config, split="eval")
    assert _batches(_dataset(config), 1)[0]["inputs"].shape == (2, 16)


# Resume.


@pytest.mark.parametrize("prefetch, read_threads", [(0, 0), (2, 2)])
def test_restored_iterator_continues_with_identical_batches(tmp_path, prefetch, read_threads):
    docs = ["x" * n + f" doc {n}" for n in np.random.default_rng(0).integers(0, 40, 30)]
    config = DataConfig(source="jsonl", path=str(_write_jsonl(tmp_path / "d.jsonl", docs)), prefetch=prefetch,
                        read_threads=read_threads)
    iterator = iter(_dataset(config))
    for _ in range(7):
        next(iterator)
    state = json.loads(json.dumps(iterator.get_state()))
    expected = [next(iterator) for _ in range(25)]  # past the end of the first epoch
    iterator.close()
    restored = iter(_dataset(config))
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
    config = DataConfig(source="jsonl", path=str(_write_jsonl(tmp_path / "d.jsonl", docs)), prefetch=2)
    whole = iter(_dataset(config, global_batch=4))
    halves = [iter(_dataset(config, global_batch=4, rows=range(2 * p, 2 * p + 2))) for p in range(2)]
    for _ in range(5):
        got = [next(half) for half in halves]
        want = next(whole)
        np.testing.assert_array_equal(np.concatenate([g["inputs"] for g in got]), want["inputs"])
    saved = {**row_positions(halves[0], range(0, 2)), **row_positions(halves[1], range(2, 4))}
    assert sorted(saved) == ["0", "1", "2", "3"]
    one = iter(_dataset(config, global_batch=4))
    set_row_positions(one, range(4), json.loads(json.dumps(saved)), global_batch=4)
    expected = [next(whole) for _ in range(6)]
    for want in expected[:3]:
        np.testing.assert_array_equal(next(one)["inputs"], want["inputs"])
    back = [iter(_dataset(config, global_batch=4, rows=range(2 * p, 2 * p + 2))) for p in range(2)]
    for p, it in enumerate(back):
        set_row_positions(it, range(2 * p, 2 * p + 2), row_positions(one, range(4)), global_batch=4)
    for want in expected[3:]:
        np.testing.assert_array_equal(np.concatenate([next(it)["inputs"] for it in back]), want["inputs"])
    with pytest.raises(ValueError, match=r"has 4 rows, but this run has train.batch_size=6: .* saved with \(4\)"):
        set_row_positions(iter(_dataset(config, global_batch=6, rows=range(4, 6))), range(4, 6), saved, global_batch=6)
    for it in [whole, *halves, one, *back]:
        it.close()


def test_positions_saved_with_another_batch_size_are_refused(tmp_path):
    """Row r reads documents r, r+B, ...: with B=2 the positions of B=4's rows 0 and 1 point into other lists."""
    config = DataConfig(source="jsonl", path=str(_write_jsonl(tmp_path / "d.jsonl")))
    four = iter(_dataset(config, global_batch=4))
    next(four)
    saved = json.loads(json.dumps(row_positions(four, range(4))))
    expected = next(four)
    two = iter(_dataset(config, global_batch=2))
    with pytest.raises(ValueError, match=r"^the saved data position has 4 rows, but this run has train.batch_size=2: "
                                         r"resume with the train.batch_size it was saved with \(4\)$"):
        set_row_positions(two, range(2), saved, global_batch=2)
    again = iter(_dataset(config, global_batch=4))
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
    config = DataConfig(source="jsonl", path=str(_write_jsonl(tmp_path / "d.jsonl", docs)), eval_fraction=0.0)
    for batch in _batches(_dataset(config, seq_len=11, global_batch=8), 3):
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
    dataset = _dataset(DataConfig(source="jsonl", path=str(_write_jsonl(tmp_path / "d.jsonl"))))
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
    train, held = _batches(_dataset(config, seq_len=64), 2), _batches(_dataset(config, seq_len=64, split="eval"), 1)
    assert train[1]["inputs"].shape == held[0]["inputs"].shape == (2, 64)
    assert train[1]["weights"].sum() > 0 and held[0]["weights"].sum() > 0


def test_to_global_batch_places_rows_with_the_sharding():
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    sharding = NamedSharding(mesh, PartitionSpec("data", None))
    local = {"inputs": np.arange(8 * 4, dtype=np.int32).reshape(8, 4), "weights": np.ones((8, 4), np.float32)}
    batch = to_global_batch(local, sharding)
    assert batch["inputs"].sharding == sharding and batch["weights"].dtype == np.float32
    np.testing.assert_array_equal(np.asarray(batch["inputs"]), local["inputs"])


# Errors name the key or file, what was expected and what was found.


def _saved(path, write) -> str:
    write(path)
    return str(path)


ERROR_CASES = {
    "missing path": (lambda t: DataConfig(source="text", path=str(t / "nope")), "expected a file, directory or glob"),
    "glob matches nothing": (lambda t: DataConfig(source="text", path=str(t / "*.txt")), "matched none"),
    "empty directory": (lambda t: DataConfig(source="jsonl", path=str(t)), "expected .jsonl files in this directory"),
    "empty corpus": (lambda t: DataConfig(source="jsonl", path=str(_write_jsonl(t / "d.jsonl", []))),
                     "expected documents in 1 file(s), found none"),
    "jsonl without the field": (
        lambda t: DataConfig(source="jsonl", path=str(_write_jsonl(t / "d.jsonl", DOCS[:2], field="body"))),
        "d.jsonl, line 1: data.text_field='text' not found; the line has keys ['body', 'id']"),
    "invalid json": (lambda t: DataConfig(source="jsonl", path=_saved(t / "d.jsonl", lambda p: p.write_text("{oops"))),
                     "d.jsonl, line 1: expected a JSON object, found invalid JSON"),
    "parquet without the column": (
        lambda t: DataConfig(
            source="parquet", path=_saved(t / "x.parquet", lambda p: pq.write_table(pa.table({"body": ["a"]}), p))
        ),
        "data.text_field='text' is not a column; found columns ['body']"),
    "float tokens": (
        lambda t: DataConfig(source="tokens", path=_saved(t / "x.npy", lambda p: np.save(p, np.zeros(9)))),
        "expected a 1-D or 2-D integer token array, found 1-D float64"),
    "too few tokens": (
        lambda t: DataConfig(source="tokens", path=_saved(t / "x.npy", lambda p: np.save(p, np.zeros(16, int)))),
        "expected windows of train.seq_len+1=17 ids in 1 file(s), found none"),
    "unknown source": (lambda t: DataConfig(source="csv"), "data.source: expected one of"),
    "path for stdlib": (lambda t: DataConfig(path="x"), "data.path: data.source='stdlib' takes no path"),
    "no path": (lambda t: DataConfig(source="jsonl"), "data.path: data.source='jsonl' takes a file, directory"),
    "eval fraction": (lambda t: DataConfig(eval_fraction=1.0), "data.eval_fraction: expected a number in [0, 1)"),
    "bos without a token": (lambda t: DataConfig(tokenizer="t.json", eos_token="</s>", add_bos=True),
                            "data.bos_token: required with data.add_bos=true"),
    "unknown documents": (lambda t: DataConfig(source="text", path=str(t), documents="pages"),
                          "data.documents: expected one of ['auto', 'file', 'paragraphs', 'windows'], found 'pages'"),
    "documents of jsonl": (lambda t: DataConfig(source="jsonl", path=str(t), documents="paragraphs"),
                           "data.documents='paragraphs': only data.source='text' files are cut into documents, "
                           "data.source='jsonl' has its own"),
    "window of stdlib": (lambda t: DataConfig(window_bytes=512), "data.window_bytes=512: only data.source='text'"),
    "tiny windows": (lambda t: DataConfig(source="text", path=str(t), window_bytes=3),
                     "data.window_bytes: expected at least 4 bytes (the longest UTF-8 character), found 3"),
    "negative seed": (lambda t: DataConfig(seed=-1), "data.seed: expected an integer >= 0, found -1"),
}


@pytest.mark.parametrize("case", ERROR_CASES)
def test_bad_data_input_is_a_clear_error(tmp_path, case):
    make_config, needle = ERROR_CASES[case]
    with pytest.raises(ValueError) as info:
        _dataset(make_config(tmp_path))
    assert needle in str(info.value)


def test_token_ids_beyond_int32_are_reported_as_they_are_in_the_file(tmp_path):
    tokens = np.arange(64, dtype=np.uint32)
    tokens[::8] = 2**31 + 5  # in every window; would wrap to a negative int32
    np.save(tmp_path / "t.npy", tokens)
    dataset = _dataset(DataConfig(source="tokens", path=str(tmp_path / "t.npy"), eval_fraction=0.0, prefetch=0),
                       global_batch=1)
    with pytest.raises(ValueError, match=r"token id 2147483653 is outside the vocabulary of data.tokenizer"):
        _batches(dataset, 1)


def test_a_bad_line_after_the_first_fails_when_read(tmp_path):
    (tmp_path / "d.jsonl").write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"txt": "bad"}) + "\n")
    dataset = _dataset(DataConfig(source="jsonl", path=str(tmp_path / "d.jsonl"), eval_fraction=0.0, prefetch=1))
    with pytest.raises(ValueError, match=r"d.jsonl, line 2: data.text_field='text' not found; the line has keys"):
        _batches(dataset, 1)


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"global_batch": 4, "rows": range(2, 6)}, "rows: expected consecutive rows of the 4 of train.batch_size, "
                                                  "found range(2, 6)"),
        ({"split": "test"}, "split: expected one of ['train', 'eval']"),
        ({"rows": range(1000, 1001), "global_batch": 2000}, "fewer than the 2000 batch rows"),
    ],
)
def test_bad_split_or_batch_geometry_is_a_clear_error(kwargs, needle):
    with pytest.raises(ValueError) as info:
        _dataset(DataConfig(), **kwargs)
    assert needle in str(info.value)
