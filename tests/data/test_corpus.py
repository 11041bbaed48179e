"""The corpus: every source, text files checked and cut into documents, and input errors that name the file."""

import dataclasses
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from array_record.python.array_record_module import ArrayRecordWriter
from data_fixtures import BYTE, DOCS, batch_texts, open_dataset, take_batches, write_jsonl, write_text_files

from podtrain.orchestrator.data.corpus import open_corpus
from podtrain.orchestrator.data.pipeline import DataConfig

# Sources: one epoch gives back every training document exactly once.


def _source_config(tmp_path, source):
    if source == "text":
        return DataConfig(source="text", path=str(write_text_files(tmp_path / "docs")))
    if source == "glob":
        write_text_files(tmp_path / "docs")
        (tmp_path / "docs" / "skip.md").write_text("not matched")
        return DataConfig(source="text", path=str(tmp_path / "docs" / "*.txt"))
    if source == "jsonl":
        write_jsonl(tmp_path / "a.jsonl", DOCS[:12])
        with open(write_jsonl(tmp_path / "b.jsonl", DOCS[12:]), "a") as f:
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
    assert sorted(batch_texts(take_batches(open_dataset(single, global_batch=3)))) == sorted(DOCS)


@pytest.mark.parametrize("shape", [(1, 33), (3, 11)])
def test_token_arrays_are_cut_into_rows_with_segments_at_eos(tmp_path, shape):
    stream = np.arange(np.prod(shape), dtype=np.uint16).reshape(shape) % 200
    stream[..., 4] = BYTE.eos_id
    np.save(tmp_path / "tokens.npy", stream.squeeze(0) if shape[0] == 1 else stream)
    config = DataConfig(source="tokens", path=str(tmp_path), eval_fraction=0.0, epochs=1)
    batches = take_batches(open_dataset(config, seq_len=4, global_batch=3))
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
    corpus = write_text_files(tmp_path / "docs", DOCS[:3])
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
    monkeypatch.setattr("podtrain.orchestrator.data.corpus.sysconfig.get_paths", lambda: {"stdlib": str(tmp_path)})
    assert list(open_corpus(DataConfig(), seq_len=16)) == ["# caf\ufffd\n"]


PLAY = ("First Citizen:\nBefore we proceed any further, hear me speak.\n\n  \t\nAll:\r\nSpeak, speak.\r\n\r\n\n\n"
        "First Citizen:\n  You are all resolved rather to die than to famish?   \n")
SCENES = ["First Citizen:\nBefore we proceed any further, hear me speak.", "All:\r\nSpeak, speak.",
          "First Citizen:\n  You are all resolved rather to die than to famish?"]


@pytest.mark.parametrize("documents", ["auto", "paragraphs"])
def test_one_file_with_blank_lines_is_cut_into_paragraphs_and_trains(tmp_path, documents):
    config = _text(_write(tmp_path / "play.txt", "\n \n" + PLAY), documents=documents, eval_fraction=0.0, epochs=1)
    assert list(open_corpus(config, seq_len=16)) == SCENES
    assert sorted(batch_texts(take_batches(open_dataset(config, global_batch=3)))) == sorted(SCENES)


def test_several_files_are_one_document_each_unless_cut_explicitly(tmp_path):
    root = write_text_files(tmp_path / "docs", [PLAY, "one\n\ntwo\n"])
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
        open_dataset(config, global_batch=4)
    assert len(open_corpus(dataclasses.replace(config, documents="auto"), seq_len=16)) == 3


# Errors name the key or file, what was expected and what was found.


def _saved(path, write) -> str:
    write(path)
    return str(path)


ERROR_CASES = {
    "missing path": (lambda t: DataConfig(source="text", path=str(t / "nope")), "expected a file, directory or glob"),
    "glob matches nothing": (lambda t: DataConfig(source="text", path=str(t / "*.txt")), "matched none"),
    "empty directory": (lambda t: DataConfig(source="jsonl", path=str(t)), "expected .jsonl files in this directory"),
    "empty corpus": (lambda t: DataConfig(source="jsonl", path=str(write_jsonl(t / "d.jsonl", []))),
                     "expected documents in 1 file(s), found none"),
    "jsonl without the field": (
        lambda t: DataConfig(source="jsonl", path=str(write_jsonl(t / "d.jsonl", DOCS[:2], field="body"))),
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
        open_dataset(make_config(tmp_path))
    assert needle in str(info.value)


def test_token_ids_beyond_int32_are_reported_as_they_are_in_the_file(tmp_path):
    tokens = np.arange(64, dtype=np.uint32)
    tokens[::8] = 2**31 + 5  # in every window; would wrap to a negative int32
    np.save(tmp_path / "t.npy", tokens)
    dataset = open_dataset(DataConfig(source="tokens", path=str(tmp_path / "t.npy"), eval_fraction=0.0, prefetch=0),
                       global_batch=1)
    with pytest.raises(ValueError, match=r"token id 2147483653 is outside the vocabulary of data.tokenizer"):
        take_batches(dataset, 1)


def test_a_bad_line_after_the_first_fails_when_read(tmp_path):
    (tmp_path / "d.jsonl").write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"txt": "bad"}) + "\n")
    dataset = open_dataset(DataConfig(source="jsonl", path=str(tmp_path / "d.jsonl"), eval_fraction=0.0, prefetch=1))
    with pytest.raises(ValueError, match=r"d.jsonl, line 2: data.text_field='text' not found; the line has keys"):
        take_batches(dataset, 1)


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
        open_dataset(DataConfig(), **kwargs)
    assert needle in str(info.value)
