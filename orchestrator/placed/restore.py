"""A placed model restored: from a podtrain checkpoint (its params only, each straight into its
sharding), a LoRA model's base from an HF directory or a checkpoint (`lora.base`), and a PEFT
adapter put on a model.

A podtrain checkpoint is named by its run directory, its checkpoint directory or one step folder,
and the config's model section must equal the one it was trained with. A LoRA step's adapters go
only on the base they were trained on, by content (`base_record`, `check_base`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
from flax import nnx
from jax.sharding import Mesh

from podtrain.models import ModelConfig, from_hf
from podtrain.models.hf_read import is_hf_directory
from podtrain.models.lora import LoRAConfig, LoRAParam, apply_lora, load_peft, merged, read_peft_config, with_base
from podtrain.models.runner import only_layer
from podtrain.orchestrator.checkpoint.checkpointer import Checkpointer
from podtrain.orchestrator.checkpoint.integrity import content_hash
from podtrain.orchestrator.checkpoint.resume import lora_differences, model_differences, model_key_differences
from podtrain.orchestrator.common.errors import ConfigError
from podtrain.orchestrator.config.schema import CheckpointConfig, Config
from podtrain.orchestrator.placed.mesh import make_mesh
from podtrain.orchestrator.placed.model import PlacedModel, place, place_model
from podtrain.sharding.place import abstract_model, create_sharded_state

# The model keys an override may set for an HF directory (its config.json sets the others).
HF_RUNTIME_KEYS = ("dtype", "param_dtype", "remat", "scan_layers")


def resolve_checkpoint(path: str) -> tuple[Path, int | None]:
    """(checkpoint directory, step or None) for a run directory, a checkpoint directory or a step folder."""
    p = Path(path).expanduser().absolute()
    if not p.is_dir():
        raise ConfigError(f"checkpoint={path}: no such directory")
    if (p / "checkpoints").is_dir():
        p = p / "checkpoints"
    if p.name.isdigit() and (p / "state").is_dir():
        return p.parent, int(p.name)
    if not any(child.name.isdigit() for child in p.iterdir()):
        raise ConfigError(f"checkpoint={path}: expected a run directory, a checkpoint directory or a step folder; "
                          f"found no committed step folder in {p}")
    return p, None


def checkpoint_step(checkpoint: str, step: int | None) -> tuple[Path, int | None]:
    """(checkpoint directory, step or None for the newest) of `checkpoint=` and `step=`; a step
    folder and a different `step=` is an error naming both."""
    directory, folder_step = resolve_checkpoint(checkpoint)
    if folder_step is not None and step is not None and step != folder_step:
        raise ConfigError(f"checkpoint={checkpoint} is the folder of step {folder_step}, but step={step}; "
                          "give the step folder or step=, not both")
    return directory, folder_step if step is None else step


def restore_model(config: Config, checkpoint: str, step: int | None = None, *,
                  merge: bool = True) -> tuple[Mesh, nnx.Module, int]:
    """(mesh, model, step): the params of `checkpoint=` (a run, checkpoint or step directory)
    restored straight into their sharding on `config`'s mesh (`restore_placed`)."""
    placed = place_model(config, make_mesh(config))
    model, step = restore_placed(placed, checkpoint, step, merge=merge)
    return placed.mesh, model, step


def restore_placed(placed: PlacedModel, checkpoint: str, step: int | None = None, *,
                   merge: bool = True) -> tuple[nnx.Module, int]:
    """(model, step): the params of `checkpoint=` (a run, checkpoint or step directory) restored
    into the placed model's shardings, the newest committed step unless `step` (or the step
    folder) names one. Only the model is built (no optimizer, no train step); the checkpoint's
    model keys must equal the placed model's. A LoRA run's step comes with the base it was trained
    on, its adapters merged into it unless `merge` is False (the model with adapters)."""
    directory, step = checkpoint_step(checkpoint, step)
    spec = placed.spec
    with Checkpointer(directory, CheckpointConfig(resume="auto")) as checkpointer:
        steps = checkpointer.all_steps()
        step = steps[-1] if step is None and steps else step
        if step not in steps:
            raise ConfigError(f"step={step}: not in {directory} (committed steps: {steps})")
        differences = model_differences(checkpointer.meta(step), spec.model)
        if differences:
            trained_with = directory.parent / "config.yaml"
            hint = f" (the run's resolved config: {trained_with})" if trained_with.is_file() else ""
            raise ConfigError(f"checkpoint {directory / str(step)} was trained with a different model: {differences}. "
                              f"Pass -c the preset or YAML file it was trained with{hint}")
        differences = lora_differences(checkpointer.meta(step), spec.lora)
        if differences:
            raise ConfigError(f"checkpoint {directory / str(step)} was trained with other adapters: {differences}; "
                              "pass the lora.* keys it was trained with")
        if spec.lora.rank:
            return _lora_model(placed, checkpointer, step, merge=merge), step
        params, _, step = checkpointer.restore_params(placed.abstract_params, step=step)
    return placed.model(params, None), step


def _lora_model(placed: PlacedModel, checkpointer: Checkpointer, step: int, *, merge: bool) -> nnx.Module:
    """A LoRA step's adapters on the base it was trained on; with `merge`, merged into the model
    without adapters."""
    spec = placed.spec
    params, meta, _ = checkpointer.restore_params(placed.abstract_trained(), step=step)
    frozen = placed.init_frozen(load_base(placed))
    check_base(meta, base_record(spec.lora, frozen), f"checkpoint step {step} in {checkpointer.directory}",
               remedy="pass the lora.base it was trained on")
    adapted = placed.model(params, frozen)
    if not merge or (spec.model.tie_word_embeddings and spec.lora.wants("lm_head")):
        return adapted  # a tied head's adapter cannot be merged into the embedding it shares
    return place(dataclasses.replace(spec, lora=LoRAConfig()), placed.mesh, placed.rules).model(merged(adapted), None)


def base_record(lora: LoRAConfig, frozen: nnx.State) -> dict:
    """What a LoRA run's checkpoints record of its base: the path, and a hash of its content
    (the same on any mesh; a collective)."""
    return {"path": lora.base, "content_hash": content_hash(frozen)}


def check_base(meta: dict, current: dict | None, where: str, *,
               remedy: str = "resume on the base it was trained on") -> None:
    """A LoRA step's adapters go only on the base they were trained on (by content, not path)."""
    saved = meta.get("lora_base")
    if current is None or saved is None or saved["content_hash"] == current["content_hash"]:
        return
    described = lambda base: f"lora.base={base['path']}" if base["path"] else "the base train.seed makes"  # noqa: E731
    raise ConfigError(f"lora.base: {where} trained its adapters on another base ({described(saved)}, content hash "
                      f"{saved['content_hash'][:16]}) than this run's ({described(current)}, "
                      f"{current['content_hash'][:16]}): {remedy}")


def kernel_keys(model: ModelConfig) -> dict:
    """A model config's kernels (resolved when it was placed) as `models.from_hf`'s runtime keys."""
    return {"attention": model.attention, "interpret_kernels": model.interpret_kernels,
            "moe.grouped_matmul": model.moe.grouped_matmul, "moe.exchange": model.moe.exchange}


def load_base(placed: PlacedModel) -> nnx.State | None:
    """The base weights of a LoRA model from its `lora.base`, an HF directory or a podtrain
    checkpoint (run, checkpoint or step directory), on the placed model's mesh and shardings; None
    when `lora.base` is unset (the base is the one the spec's seed makes). Its model must be the
    spec's (apart from the keys that only change how it runs)."""
    spec = placed.spec
    path = spec.lora.base
    if not spec.lora.rank or path is None:
        return None
    if is_hf_directory(path):
        runtime = {key: getattr(spec.model, key) for key in HF_RUNTIME_KEYS if key != "param_dtype"}
        runtime |= kernel_keys(spec.model)
        try:
            base_config, model = from_hf(Path(path).expanduser(), mesh=placed.mesh, dtype=spec.model.param_dtype,
                                         rules=placed.rules, runtime=runtime)
        except ValueError as e:
            raise ConfigError(f"lora.base={path}: {e}") from None
        differences = model_key_differences(base_config, spec.model)
        if differences:
            raise ConfigError(f"lora.base={path}: its config.json describes another model than the config's: "
                              f"{differences}")
        return nnx.state(model)
    return _checkpoint_base(placed, path)


def _checkpoint_base(placed: PlacedModel, path: str) -> nnx.State:
    """A base from a podtrain checkpoint of the placed model's model, restored on its mesh."""
    plain = place(dataclasses.replace(placed.spec, lora=LoRAConfig()), placed.mesh, placed.rules)
    try:
        model, _ = restore_placed(plain, path)
    except ConfigError as e:
        raise ConfigError(f"lora.base: {e}") from None
    return nnx.state(model)


def with_peft_adapter(model: nnx.Module, adapter: str, rules=None) -> nnx.Module:
    """`model` (without adapters, on a mesh) with the PEFT LoRA adapter directory `adapter` on
    it, the adapters placed by `rules`; only the adapters are made."""
    try:
        lora = read_peft_config(Path(adapter).expanduser())
        config = model.config
        state = nnx.state(model)
        mesh = next(iter(jax.tree.leaves(state))).sharding.mesh
        factory = lambda: apply_lora(type(model)(config, rngs=nnx.Rngs(0)), lora)  # noqa: E731
        graphdef, abstract = abstract_model(factory, mesh, rules)
        base = with_base(nnx.merge(graphdef, abstract), state)
        adapted = nnx.merge(graphdef, base, create_sharded_state(factory, mesh, rules, layer_slice=only_layer,
                                                                  keep=LoRAParam))
        load_peft(adapted, config, Path(adapter).expanduser())
    except ValueError as e:
        raise ConfigError(f"adapter={adapter}: {e}") from None
    return adapted
