"""Hugging Face `config.json` <-> `ModelConfig` for Llama 3, Qwen3 and DeepSeek-V3."""

from __future__ import annotations

import jax.numpy as jnp

from podtrain.models.architectures import ARCHITECTURES, validate_model
from podtrain.models.config import DTYPES, ROPE_TYPES, ModelConfig, RopeConfig

# ModelConfig field -> config.json key, for the fields that carry over unchanged.
HF_KEYS = {
    "vocab_size": "vocab_size", "hidden_size": "hidden_size", "intermediate_size": "intermediate_size",
    "num_layers": "num_hidden_layers", "num_heads": "num_attention_heads", "num_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim", "rms_norm_eps": "rms_norm_eps", "max_position_embeddings": "max_position_embeddings",
    "tie_word_embeddings": "tie_word_embeddings", "attention_bias": "attention_bias", "mlp_bias": "mlp_bias",
    "initializer_range": "initializer_range",
}
LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
YARN_ROPE_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")
def _dtype_name(dtype, what: str) -> str:
    try:
        name = jnp.dtype(dtype).name
    except TypeError:
        name = str(dtype)
    if name not in DTYPES:
        raise ValueError(f"{what}: expected one of {list(DTYPES)}, found {name!r}")
    return name


def _rope_from_hf(hf: dict, source: str) -> RopeConfig:
    if hf.get("rope_parameters") is not None:
        key, params = "rope_parameters", dict(hf["rope_parameters"])
    else:
        key, params = "rope_scaling", dict(hf.get("rope_scaling") or {})
    params.setdefault("rope_theta", hf.get("rope_theta", RopeConfig.theta))  # top level in older configs
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"{source}: {key}.rope_type: expected one of {list(ROPE_TYPES)}, found {rope_type!r}")
    extra = {}
    if rope_type == "llama3":
        missing = [k for k in LLAMA3_ROPE_KEYS if k not in params]
        if missing:
            raise ValueError(f"{source}: {key}: rope_type 'llama3' needs {list(LLAMA3_ROPE_KEYS)}, missing {missing}")
        extra = {k: params[k] for k in LLAMA3_ROPE_KEYS}
    if rope_type == "yarn":
        missing = [k for k in ("factor", "original_max_position_embeddings") if params.get(k) is None]
        if missing:
            raise ValueError(f"{source}: {key}: rope_type 'yarn' needs factor and original_max_position_embeddings, "
                             f"missing {missing}")
        for unsupported, default in (("attention_factor", None), ("truncate", True)):
            if params.get(unsupported, default) != default:
                raise ValueError(
                    f"{source}: {key}.{unsupported}: only {default} is supported, found {params[unsupported]!r}"
                )
        extra = {k: params[k] for k in YARN_ROPE_KEYS if params.get(k) is not None}
    return RopeConfig(rope_type=rope_type, theta=float(params["rope_theta"]), **extra)


def config_from_hf(hf_config: dict, *, dtype=None, source: str = "config.json") -> ModelConfig:
    """Maps a transformers `config.json` (Llama, Qwen3 or DeepSeek-V3) onto a `ModelConfig`.

    Args:
        hf_config: the parsed config.json.
        dtype: parameter dtype; defaults to the file's `dtype` (or `torch_dtype`), else float32.
        source: how error messages name the file.

    Raises:
        ValueError: naming the key, what was expected and what was found, for a missing key, an
            unsupported model_type, rope type or activation, or sliding-window attention.
    """
    hf = hf_config
    model_type = hf.get("model_type")
    if model_type not in ARCHITECTURES:
        raise ValueError(f"{source}: model_type: expected one of {list(ARCHITECTURES)}, found {model_type!r}")
    missing = [HF_KEYS[f] for f in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads")
               if HF_KEYS[f] not in hf]
    if missing:
        raise ValueError(f"{source}: missing keys {missing} that a {model_type} config needs")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{source}: hidden_act: expected 'silu', found {hf['hidden_act']!r}")
    if hf.get("use_sliding_window"):
        raise ValueError(f"{source}: use_sliding_window: expected false (sliding-window attention is not supported)")
    other_layers = sorted(set(hf.get("layer_types") or ()) - {"full_attention"})
    if other_layers:
        raise ValueError(f"{source}: layer_types: expected only 'full_attention', found {other_layers}")
    if dtype is None:
        dtype, what = hf.get("dtype") or hf.get("torch_dtype") or "float32", f"{source}: dtype"
    else:
        what = "dtype argument"
    fields = {field: hf[key] for field, key in HF_KEYS.items() if hf.get(key) is not None}
    fields.setdefault("num_kv_heads", fields["num_heads"])
    fields.setdefault("head_dim", fields["hidden_size"] // fields["num_heads"])
    fields.setdefault("rms_norm_eps", 1e-6)  # transformers' default for these families
    fields |= ARCHITECTURES[model_type].hf_fields(hf, source)
    config = ModelConfig(model_type=model_type, rope=_rope_from_hf(hf, source), param_dtype=_dtype_name(dtype, what),
                         **fields)
    validate_model(config)
    return config


def config_to_hf(config: ModelConfig) -> dict:
    """The transformers-5 `config.json` for `config` (Llama, Qwen3 or DeepseekV3 ForCausalLM): the
    shared keys as its architecture completes them.

    Raises:
        ValueError: when transformers has no architecture for the combination (Llama with qk_norm,
            Qwen3 without qk_norm or with mlp_bias).
    """
    c = config
    architecture = ARCHITECTURES[c.model_type]
    rope = {"rope_type": c.rope.rope_type, "rope_theta": c.rope.theta}
    if c.rope.rope_type == "llama3":
        rope |= {k: getattr(c.rope, k) for k in LLAMA3_ROPE_KEYS}
    if c.rope.rope_type == "yarn":
        rope |= {k: getattr(c.rope, k) for k in YARN_ROPE_KEYS if getattr(c.rope, k)}
    out = {
        "architectures": [architecture.hf_class], "model_type": c.model_type, "hidden_act": "silu",
        "rope_parameters": rope, "dtype": c.param_dtype, **{key: getattr(c, field) for field, key in HF_KEYS.items()},
    }
    return architecture.hf_keys(c, out)
