"""`podtrain generate` from a podtrain checkpoint and from an HF directory, its input errors, and
the sample the training loop takes at each eval. Everything runs in this process on the 8 fake
devices: the run's sample, `podtrain generate` on its checkpoint and the reference `generate`
call have the same shapes and shardings, so they share one compiled program."""

import json

import jax
import pytest
from flax import nnx
from hf_fixtures import save_hf_model
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from train_fixtures import TINY
from transformers import PreTrainedTokenizerFast

from podtrain.launch.cli import main
from podtrain.models import from_hf
from podtrain.models.generate import generate
from podtrain.orchestrator.checkpoint.checkpointer import Checkpointer
from podtrain.orchestrator.common.errors import ConfigError
from podtrain.orchestrator.config.compose import load_config
from podtrain.orchestrator.data.tokenizers import ByteTokenizer, hf_directory_tokenizer
from podtrain.orchestrator.train.build import build_training
from podtrain.sharding.mesh import build_mesh, resolve_axis_sizes
from podtrain.sharding.rules import DEFAULT_RULES, use_rules

# TINY's batch of 4 rows over fsdp=4; tp=2 shards the heads, so generation runs on a 2-D mesh.
CONFIG = ["-c", "llama3-tiny", *TINY, "mesh.tp=2"]
PROMPT, NEW_TOKENS = "def", 4
SAMPLE = ["train.eval_every=1", "train.eval_batches=1", f"train.sample_prompt={PROMPT}",
          f"train.sample_tokens={NEW_TOKENS}"]


@pytest.mark.slow
def test_training_samples_at_evals_and_generate_continues_its_checkpoint_greedily(tmp_path, capsys):
    # One test, so that parallel workers never train the run twice.
    run_dir = tmp_path / "run"
    assert main(["train", *CONFIG, "cluster=none", "train.steps=1", *SAMPLE, f"run.dir={tmp_path}",
                 f"run.name={run_dir.name}"]) == 0
    capsys.readouterr()
    assert main(["generate", *CONFIG, f"checkpoint={run_dir}", f"prompt={PROMPT}",
                 f"max_new_tokens={NEW_TOKENS}"]) == 0
    out = capsys.readouterr().out

    # The reference: `generate` on the checkpoint restored as `podtrain export` does.
    config = load_config(CONFIG[1], CONFIG[2:])
    training = build_training(config)
    with Checkpointer(run_dir / "checkpoints", config.checkpoint) as checkpointer:
        params, _, _ = checkpointer.restore_params(training.abstract_params, step=1)
    tokenizer = ByteTokenizer()
    with jax.set_mesh(training.mesh), use_rules(config.sharding.rules):
        [tokens] = generate(nnx.merge(training.graphdef, params), [tokenizer.encode(PROMPT).tolist()],
                            max_new_tokens=NEW_TOKENS, stop_tokens=(tokenizer.eos_id,), pad_id=tokenizer.pad_id)
    text = tokenizer.decode(tokens)

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r.get("sample")) for r in records] == [(1, text)]
    assert f"--- prompt 1 ---\n{PROMPT}\n--- completion 1 ({len(tokens)} tokens" in out
    assert f" ---\n{text}\ngenerated {len(tokens)} tokens for 1 prompt in " in out and "tokens/s" in out

    step_folder = run_dir / "checkpoints" / "1"
    assert main(["generate", *CONFIG, f"checkpoint={step_folder}", "prompt=hi", "step=5"]) == 2
    assert f"checkpoint={step_folder} is the folder of step 1, but step=5" in capsys.readouterr().err


def _write_tokenizer(directory, vocab_size: int) -> Tokenizer:
    """A word-level tokenizer.json of `vocab_size` ids: <unk>, <s> (BOS), </s> (EOS), then w3, w4, ...

    Its ids of BOS and EOS are those in the HF fixture's config.json (bos_token_id 1, eos_token_id 2).
    """
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(directory / "tokenizer.json"))
    special = {"bos_token": "<s>", "eos_token": {"content": "</s>"}, "add_bos_token": True}
    (directory / "tokenizer_config.json").write_text(json.dumps(special))
    return tokenizer


def test_generate_from_an_hf_directory_batches_prompts_with_its_tokenizer(tmp_path, capsys):
    save_hf_model("llama", tmp_path)
    tokenizer = _write_tokenizer(tmp_path, 128)
    prompts = ["w5 w17 w99", "w3", "w100 w101 w102 w103 w104 w105 w106 w107 w108"]
    (tmp_path / "prompts.txt").write_text("\n".join(prompts[1:]) + "\n")
    capsys.readouterr()
    assert main(["generate", "-c", "llama3-tiny", f"checkpoint={tmp_path}", f"prompt={prompts[0]}",
                 f"prompts_file={tmp_path / 'prompts.txt'}", "max_new_tokens=5"]) == 0
    out = capsys.readouterr().out
    # As the command does: the weights on the preset's mesh (fsdp over all devices), BOS first, EOS stops.
    mesh = build_mesh(resolve_axis_sizes({"fsdp": -1}, jax.device_count()))
    _, model = from_hf(tmp_path, mesh=mesh)
    with jax.set_mesh(mesh), use_rules(DEFAULT_RULES):
        want = generate(model, [[1, *tokenizer.encode(p).ids] for p in prompts], max_new_tokens=5, stop_tokens=(2,),
                        pad_id=2)
    for i, (prompt, tokens) in enumerate(zip(prompts, want, strict=True), 1):
        assert f"--- prompt {i} ---\n{prompt}\n--- completion {i} ({len(tokens)} tokens" in out
        assert f" ---\n{tokenizer.decode(tokens)}\n" in out
    assert f"generated {sum(map(len, want))} tokens for 3 prompts" in out


def test_generate_on_an_hf_directory_takes_runtime_model_keys_only(tmp_path, capsys):
    from podtrain.orchestrator.inference.load import load_model

    save_hf_model("llama", tmp_path)
    config = load_config("llama3-tiny", ["model.dtype=bfloat16", "model.param_dtype=bfloat16", "model.remat=none"])
    model, _, _ = load_model(config, str(tmp_path), model_overrides=["dtype", "param_dtype", "remat"])
    assert (model.config.dtype, model.config.param_dtype, model.config.remat) == ("bfloat16", "bfloat16", "none")
    assert {str(v.dtype) for v in jax.tree.leaves(nnx.state(model, nnx.Param))} == {"bfloat16"}
    model, _, _ = load_model(config, str(tmp_path))  # the preset's model keys are not overrides
    assert (model.config.dtype, model.config.param_dtype) == ("float32", "float32")
    capsys.readouterr()
    assert main(["generate", "-c", "llama3-tiny", f"checkpoint={tmp_path}", "prompt=hi", "model.num_layers=3"]) == 2
    err = capsys.readouterr().err
    assert f"model.num_layers: {tmp_path / 'config.json'} describes the model of a Hugging Face directory; only " \
           "model.dtype, model.param_dtype, model.remat, model.scan_layers may be overridden" in err, err
    # The same key set through a YAML mapping is the same override.
    assert main(["generate", "-c", "llama3-tiny", f"checkpoint={tmp_path}", "prompt=hi", "model={num_layers: 3}"]) == 2
    assert "model.num_layers: " in capsys.readouterr().err


@pytest.mark.parametrize("post_processor, add_bos_token", [
    (True, None),    # Llama 3: no add_bos_token, tokenizer.json's TemplateProcessing adds BOS
    (False, None),   # Qwen-like: nothing adds BOS
    (False, False),
    (True, False),   # transformers' tokenizer follows tokenizer.json whatever add_bos_token says
    (False, True),   # no post-processor: add_bos_token (transformers' generic tokenizer ignores it)
])
def test_hf_directory_prompts_start_with_bos_as_transformers_does(tmp_path, post_processor, add_bos_token):
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 16)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    if post_processor:
        tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    special = {"bos_token": "<s>", "eos_token": "</s>"}
    if add_bos_token is not None:
        special["add_bos_token"] = add_bos_token
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(special))
    ours, _, add_bos = hf_directory_tokenizer(tmp_path)
    prompt = [ours.bos_id] * add_bos + ours.encode("w3 w4").tolist()
    if add_bos_token is True and not post_processor:
        assert prompt == [1, 3, 4]
    else:
        assert prompt == PreTrainedTokenizerFast.from_pretrained(tmp_path)("w3 w4").input_ids


def test_generate_names_a_damaged_tokenizer_json(tmp_path, capsys):
    save_hf_model("llama", tmp_path)
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    capsys.readouterr()
    assert main(["generate", "-c", "llama3-tiny", f"checkpoint={tmp_path}", "prompt=hi"]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'tokenizer.json'}: not a valid tokenizer.json" in err and err.count("\n") == 1, err


@pytest.mark.parametrize("args, needle", [
    (["prompt=hi"], "generate.checkpoint: expects"),
    (["checkpoint=."], "generate.prompts: expects a non-empty prompt"),
    (["checkpoint=.", "prompt=hi", "prompt="], "generate.prompts: expects a non-empty prompt"),
    (["checkpoint=.", "prompt=hi", "temperature=-1"], "generate.temperature: expects a number >= 0"),
    (["checkpoint=.", "prompt=hi", "top_p=1.5"], "generate.top_p: expects a number in (0, 1], found 1.5"),
    (["checkpoint=.", "prompt=hi", "max_new_tokens=0"], "generate.max_new_tokens: expects a positive integer"),
    (["checkpoint=.", "prompt=hi", "max_new_tokens=many"], "key 'generate.max_new_tokens' expects int, found 'many'"),
    (["checkpoint=.", "prompt=hi", "stop=2,eos"], "generate.stop: expects comma-separated token ids"),
    (["checkpoint=.", "prompts_file=missing.txt"], "generate.prompts_file=missing.txt: no such file"),
    (["checkpoint=no/such/dir", "prompt=hi"], "checkpoint=no/such/dir: no such directory"),
    (["checkpoint=.", "prompt=hi", "max_new_token=3"], "unknown key 'max_new_token'; did you mean 'max_new_tokens'?"),
    (["checkpoint=.", "prompt=hi", "seed=1", "seed=2"], "override 'generate.seed' is given twice"),
])
def test_bad_generate_input_is_one_line_and_exit_code_2(args, needle, capsys):
    assert main(["generate", "-c", "llama3-tiny", *args]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1 and "Traceback" not in err


def test_generate_keys_are_the_generate_section_and_prompts_are_taken_as_typed():
    """`prompt=` values are collected in order and kept as typed (no YAML, no interpolation);
    `stop=` lists ids (alone: none; not given: the tokenizer's EOS); other keys stay overrides."""
    from podtrain.launch.generate import generate_overrides

    texts = ["a: b", "yes", "123", "echo ${HOME}", "\\${x} \\\\${y}", "[1, 2]", "# x", "é 😀"]
    args = ["checkpoint=run 1", *[f"prompt={text}" for text in texts], "stop=2, 7", "top_k=5", "model.num_layers=2"]
    config = load_config("llama3-tiny", generate_overrides(args))
    assert config.generate.prompts == texts and config.generate.checkpoint == "run 1"
    assert (config.generate.stop, config.generate.top_k, config.model.num_layers) == ([2, 7], 5, 2)
    assert config.generate.sampling().top_k == 5
    assert load_config("llama3-tiny", generate_overrides(["stop="])).generate.stop == []
    assert load_config("llama3-tiny", generate_overrides([])).generate.stop is None


@pytest.mark.parametrize("overrides, needle", [
    (["train.sample_tokens=0"], "train.sample_tokens: expected a positive integer, found 0"),
    (["train.sample_prompt=hi", "train.eval_every=0"], "train.sample_prompt: samples are taken at evals"),
])
def test_sample_config_errors_name_the_key(overrides, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config("llama3-tiny", overrides)
