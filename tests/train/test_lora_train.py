"""LoRA runs end to end, as real `podtrain train cluster=none` processes: checkpoints of the adapters
only, kill and resume bit-exact, a base from an HF directory that a resume must match, and export of
the merged weights."""

import json
import signal
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from train_fixtures import ROOT, TINY, command, env, export, losses, train, wait_for_step

LORA = ["lora.rank=4", "lora.alpha=8", "lora.targets=[q_proj,v_proj,o_proj,down_proj,lm_head]",
        "optimizer.learning_rate=0.01"]
# With dropout, which a resume must draw as the uninterrupted run did (the LM head takes none).
DROPOUT = [*LORA[:2], "lora.targets=[q_proj,v_proj,o_proj,down_proj]", "lora.dropout=0.1", *LORA[3:]]


def _state_bytes(step_dir: Path) -> int:
    return sum(f.stat().st_size for f in (step_dir / "state").rglob("*") if f.is_file())


@pytest.mark.slow
def test_a_lora_run_checkpoints_only_the_adapters_and_kill_resume_is_bit_exact(tmp_path):
    reference = tmp_path / "reference"
    train(reference, 6, *DROPOUT)
    full = tmp_path / "full"
    train(full, 2)
    # The adapters and their two moments against every parameter and its two moments.
    assert _state_bytes(reference / "checkpoints" / "6") * 4 < _state_bytes(full / "checkpoints" / "2")
    meta = json.loads((reference / "checkpoints" / "6" / "meta" / "metadata").read_text())
    assert meta["lora_base"]["path"] is None and len(meta["lora_base"]["content_hash"]) == 64

    killed = tmp_path / "killed"
    proc = subprocess.Popen(command(killed, 6, *DROPOUT), cwd=ROOT, env=env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    wait_for_step(killed, proc, 3)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    committed = sorted(int(p.name) for p in (killed / "checkpoints").iterdir() if p.name.isdigit())
    assert committed and committed[-1] < 6
    train(killed, 6, *DROPOUT)
    assert losses(killed) == losses(reference)

    # Other adapters cannot resume the run: one line, exit 2.
    done = subprocess.run(command(killed, 8, *DROPOUT[1:], "lora.rank=8"), cwd=ROOT, env=env(), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "lora.rank: checkpoint has 4, config has 8" in done.stderr


def _hf_base(path: Path, seed: int) -> None:
    from flax import nnx

    from podtrain.models import ARCHITECTURES, to_hf
    from podtrain.orchestrator.config.compose import load_config

    config = load_config("llama3-tiny", TINY).model
    to_hf(ARCHITECTURES[config.model_type].model_class(config, rngs=nnx.Rngs(seed)), config, path)


@pytest.mark.slow
def test_a_lora_run_on_an_hf_base_resumes_only_on_that_base_and_exports_the_merged_weights(tmp_path):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from podtrain.models import from_hf

    base, other = tmp_path / "base", tmp_path / "other"
    _hf_base(base, seed=7)
    _hf_base(other, seed=8)
    run = tmp_path / "run"
    train(run, 2, *LORA, f"lora.base={base}")
    meta = json.loads((run / "checkpoints" / "2" / "meta" / "metadata").read_text())
    assert meta["lora_base"]["path"] == str(base)

    done = subprocess.run(command(run, 4, *LORA, f"lora.base={other}"), cwd=ROOT, env=env(), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "trained its adapters on another base" in done.stderr and "resume on the base it was trained on" \
        in done.stderr

    done = export(run, tmp_path / "wrong", *LORA, f"lora.base={other}")  # an export on another base, too
    assert done.returncode == 2, done.stderr[-2000:]
    assert "trained its adapters on another base" in done.stderr and not (tmp_path / "wrong").exists()

    # Merge and export: the HF files are the base plus the trained adapters' update.
    out = tmp_path / "hf"
    done = export(run, out, *LORA, f"lora.base={base}")
    assert done.returncode == 0, done.stderr[-3000:]
    _, exported = from_hf(out)
    _, untouched = from_hf(base)
    tokens = np.random.default_rng(0).integers(0, 384, (2, 16))
    ours = np.asarray(exported(jax.numpy.asarray(tokens))[0])
    assert np.abs(ours - np.asarray(untouched(jax.numpy.asarray(tokens))[0])).max() > 1e-4  # the adapters trained
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(torch.from_numpy(tokens)).logits.numpy()
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)

    # The adapters alone, in the PEFT format: peft on the base gives the merged export's logits.
    adapter = tmp_path / "adapter"
    done = export(run, adapter, *LORA, f"lora.base={base}", "adapter=true")
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(p.name for p in adapter.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                                           adapter).eval()
    with torch.no_grad():
        np.testing.assert_allclose(peft_model(torch.from_numpy(tokens)).logits.numpy(), ours, atol=1e-4, rtol=0)

    # `generate` on the base with the adapter continues as on the merged weights.
    def generate(*args):
        settings = [o for o in TINY if not o.startswith("model.")]  # an HF directory's config.json has those
        cmd = [sys.executable, "-m", "podtrain.launch.cli", "generate", "-c", "llama3-tiny", *settings, "prompt=ab",
               "max_new_tokens=6", *args]
        done = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        return [line for line in done.stdout.splitlines() if "tokens/s" not in line]  # the texts, not the times

    assert generate(f"checkpoint={base}", f"adapter={adapter}") == generate(f"checkpoint={out}")

    # A run whose adapters start from the exported ones: its first loss is the trained adapters'.
    again = tmp_path / "again"
    train(again, 1, *LORA, f"lora.base={base}", f"lora.init={adapter}")
    fresh = tmp_path / "fresh"
    train(fresh, 1, *LORA, f"lora.base={base}")
    assert losses(again)[1] != losses(fresh)[1]
    assert losses(fresh)[1] == losses(run)[1]
