"""`podtrain export`: a trained run's weights as HF files transformers loads, its tokenizer along,
and errors that name `out`, `step` or the checkpoint before any work."""

import json
import subprocess
import sys

import pytest
from train_fixtures import ROOT, TINY, env, export, train


def cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "podtrain.launch.cli", *args], cwd=ROOT, env=env(),
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_export_writes_the_trained_weights_as_hf_files_transformers_loads(tmp_path):
    import dataclasses

    import jax
    import numpy as np
    import torch
    from flax import nnx
    from transformers import AutoModelForCausalLM

    from podtrain.models import from_hf
    from podtrain.orchestrator.checkpoint.checkpointer import Checkpointer
    from podtrain.orchestrator.config.compose import load_config
    from podtrain.orchestrator.train.build import build_training

    run_dir = tmp_path / "run"
    train(run_dir, 4)
    out = tmp_path / "hf"
    # Trained on fsdp=2, exported from step 2 on a (fsdp=1, tp=2) mesh.
    done = export(run_dir, out, "step=2", "mesh.fsdp=1", "mesh.tp=2")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "exported step 2" in done.stdout and (out / "config.json").exists()
    assert "(data.tokenizer=byte has no HF tokenizer files)" in done.stdout

    config = load_config("llama3-tiny", TINY)
    config = dataclasses.replace(config, mesh=dataclasses.replace(config.mesh, fsdp=1))
    training = build_training(config, jax.devices()[:1])
    with Checkpointer(run_dir / "checkpoints", config.checkpoint) as ckpt:
        trained, _, _ = ckpt.restore_params(training.abstract_params, step=2)
    _, exported = from_hf(out)
    want = {k: np.asarray(v.get_value()) for k, v in nnx.to_flat_state(trained)}
    got = {k: np.asarray(v.get_value()) for k, v in nnx.to_flat_state(nnx.state(exported, nnx.Param))}
    assert want.keys() == got.keys()
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=str(key))

    tokens = np.random.default_rng(0).integers(0, 384, (2, 16))
    ours = np.asarray(exported(jax.numpy.asarray(tokens))[0])
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    # The byte tokenizer's BOS / EOS, so that generate() in transformers stops where training ended documents.
    assert (hf.generation_config.bos_token_id, hf.generation_config.eos_token_id) == (257, 258)
    with torch.no_grad():
        theirs = hf(torch.from_numpy(tokens)).logits.numpy()
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)

    done = export(run_dir, tmp_path / "other", "model.rms_norm_eps=1e-6", "model.remat=none")
    assert done.returncode == 2, done.stderr[-3000:]
    assert "model.rms_norm_eps: checkpoint has 1e-05, config has 1e-06" in done.stderr
    assert f"Pass -c the preset or YAML file it was trained with (the run's resolved config: {run_dir}/config.yaml)" \
        in done.stderr
    assert "remat" not in done.stderr
    assert not (tmp_path / "other").exists()


@pytest.mark.parametrize("add_bos", [True, False])
def test_export_takes_the_training_tokenizer_along(tmp_path, add_bos):
    """A tokenizer.json run: transformers' AutoTokenizer on the exported files encodes as training did."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer

    from podtrain.launch.export import tokenizer_export
    from podtrain.orchestrator.config.compose import load_config
    from podtrain.orchestrator.data.tokenizers import load_tokenizer

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 16)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}",
                                                                "add_bos_token": False}))
    config = load_config("llama3-tiny", [f"data.tokenizer={tmp_path / 'tokenizer.json'}", "data.eos_token=</s>",
                                         "data.bos_token=<s>", f"data.add_bos={str(add_bos).lower()}"])
    config_extra, files = tokenizer_export(config)
    assert config_extra == {"eos_token_id": 2, "bos_token_id": 1}
    out = tmp_path / "out"
    out.mkdir()
    for name, data in files.items():
        (out / name).write_bytes(data)
    theirs = AutoTokenizer.from_pretrained(out)
    ours = load_tokenizer(config.data.tokenizer, eos_token="</s>", bos_token="<s>")
    assert theirs("w3 w4 w5").input_ids == [1] * add_bos + ours.encode("w3 w4 w5").tolist()
    assert (theirs.eos_token, theirs.bos_token, theirs.pad_token) == ("</s>", "<s>", "</s>")
    assert theirs.chat_template == "{{ messages }}"


def test_a_chat_run_exports_the_template_its_rows_were_rendered_with(tmp_path):
    from chat_fixtures import CONVERSATIONS, TEMPLATES, write_chat_tokenizer
    from transformers import AutoTokenizer

    from podtrain.launch.export import tokenizer_export
    from podtrain.orchestrator.config.compose import load_config
    from podtrain.orchestrator.data.chat import load_chat_template, render
    from podtrain.orchestrator.data.tokenizers import load_tokenizer

    directory = write_chat_tokenizer(tmp_path / "tok", TEMPLATES["llama3"])
    (tmp_path / "chatml.jinja").write_text(TEMPLATES["chatml"])
    (tmp_path / "chat.jsonl").write_text("")
    config = load_config("llama3-tiny", ["data.source=chat", f"data.path={tmp_path / 'chat.jsonl'}",
                                         f"data.tokenizer={directory}", "data.eos_token=<|eot_id|>",
                                         f"data.chat_template={tmp_path / 'chatml.jinja'}"])
    _, files = tokenizer_export(config)
    out = tmp_path / "out"
    out.mkdir()
    for name, data in files.items():
        (out / name).write_bytes(data)
    theirs = AutoTokenizer.from_pretrained(out)
    ids, _ = render(CONVERSATIONS[1], load_chat_template(str(directory), str(tmp_path / "chatml.jinja")),
                    load_tokenizer(str(directory), eos_token="<|eot_id|>"), "assistant")
    assert theirs.apply_chat_template(CONVERSATIONS[1], tokenize=True, return_dict=True)["input_ids"] == ids.tolist()


def test_export_errors_name_the_problem(tmp_path):
    done = export(tmp_path / "missing", tmp_path / "hf")
    assert done.returncode == 2 and "no such directory" in done.stderr and "Traceback" not in done.stderr
    done = cli("export", "-c", "llama3-tiny", f"out={tmp_path}")
    assert done.returncode == 2 and "checkpoint=<dir>" in done.stderr


@pytest.mark.parametrize("out, step, needle", [
    ("a-file", None, "out={out}: is a file; expected a new or empty directory"),
    ("a-file/hf", None, "out={out}: lies under {tmp_path}/a-file, which is a file; expected a new or empty directory"),
    ("/proc/podtrain/hf", None, "out={out}: cannot create a directory in /proc/podtrain (No such file or directory)"),
    ("hf", "4", "checkpoint={checkpoint} is the folder of step 2, but step=4; give the step folder or step=, not both"),
    ("hf", "-1", "export.step: expects a step number >= 0 or null (the newest), found -1"),
])
def test_export_errors_name_out_and_step_before_any_work(tmp_path, capsys, out, step, needle):
    from podtrain.launch.cli import main

    checkpoint = tmp_path / "run" / "checkpoints" / "2"
    (checkpoint / "state").mkdir(parents=True)  # the layout of a committed step; nothing is read before the errors
    (tmp_path / "a-file").write_text("kept\n")
    out = out if out.startswith("/") else tmp_path / out
    extra = [f"step={step}"] if step else []
    assert main(["export", "-c", "llama3-tiny", f"checkpoint={checkpoint}", f"out={out}", *extra]) == 2
    err = capsys.readouterr().err
    assert err == f"podtrain: error: {needle.format(out=out, tmp_path=tmp_path, checkpoint=checkpoint)}\n"
    assert (tmp_path / "a-file").read_text() == "kept\n" and not (tmp_path / "hf").exists()


def test_a_tied_heads_adapter_is_not_merged_into_an_hf_export(tmp_path, capsys):
    from podtrain.launch.cli import main

    checkpoint = tmp_path / "run" / "checkpoints" / "2"
    (checkpoint / "state").mkdir(parents=True)
    lora = ["lora.rank=4", "lora.targets=[q_proj,lm_head]", "model.tie_word_embeddings=true"]
    assert main(["export", "-c", "llama3-tiny", f"checkpoint={checkpoint}", f"out={tmp_path / 'hf'}", *lora]) == 2
    assert capsys.readouterr().err.startswith("podtrain: error: export.adapter: this run's LM head adapter cannot be "
                                              "merged into a model whose head is its embedding")
    assert not (tmp_path / "hf").exists()
