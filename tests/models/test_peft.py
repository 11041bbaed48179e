"""LoRA adapters in the PEFT format, both ways: podtrain's exported adapter loads with `peft` on the
transformers model and gives podtrain's logits; an adapter `peft` made imports and gives its logits."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from hf_fixtures import hf_logits, make_hf_model
from peft import LoraConfig, PeftModel, get_peft_model

from podtrain.models import from_hf
from podtrain.models.lora import Adapter, LoRAConfig, apply_lora, load_peft, read_peft_config, to_peft

TARGETS = {
    "llama": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "embed_tokens", "lm_head"),
    "qwen3": ("q_proj", "v_proj", "o_proj", "down_proj", "lm_head"),
    "llama_tied_bias": ("q_proj", "o_proj", "lm_head"),  # the head's adapter beside the embedding it is tied to
    "deepseek_v3": ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "embed_tokens", "experts"),
    "deepseek_v3_plain": ("q_proj", "kv_b_proj", "o_proj", "lm_head"),
}
# The routed experts through PEFT's `target_parameters`, as it adapts transformers' fused experts.
EXPERT_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def _podtrain_model(hf_dir, lora: LoRAConfig):
    config, base = from_hf(hf_dir)
    return config, apply_lora(base, lora)


def _ids(vocab: int):
    return np.random.default_rng(0).integers(0, vocab, (2, 10))


@pytest.mark.parametrize("kind", list(TARGETS))
def test_an_exported_adapter_loads_with_peft_and_gives_podtrains_logits(kind, tmp_path):
    hf_model = make_hf_model(kind)
    hf_model.save_pretrained(tmp_path / "base")
    lora = LoRAConfig(rank=4, alpha=8.0, targets=TARGETS[kind])
    config, model = _podtrain_model(tmp_path / "base", lora)
    rng = np.random.default_rng(1)
    for _, module in nnx.iter_modules(model):
        if isinstance(module, Adapter):
            for p in (module.lora_a, module.lora_b):
                p.set_value(jnp.asarray(rng.normal(scale=0.1, size=p.shape), p.dtype))
    ids = _ids(config.vocab_size)
    ours = np.asarray(model(jnp.asarray(ids))[0])
    to_peft(model, config, lora, tmp_path / "adapter", base=str(tmp_path / "base"))
    written = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert written["r"] == 4 and written["lora_alpha"] == 8.0 and written["base_model_name_or_path"]
    moe_layers = range(config.num_dense_layers, config.num_layers)
    assert written["target_parameters"] == (
        [f"model.layers.{i}.{p}" for p in EXPERT_PARAMETERS[::-1] for i in moe_layers] if "experts" in lora.targets
        else None), written["target_parameters"]

    peft_model = PeftModel.from_pretrained(hf_model, tmp_path / "adapter").eval()
    theirs = hf_logits(peft_model, ids)
    assert np.abs(theirs - hf_logits(make_hf_model(kind), ids)).max() > 1e-3  # the adapters took effect
    np.testing.assert_allclose(ours, theirs, atol=2e-4, rtol=0)


@pytest.mark.parametrize("kind, parameters", [("llama", []), ("llama_tied_bias", []), ("deepseek_v3", []),
                                              ("deepseek_v3", EXPERT_PARAMETERS)])
def test_an_adapter_peft_made_imports_and_gives_its_logits(kind, parameters, tmp_path):
    hf_model = make_hf_model(kind)
    hf_model.save_pretrained(tmp_path / "base")
    torch.manual_seed(0)
    # Random A and B (not PEFT's zero B), so that every tensor's layout is seen; on DeepSeek-V3 only
    # modules that podtrain adapts (PEFT's "gate_proj" would be the routed experts'), and the routed
    # experts' fused parameters.
    targets = TARGETS[kind] if kind.startswith("llama") else ["q_a_proj", "kv_b_proj", "o_proj"]
    peft_model = get_peft_model(hf_model, LoraConfig(r=4, lora_alpha=16, target_modules=targets,
                                                     target_parameters=parameters, init_lora_weights=False)).eval()
    peft_model.save_pretrained(tmp_path / "adapter")
    lora = read_peft_config(tmp_path / "adapter")
    experts = {"experts"} if parameters else set()
    assert (lora.rank, lora.alpha, set(lora.targets)) == (4, 16.0, set(targets) | experts)
    config, model = _podtrain_model(tmp_path / "base", lora)
    load_peft(model, config, tmp_path / "adapter")
    ids = _ids(config.vocab_size)
    np.testing.assert_allclose(np.asarray(model(jnp.asarray(ids))[0]), hf_logits(peft_model, ids), atol=2e-4, rtol=0)


def test_peft_adapters_podtrain_cannot_run_are_one_error_naming_the_key(tmp_path):
    hf_model = make_hf_model("deepseek_v3")
    hf_model.save_pretrained(tmp_path / "base")
    # On DeepSeek-V3 peft takes "gate_proj" and "up_proj" to mean the routed experts' fused projections.
    get_peft_model(hf_model, LoraConfig(r=2, target_modules=["gate_proj", "up_proj"])).save_pretrained(
        tmp_path / "experts")
    with pytest.raises(ValueError, match=r"adapter_config.json: \w+=.*gate_up_proj.* is not what podtrain runs"):
        read_peft_config(tmp_path / "experts")
    get_peft_model(make_hf_model("deepseek_v3"), LoraConfig(r=2, target_modules=[],
                                                            target_parameters=EXPERT_PARAMETERS[1:])).save_pretrained(
        tmp_path / "down")
    with pytest.raises(ValueError, match=r"adapter_config.json: target_parameters=\['mlp.experts.down_proj'\]; "
                                         r"podtrain adapts the routed experts' gate_up_proj and down_proj together"):
        read_peft_config(tmp_path / "down")
    get_peft_model(make_hf_model("llama"), LoraConfig(r=2, target_modules=["q_proj"], use_rslora=True)
                   ).save_pretrained(tmp_path / "rslora")
    with pytest.raises(ValueError, match=r"adapter_config.json: use_rslora=True is not what podtrain runs"):
        read_peft_config(tmp_path / "rslora")
    mlp = LoRAConfig(rank=2, targets=("down_proj",))
    config, model = _podtrain_model(tmp_path / "base", mlp)
    with pytest.raises(ValueError, match=r"^lora.targets: \['down_proj'\] on DeepSeek-V3 cannot be written for peft"):
        to_peft(model, config, mlp, tmp_path / "mlp")
    assert not (tmp_path / "mlp").exists()
