"""Chat SFT through `podtrain train`: the loss trains on the assistant tokens only, evals use the same
mask, and a tokenizer without a chat template is one line naming the key."""

import json
import random
import subprocess

import numpy as np
import pytest
from chat_fixtures import write_chat_tokenizer
from train_fixtures import ROOT, command, env

from podtrain.orchestrator.config.compose import load_config
from podtrain.orchestrator.data.pipeline import make_dataset, to_global_batch
from podtrain.orchestrator.data.tokenizers import ByteTokenizer
from podtrain.orchestrator.train.build import build_training

TEMPLATE = ("{% for m in messages %}{{ '<' + m['role'] + '>' + m['content'] + '\\n' }}{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


def write_chat_data(tmp_path):
    rows = [{"messages": [{"role": "user", "content": f"what is {i} + {i}?"},
                          {"role": "assistant", "content": f"{i} + {i} = {2 * i}"}]} for i in range(40)]
    rows += [{"prompt": f"count to {i}", "completion": " ".join(map(str, range(1, i + 1)))} for i in range(1, 9)]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    (tmp_path / "chat.jinja").write_text(TEMPLATE)
    return ["data.source=chat", f"data.path={path}", f"data.chat_template={tmp_path / 'chat.jinja'}",
            "data.eval_fraction=0.1", "train.eval_every=2", "train.eval_batches=1", "train.seq_len=64"]


def chat_command(run_dir, steps, *extra):
    """`podtrain train` of the tiny model with `extra` overrides replacing its own of the same keys."""
    keys = {arg.partition("=")[0] for arg in extra}
    return [arg for arg in command(run_dir, steps) if arg.partition("=")[0] not in keys] + list(extra)


def run_chat(run_dir, steps, *extra):
    return subprocess.run(chat_command(run_dir, steps, *extra), cwd=ROOT, env=env(), capture_output=True, text=True,
                          timeout=300)


def test_sft_trains_on_assistant_tokens_only_and_evals_with_the_same_mask(tmp_path):
    data = write_chat_data(tmp_path)
    run_dir = tmp_path / "sft"
    out = run_chat(run_dir, 4, *data)
    assert out.returncode == 0, out.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    config = load_config("llama3-tiny", [a for a in chat_command(run_dir, 4, *data) if "=" in a])
    batches = iter(make_dataset(config.data, ByteTokenizer(), seq_len=config.train.seq_len,
                                global_batch=config.train.batch_size))
    trained = [int(next(batches)["weights"].sum()) for _ in records]
    assert [r["loss_tokens"] for r in records] == trained
    assert 0 < max(trained) < config.train.batch_size * config.train.seq_len / 2  # prompts are not trained
    assert all(np.isfinite(r["eval_loss"]) for r in records if r["step"] % 2 == 0)
    assert "loss first" in out.stdout


def test_rows_that_never_reach_an_assistant_token_are_one_line_not_a_hang(tmp_path):
    data = [arg for arg in write_chat_data(tmp_path) if not arg.startswith("train.seq_len=")] + ["train.seq_len=16"]
    done = run_chat(tmp_path / "r", 2, *data)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1].startswith("podtrain: error: data: none of the ") \
        and "within train.seq_len=16" in done.stderr and "Traceback" not in done.stderr


def test_a_tokenizer_without_a_chat_template_is_one_line_naming_the_key(tmp_path):
    directory = write_chat_tokenizer(tmp_path / "tok", None)
    data = [arg for arg in write_chat_data(tmp_path) if not arg.startswith("data.chat_template=")]
    data += [f"data.tokenizer={directory}", "data.eos_token=<|eot_id|>", "model.vocab_size=512"]
    done = run_chat(tmp_path / "r", 2, *data)
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "data.chat_template: data.source='chat' needs a chat template" in lines[0]


ANSWER = "The answer is yes."


def write_fixed_answers(tmp_path):
    """User turns of random letters, each answered with the same sentence."""
    rng = random.Random(0)
    rows = [{"messages": [{"role": "user", "content": "".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=16))},
                          {"role": "assistant", "content": ANSWER}]} for _ in range(256)]
    path = tmp_path / "fixed.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    (tmp_path / "chat.jinja").write_text(TEMPLATE)
    return ["data.source=chat", f"data.path={path}", f"data.chat_template={tmp_path / 'chat.jinja'}",
            "data.eval_fraction=0", "train.eval_every=0", "train.seq_len=64", "checkpoint.every_steps=1000",
            "optimizer.learning_rate=3e-3", "optimizer.schedule=constant"]


@pytest.mark.slow
@pytest.mark.parametrize("loss_on", ["assistant", "all"])
def test_the_mask_trains_the_fixed_answer_only(tmp_path, loss_on):
    """Black box: the answer is learnable, the random prompts are not, so only a loss that sees
    the answer alone can reach zero."""
    run_dir = tmp_path / loss_on
    done = run_chat(run_dir, 200, *write_fixed_answers(tmp_path), f"data.loss_on={loss_on}")
    assert done.returncode == 0, done.stderr[-3000:]
    losses = [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    if loss_on == "assistant":
        assert min(losses) < 0.05, losses[-10:]
    else:
        assert min(losses) > 0.5, losses[-10:]


STEP = ["model.num_layers=2", "model.hidden_size=64", "model.intermediate_size=128", "model.vocab_size=384",
        "model.head_dim=16", "train.batch_size=8", "train.seq_len=64", "optimizer.name=sgd", "optimizer.momentum=0",
        "optimizer.weight_decay=0", "optimizer.schedule=constant", "optimizer.learning_rate=1.0",
        "optimizer.grad_clip=1e9"]


def masked_losses(data, overrides, steps=3):
    config = load_config("llama3-tiny", STEP + data + overrides)
    training = build_training(config)
    state = training.init_state()
    batches = iter(make_dataset(config.data, ByteTokenizer(), seq_len=config.train.seq_len,
                                global_batch=config.train.batch_size))
    losses, tokens = [], []
    for _ in range(steps):
        batch = to_global_batch(next(batches), training.batch_sharding, config.train.batch_size)
        state, metrics = training.step(state, batch)
        losses.append(float(metrics["loss"]))
        tokens.append(int(metrics["tokens"]))
    return losses, tokens


@pytest.mark.slow
def test_masked_losses_are_the_same_on_other_meshes_and_with_micro_batches(tmp_path):
    data = [arg for arg in write_chat_data(tmp_path) if not arg.startswith(("train.", "data.eval"))]
    data += ["data.eval_fraction=0"]
    want, tokens = masked_losses(data, ["mesh.fsdp=8"])
    got, got_tokens = masked_losses(data, ["mesh.dp=2", "mesh.fsdp=2", "mesh.tp=2", "train.grad_accum=2"])
    assert got_tokens == tokens and len(set(tokens)) > 1  # rows of uneven trained counts
    np.testing.assert_allclose(got, want, rtol=2e-5)
