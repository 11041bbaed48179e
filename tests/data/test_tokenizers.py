"""Tokenisers: the byte tokenizer, an HF tokenizer.json feeding the pipeline, vocabulary checks,
errors that name the key."""

import numpy as np
import pytest
import tokenizers
from data_fixtures import BYTE, open_dataset, take_batches, write_text_files

from podtrain.orchestrator.data.pipeline import DataConfig
from podtrain.orchestrator.data.tokenizers import check_vocab, load_tokenizer


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
    corpus = write_text_files(tmp_path / "docs", ["hello world", "again hello"])
    config = DataConfig(source="text", path=str(corpus), tokenizer=str(hf_tokenizer_file), eos_token="</s>",
                        bos_token="<s>", add_bos=True, eval_fraction=0.0, epochs=1)
    (batch,) = take_batches(open_dataset(config, tokenizer=tokenizer, seq_len=9, global_batch=1))
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
