"""Chat rows: tokens equal transformers' apply_chat_template, loss masks per data.loss_on, packing
that keeps each conversation's mask and segment, skipped rows, resumed positions, errors."""

import json
import logging

import numpy as np
import pytest
from chat_fixtures import CONVERSATIONS, TEMPLATES, write_chat_tokenizer
from data_fixtures import take_batches
from transformers import AutoTokenizer

from podtrain.orchestrator.config.schema import DataConfig
from podtrain.orchestrator.data.chat import conversation, load_chat_template, render
from podtrain.orchestrator.data.pipeline import SkippedRows, make_dataset
from podtrain.orchestrator.data.tokenizers import ByteTokenizer, load_tokenizer


@pytest.fixture(scope="module")
def tokenizer_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    return {name: write_chat_tokenizer(root / name, template) for name, template in TEMPLATES.items()}


def ours(directory, messages, loss_on="assistant"):
    tokenizer = load_tokenizer(str(directory), eos_token="<|eot_id|>")
    return render(messages, load_chat_template(str(directory), None), tokenizer, loss_on)


@pytest.mark.parametrize("name", list(TEMPLATES))
@pytest.mark.parametrize("messages", CONVERSATIONS, ids=["one-turn", "system-two-turns", "tool"])
def test_tokens_equal_transformers_apply_chat_template(tokenizer_dirs, name, messages):
    reference = AutoTokenizer.from_pretrained(str(tokenizer_dirs[name]))
    ids, _ = ours(tokenizer_dirs[name], messages)
    expected = reference.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
    assert ids.dtype == np.int32 and ids.tolist() == expected


@pytest.mark.parametrize("messages", CONVERSATIONS, ids=["one-turn", "system-two-turns", "tool"])
def test_generation_blocks_mask_what_transformers_masks(tokenizer_dirs, messages):
    reference = AutoTokenizer.from_pretrained(str(tokenizer_dirs["skipping"]))
    _, mask = ours(tokenizer_dirs["skipping"], messages)
    expected = reference.apply_chat_template(messages, tokenize=True, return_dict=True,
                                             return_assistant_tokens_mask=True)["assistant_masks"]
    assert mask.astype(int).tolist() == expected and mask.any()


@pytest.mark.parametrize("name, end", [("llama3", "<|eot_id|>"), ("chatml", "<|im_end|>\n")])
def test_without_generation_blocks_each_assistant_turn_is_its_content_and_end(tokenizer_dirs, name, end):
    messages = CONVERSATIONS[1]
    tokenizer = load_tokenizer(str(tokenizer_dirs[name]), eos_token="<|eot_id|>")
    ids, mask = ours(tokenizer_dirs[name], messages)
    content = [m["content"].strip() if name == "llama3" else m["content"] for m in messages if m["role"] == "assistant"]
    assert tokenizer.decode(ids[mask]) == "".join(c + end for c in content)
    _, last = ours(tokenizer_dirs[name], messages, "last_assistant")
    assert tokenizer.decode(ids[last]) == content[-1] + end
    _, everything = ours(tokenizer_dirs[name], messages, "all")
    assert everything.all()


@pytest.mark.parametrize("messages", [CONVERSATIONS[0], CONVERSATIONS[2]], ids=["one-turn", "tool"])
def test_the_cookbooks_llama3_renderer_gives_the_same_tokens_and_mask(tokenizer_dirs, messages):
    """tinker-cookbook's Llama 3 renderer, which `podtrain serve` clients build SFT data with, and
    this template agree (on content without the surrounding spaces the template trims)."""
    from tinker_cookbook.renderers import TrainOnWhat, get_renderer

    renderer = get_renderer("llama3", AutoTokenizer.from_pretrained(str(tokenizer_dirs["llama3"])))
    for loss_on, train_on in (("assistant", TrainOnWhat.ALL_ASSISTANT_MESSAGES),
                              ("last_assistant", TrainOnWhat.LAST_ASSISTANT_MESSAGE)):
        tokens, weights = renderer.build_supervised_example(messages, train_on_what=train_on)
        ids, mask = ours(tokenizer_dirs["llama3"], messages, loss_on)
        assert tokens.to_ints() == ids.tolist()
        assert weights.numpy().tolist() == mask.astype(float).tolist() and mask.any()

def test_prompt_and_completion_rows_are_a_user_and_an_assistant_turn():
    assert conversation({"prompt": "Hi", "completion": "Hello"}) == [
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    prompt = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi", "name": None}]
    assert conversation({"prompt": prompt, "completion": [{"role": "assistant", "content": "Yo"}]}) == [
        prompt[0], {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]


@pytest.mark.parametrize("row, needle", [
    ({"text": "x"}, r"expected 'messages', or 'prompt' and 'completion', found keys \['text'\]"),
    ({"messages": "hi"}, "'messages' should be a list of messages, found str"),
    ({"messages": [{"content": "no role"}]}, r"'messages'\[0\] should be an object with a string 'role'"),
    ({"messages": []}, "expected at least one message"),
    ({"messages": [{"role": "narrator", "content": "x"}]}, r"'messages'\[0\]: expected a role among \['system'"),
    ({"messages": [{"role": "user", "content": 3}]}, r"'messages'\[0\] \(user\): expected string 'content', found int"),
    ([1, 2], "expected a JSON object"),
])
def test_bad_rows_say_what_was_expected(row, needle):
    with pytest.raises(ValueError, match=needle):
        conversation(row)


def write_rows(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_a_tokenizer_without_a_template_is_one_error_naming_the_key(tmp_path):
    directory = write_chat_tokenizer(tmp_path / "plain", None)
    with pytest.raises(ValueError, match=r"^data.chat_template: data.source='chat' needs a chat template and "
                                         r"data.tokenizer='.*plain' has none"):
        load_chat_template(str(directory), None)
    with pytest.raises(ValueError, match="data.chat_template='missing.jinja': expected a Jinja template file"):
        load_chat_template(str(directory), "missing.jinja")
    (tmp_path / "t.jinja").write_text(TEMPLATES["chatml"])
    template = load_chat_template(str(directory), str(tmp_path / "t.jinja"))
    assert template.render([{"role": "user", "content": "x"}]).startswith("<|im_start|>system\n")
    (tmp_path / "bad.jinja").write_text("{% for %}")
    with pytest.raises(ValueError, match=r"data.chat_template='.*bad.jinja': not a valid Jinja chat template"):
        load_chat_template(str(directory), str(tmp_path / "bad.jinja"))


BYTE_TEMPLATE = ("{% for m in messages %}{{ m['role'][0] + ':' + m['content'] + ';' }}{% endfor %}"
                 "{% if add_generation_prompt %}a:{% endif %}")


def chat_config(tmp_path, rows, **overrides):
    (tmp_path / "t.jinja").write_text(BYTE_TEMPLATE)
    path = write_rows(tmp_path / "chat.jsonl", rows)
    return DataConfig(**{"source": "chat", "path": str(path), "chat_template": str(tmp_path / "t.jinja"),
                         "eval_fraction": 0.0, "epochs": 1, "prefetch": 0, **overrides})


def turn(user, assistant):
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]}


def test_packed_conversations_keep_their_masks_and_segments(tmp_path):
    rows = [turn("ab", "cd"), turn("efg", "h"), turn("i", "jklm")]  # 10, 10 and 11 bytes: rows of 22 end in padding
    config = chat_config(tmp_path, rows, seed=0)
    batches = take_batches(make_dataset(config, ByteTokenizer(), seq_len=21, global_batch=1))
    seen = []
    for batch in batches:
        row = np.concatenate([batch["inputs"][0], batch["targets"][0, -1:]])
        segments = np.concatenate([batch["segment_ids"][0], [0]])
        for s in range(1, segments.max() + 1):
            text = bytes(row[segments == s].astype(np.uint8)).decode()
            positions = batch["positions"][0][segments[:-1] == s]
            assert positions.tolist() == list(range(len(positions)))
            trained = bytes(batch["targets"][0][(batch["weights"][0] > 0) & (batch["segment_ids"][0] == s)]
                            .astype(np.uint8)).decode()
            seen.append((text, trained))
    # whole conversations, never split; only the assistant's content and ";" are targets
    assert sorted(seen) == sorted([("u:ab;a:cd;", "cd;"), ("u:efg;a:h;", "h;"), ("u:i;a:jklm;", "jklm;")])
    assert all(b["weights"][0][b["segment_ids"][0] == 0].sum() == 0 for b in batches)


def test_without_packing_each_conversation_has_a_row_of_its_own(tmp_path):
    rows = [turn("q" * i, "a") for i in range(1, 9)]
    config = chat_config(tmp_path, rows, packing=False)
    batches = take_batches(make_dataset(config, ByteTokenizer(), seq_len=31, global_batch=1))
    assert len(batches) == 8 and all(b["segment_ids"].max() == 1 for b in batches)
    packed = take_batches(make_dataset(chat_config(tmp_path, rows), ByteTokenizer(), seq_len=31, global_batch=1))
    assert len(packed) < 4


def test_rows_without_a_trained_token_within_seq_len_are_skipped_counted_and_named_once(tmp_path, caplog):
    rows = [turn("x" * 30, "late"), turn("a", "b"), turn("y" * 30, "late")]
    config = chat_config(tmp_path, rows)
    skipped = SkippedRows()
    with caplog.at_level(logging.WARNING, logger="podtrain.orchestrator.data.pipeline"):
        batches = take_batches(make_dataset(config, ByteTokenizer(), seq_len=15, global_batch=1, skipped=skipped))
    assert skipped.count == 2
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "chat.jsonl, line " in warnings[0] and "train.seq_len=15" in warnings[0]
    trained = [bytes(b["targets"][0][b["weights"][0] > 0].astype(np.uint8)).decode() for b in batches]
    assert trained == ["b;"]


def test_a_conversation_longer_than_a_row_is_cut_and_keeps_its_start(tmp_path):
    config = chat_config(tmp_path, [turn("q", "a" * 40)])
    (batch,) = take_batches(make_dataset(config, ByteTokenizer(), seq_len=11, global_batch=1))
    row = np.concatenate([batch["inputs"][0], batch["targets"][0, -1:]])
    assert bytes(row.astype(np.uint8)).decode() == "u:q;a:aaaaaa"
    assert batch["weights"][0].tolist() == [0.0] * 5 + [1.0] * 6


def test_chat_positions_resume_exactly(tmp_path):
    rows = [turn("q" * (i % 5), "a" * (1 + i % 7)) for i in range(30)]
    config = chat_config(tmp_path, rows, epochs=None, seed=3)
    dataset = make_dataset(config, ByteTokenizer(), seq_len=24, global_batch=2)
    iterator = iter(dataset)
    for _ in range(3):
        next(iterator)
    state = json.loads(json.dumps(iterator.get_state()))
    expected = [next(iterator) for _ in range(4)]
    resumed = iter(make_dataset(config, ByteTokenizer(), seq_len=24, global_batch=2))
    resumed.set_state(state)
    for want, got in zip(expected, [next(resumed) for _ in range(4)], strict=True):
        for key in want:
            np.testing.assert_array_equal(got[key], want[key])


def test_parquet_rows_read_like_jsonl(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [turn("ab", "cd"), {"prompt": "ef", "completion": "gh"}]
    pq.write_table(pa.Table.from_pylist([{"messages": rows[0]["messages"]}]), tmp_path / "a.parquet")
    write_rows(tmp_path / "b.jsonl", rows[1:])
    (tmp_path / "t.jinja").write_text(BYTE_TEMPLATE)
    config = DataConfig(source="chat", path=str(tmp_path), chat_template=str(tmp_path / "t.jinja"),
                        eval_fraction=0.0, epochs=1, prefetch=0)
    batches = take_batches(make_dataset(config, ByteTokenizer(), seq_len=23, global_batch=1))
    trained = [bytes(b["targets"][0][b["weights"][0] > 0].astype(np.uint8)).decode() for b in batches]
    assert len(trained) == 1 and sorted(trained[0].split(";")) == ["", "cd", "gh"]


def test_a_bad_row_names_its_file_and_line(tmp_path):
    config = chat_config(tmp_path, [turn("a", "b"), {"messages": [{"content": "no role"}]}])
    with pytest.raises(ValueError, match=r"chat.jsonl, line 2: 'messages'\[0\] should be an object"):
        take_batches(make_dataset(config, ByteTokenizer(), seq_len=15, global_batch=1))


@pytest.mark.parametrize("overrides, needle", [
    ({"loss_on": "assistant", "source": "jsonl", "path": "x"}, "data.loss_on='assistant': only data.source='chat'"),
    ({"loss_on": "prompt", "source": "chat", "path": "x"}, "data.loss_on: expected one of"),
    ({"chat_template": "t.jinja"}, "data.chat_template: only data.source='chat' rows"),
    ({"add_bos": True, "source": "chat", "path": "x"}, "data.add_bos: chat rows get BOS from the chat template"),
])
def test_chat_keys_are_validated(overrides, needle):
    with pytest.raises(ValueError, match=needle):
        DataConfig(**overrides).validate()
