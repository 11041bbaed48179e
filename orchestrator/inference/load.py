"""A trained model outside the training loop (`podtrain export`, `podtrain generate`).

A podtrain checkpoint is named by its run directory, its checkpoint directory or one step folder;
only its params are read (never the optimizer state), each straight into its sharding on the
config's mesh, and the config's model section must equal the one the checkpoint was trained with.
A Hugging Face directory (config.json and safetensors) is read by `models.from_hf`, with its own
tokenizer.json when it has one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import jax
from flax import nnx
from jax.sharding import Mesh

from podtrain.models import ModelConfig, from_hf
from podtrain.models.lora import LoRAParam, apply_lora, load_peft, merged, read_peft_config, with_base
from podtrain.models.runner import only_layer
from podtrain.orchestrator.checkpoint.checkpointer import Checkpointer
from podtrain.orchestrator.checkpoint.integrity import content_hash
from podtrain.orchestrator.checkpoint.resume import lora_differences, model_differences, model_key_differences
from podtrain.orchestrator.common.errors import ConfigError
from podtrain.orchestrator.config.schema import Config
from podtrain.orchestrator.data.tokenizers import Tokenizer, hf_directory_tokenizer, load_tokenizer
from podtrain.orchestrator.train.build import PlacedModel, model_factory, place_model, resolve_kernels
from podtrain.sharding.mesh import build_mesh
from podtrain.sharding.place import abstract_model, create_sharded_state


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
    restored straight into their sharding on `config`'s mesh, the newest committed step unless
    `step` (or the step folder) names one. Only the model is built (no optimizer, no train step);
    the checkpoint's model keys must equal `config`'s. A LoRA run's step comes with the base it
    was trained on, its adapters merged into it unless `merge` is False (the model with adapters)."""
    directory, step = checkpoint_step(checkpoint, step)
    placed = place_model(config)
    with Checkpointer(directory, dataclasses.replace(config.checkpoint, resume="auto")) as checkpointer:
        steps = checkpointer.all_steps()
        step = steps[-1] if step is None and steps else step
        if step not in steps:
            raise ConfigError(f"step={step}: not in {directory} (committed steps: {steps})")
        differences = model_differences(checkpointer.meta(step), config.model)
        if differences:
            trained_with = directory.parent / "config.yaml"
            hint = f" (the run's resolved config: {trained_with})" if trained_with.is_file() else ""
            raise ConfigError(f"checkpoint {directory / str(step)} was trained with a different model: {differences}. "
                              f"Pass -c the preset or YAML file it was trained with{hint}")
        differences = lora_differences(checkpointer.meta(step), config.lora)
        if differences:
            raise ConfigError(f"checkpoint {directory / str(step)} was trained with other adapters: {differences}; "
                              "pass the lora.* keys it was trained with")
        if config.lora.rank:
            return placed.mesh, _lora_model(placed, checkpointer, step, merge=merge), step
        params, _, step = checkpointer.restore_params(placed.abstract_params, step=step)
    return placed.mesh, placed.model(params, None), step


def _lora_model(placed: PlacedModel, checkpointer: Checkpointer, step: int, *, merge: bool) -> nnx.Module:
    """A LoRA step's adapters on the base it was trained on; with `merge`, merged into the model
    without adapters."""
    config = placed.config
    params, meta, _ = checkpointer.restore_params(placed.abstract_trained(), step=step)
    frozen = placed.init_frozen(load_base(placed))
    check_base(meta, base_record(config, frozen), f"checkpoint step {step} in {checkpointer.directory}",
               remedy="pass the lora.base it was trained on")
    adapted = placed.model(params, frozen)
    if not merge or (config.model.tie_word_embeddings and config.lora.wants("lm_head")):
        return adapted  # a tied head's adapter cannot be merged into the embedding it shares
    graphdef, _ = abstract_model(model_factory(config.model), placed.mesh, config.sharding.rules)
    return nnx.merge(graphdef, merged(adapted))


def base_record(config: Config, frozen: nnx.State) -> dict:
    """What a LoRA run's checkpoints record of its base: the path, and a hash of its content
    (the same on any mesh; a collective)."""
    return {"path": config.lora.base, "content_hash": content_hash(frozen)}


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


def is_hf_directory(checkpoint: str) -> bool:
    """Whether `checkpoint=` names a Hugging Face directory (it holds config.json) rather than a podtrain one."""
    return (Path(checkpoint).expanduser() / "config.json").is_file()


# The model keys an override may set for an HF directory (its config.json sets the others).
HF_RUNTIME_KEYS = ("dtype", "param_dtype", "remat", "scan_layers")


def kernel_keys(model: ModelConfig) -> dict:
    """A model config's kernels (resolved by the build) as `models.from_hf`'s runtime keys."""
    return {"attention": model.attention, "interpret_kernels": model.interpret_kernels,
            "moe.grouped_matmul": model.moe.grouped_matmul, "moe.exchange": model.moe.exchange}


def load_model(config: Config, checkpoint: str, step: int | None = None,
               model_overrides: Sequence[str] = ()) -> tuple[nnx.Module, Mesh, int]:
    """(model, mesh, vocabulary size) of a podtrain checkpoint or an HF directory, its params
    sharded on the config's mesh. `model_overrides` are the model keys the command line set: for an
    HF directory those of `HF_RUNTIME_KEYS` apply (`param_dtype` casts the weights) and any other
    is an error, since config.json describes the model."""
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
        runtime = kernel_keys(resolve_kernels(config, mesh.devices.flat[0].platform).model) | chosen
        model_config, model = from_hf(directory, mesh=mesh, dtype=dtype, rules=config.sharding.rules, runtime=runtime)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return model, mesh, model_config.vocab_size


def load_checkpoint_tokenizer(config: Config, checkpoint: str) -> tuple[Tokenizer, tuple[int, ...], bool]:
    """(tokenizer, default stop ids, add BOS?): an HF directory's own tokenizer.json (with the EOS
    and BOS its tokenizer_config.json / config.json name), else the config's `data.tokenizer`."""
    directory = Path(checkpoint).expanduser()
    if is_hf_directory(checkpoint) and (directory / "tokenizer.json").is_file():
        try:
            tokenizer, stop, add_bos = hf_directory_tokenizer(directory)
        except ValueError as e:
            raise ConfigError(f"checkpoint={directory}: {e}") from None
        add_bos = add_bos or config.data.add_bos
        if add_bos and tokenizer.bos_id is None:
            raise ConfigError(f"data.add_bos: the tokenizer of checkpoint={directory} names no BOS token "
                              "(tokenizer_config.json bos_token or config.json bos_token_id); unset data.add_bos")
        return tokenizer, stop, add_bos
    try:
        tokenizer = load_tokenizer(config.data.tokenizer, eos_token=config.data.eos_token,
                                   bos_token=config.data.bos_token)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return tokenizer, (tokenizer.eos_id,), config.data.add_bos


def load_base(training: PlacedModel) -> nnx.State | None:
    """The base weights of a LoRA run from `lora.base`, an HF directory or a podtrain checkpoint
    (run, checkpoint or step directory), on the training's mesh and shardings; None when
    `lora.base` is unset (the base is the one `train.seed` makes). Its model must be the config's
    (apart from the keys that only change how it runs)."""
    config = training.config
    path = config.lora.base
    if not config.lora.rank or path is None:
        return None
    if is_hf_directory(path):
        runtime = {key: getattr(config.model, key) for key in HF_RUNTIME_KEYS if key != "param_dtype"}
        runtime |= kernel_keys(config.model)
        try:
            base_config, model = from_hf(Path(path).expanduser(), mesh=training.mesh, dtype=config.model.param_dtype,
                                         rules=config.sharding.rules, runtime=runtime)
        except ValueError as e:
            raise ConfigError(f"lora.base={path}: {e}") from None
        differences = model_key_differences(base_config, config.model)
        if differences:
            raise ConfigError(f"lora.base={path}: its config.json describes another model than the config's: "
                              f"{differences}")
        return nnx.state(model)
    base = dataclasses.replace(config, lora=dataclasses.replace(config.lora, rank=0))
    try:
        _, model, _ = restore_model(base, path)
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
