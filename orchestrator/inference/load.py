"""A trained model for generation and export: a podtrain checkpoint (its params only, each straight
into its sharding on the config's mesh; `placed.restore`) or a Hugging Face directory (config.json
and safetensors, read by `models.from_hf`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

from flax import nnx
from jax.sharding import Mesh

from podtrain.models import from_hf
from podtrain.models.hf_read import is_hf_directory
from podtrain.orchestrator.common.errors import ConfigError
from podtrain.orchestrator.config.schema import Config
from podtrain.orchestrator.config.validate import check_context
from podtrain.orchestrator.placed.kernels import resolve_kernels
from podtrain.orchestrator.placed.restore import HF_RUNTIME_KEYS, kernel_keys, restore_model
from podtrain.sharding.mesh import build_mesh


def load_model(config: Config, checkpoint: str, step: int | None = None,
               model_overrides: Sequence[str] = ()) -> tuple[nnx.Module, Mesh, int]:
    """(model, mesh, vocabulary size) of a podtrain checkpoint or an HF directory, its params
    sharded on the config's mesh. `model_overrides` are the model keys the command line set: for an
    HF directory those of `HF_RUNTIME_KEYS` apply (`param_dtype` casts the weights) and any other
    is an error, since config.json describes the model."""
    check_context(config, config.mesh.cp, decode="podtrain generate")
    directory = Path(checkpoint).expanduser()
    if not is_hf_directory(checkpoint):
        mesh, model, _ = restore_model(config, checkpoint, step)
        return model, mesh, config.model.vocab_size
    if step is not None:
        raise ConfigError(f"step={step}: {directory} is a Hugging Face directory, which has no steps")
    fixed = [key for key in model_overrides if key not in HF_RUNTIME_KEYS]
    if fixed:
        raise ConfigError(f"model.{fixed[0]}: {directory / 'config.json'} describes the model of a Hugging Face "
                          f"directory; only model.{', model.'.join(HF_RUNTIME_KEYS)} may be overridden")
    chosen = {key: getattr(config.model, key) for key in model_overrides}
    dtype = chosen.pop("param_dtype", None)
    try:
        mesh = build_mesh(dataclasses.asdict(config.mesh), num_slices=config.cluster.num_slices)
        model = resolve_kernels(config.model, mesh.devices.flat[0].platform, config.train.seq_len)
        model_config, model = from_hf(directory, mesh=mesh, dtype=dtype, rules=config.sharding.rules,
                                      runtime=kernel_keys(model) | chosen)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return model, mesh, model_config.vocab_size
