"""The cross-section rules of a merged `Config`: each section's own checks, then what holds between
sections (model and mesh, train and optimizer, LoRA and model), and with a device count, the mesh."""

from __future__ import annotations

import dataclasses

from podtrain.models.architectures import validate_model
from podtrain.models.kernels.attention import check_backend
from podtrain.models.lora import check_targets
from podtrain.orchestrator.common.errors import ConfigError
from podtrain.orchestrator.config.schema import Config
from podtrain.sharding.mesh import resolve_axis_sizes
from podtrain.sharding.rules import logical_to_spec, sharded_over


def cluster_platform(cluster) -> str | None:
    """The JAX platform the run's workers will have ("tpu", "gpu", "cpu"), or None when only the
    process that trains knows it (`cluster.kind=none`)."""
    if "JAX_PLATFORMS" in cluster.env:
        return str(cluster.env["JAX_PLATFORMS"]).split(",")[0] or None
    return {"tpu": "tpu", "gpu": "gpu", "local": "cpu"}.get(cluster.kind)


def validate(config: Config, num_devices: int | None = None, *, serving: bool = False) -> dict[str, int] | None:
    """Each section's rules and the rules between sections; with `num_devices`, also the mesh
    against the devices present. A training run's config is checked for its `train` section (its
    sequences against the model, its batch against the mesh); a service's (`serving`) for its
    `serve` section instead, which sets its own lengths.

    Returns:
        The resolved mesh axis sizes when `num_devices` is given.
    """
    try:
        validate_model(config.model)
        config.lora.validate()
        check_targets(config.lora, config.model)
        config.data.validate()
        config.checkpoint.validate()
        config.metrics.validate()
        config.cluster.validate()
        config.plan.validate()
        config.generate.validate()
        config.export.validate()
        config.serve.validate()
        config.sharding.validate()
        config.optimizer.validate()
        config.train.validate()
    except ValueError as e:
        raise ConfigError(str(e)) from None
    m, mesh = config.model, config.mesh
    seq_len, seq_key = ((config.serve.max_seq_len, "serve.max_seq_len") if serving
                        else (config.train.seq_len, "train.seq_len"))
    context = max(mesh.cp, 1)  # -1 is checked again once the mesh is resolved
    check_context(config, context, decode="podtrain serve" if serving else None)
    platform = cluster_platform(config.cluster)
    if platform is not None:
        try:
            check_backend(m.attention, platform, m.dtype, seq_len, seq_key=seq_key, context=context)
        except ValueError as e:
            raise ConfigError(f"{e} (cluster.kind={config.cluster.kind})") from None
    if mesh.tp > 0:
        for name in ("num_heads", "num_kv_heads"):
            if getattr(m, name) % mesh.tp:
                raise ConfigError(
                    f"model.{name}={getattr(m, name)} is not divisible by mesh.tp={mesh.tp}; "
                    f"choose mesh.tp dividing {getattr(m, name)}"
                )
    if serving:
        if config.serve.max_seq_len > m.max_position_embeddings:
            raise ConfigError(f"serve.max_seq_len: expected at most model.max_position_embeddings="
                              f"{m.max_position_embeddings}, the positions the model is made for, found "
                              f"{config.serve.max_seq_len}")
    else:
        _check_training(config)
    if num_devices is None:
        return None
    sizes = mesh_sizes(config, num_devices)
    check_context(config, sizes["cp"], decode="podtrain serve" if serving else None)
    if not serving:
        check_batch(config, sizes)
    return sizes


def check_context(config: Config, cp: int, *, decode: str | None = None) -> None:
    """A ConfigError when a sequence cannot be split over `cp` devices (`mesh.cp`): a command that
    decodes (`decode` names it), or a `train.seq_len` not divisible by 2 * cp (each device holds two
    equal chunks, one early and one late)."""
    if cp == 1:
        return
    if decode is not None:
        raise ConfigError(f"mesh.cp={cp}: {decode} samples token by token (the decode path), which cannot split a "
                          "sequence over devices; expected mesh.cp=1")
    if config.train.seq_len % (2 * cp):
        raise ConfigError(f"train.seq_len={config.train.seq_len} must be divisible by 2 * mesh.cp = {2 * cp}: each "
                          f"of the mesh.cp={cp} devices holds two equal chunks of every sequence")


def _check_training(config: Config) -> None:
    m, train = config.model, config.train
    if train.seq_len > m.max_position_embeddings:
        raise ConfigError(f"train.seq_len={train.seq_len} is longer than model.max_position_embeddings="
                          f"{m.max_position_embeddings}, the positions the model is made for; raise "
                          "model.max_position_embeddings (and its RoPE scaling) to train longer sequences")
    opt = config.optimizer
    if opt.warmup_steps < 0 or opt.warmup_steps > train.steps:
        raise ConfigError(f"optimizer.warmup_steps={opt.warmup_steps} must be in [0, train.steps={train.steps}]")


def mesh_sizes(config: Config, num_devices: int) -> dict[str, int]:
    """The mesh's axis sizes on `num_devices` devices, checked against the model (what training
    and serving share)."""
    m = config.model
    try:
        sizes = resolve_axis_sizes(dataclasses.asdict(config.mesh), num_devices)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if m.num_moe_layers:
        axes, shards = sharded_over(("experts",), sizes, config.sharding.rules)
        token_axes, _ = sharded_over(("batch", "seq"), sizes, config.sharding.rules)
        if len(axes) > 1 or not set(axes) <= set(token_axes):
            raise ConfigError(
                f"sharding.rules: experts are sharded over {list(axes)}; expected one mesh axis that the tokens "
                f"('batch' or 'seq' rules, now over {list(token_axes)}) are sharded over too"
            )
        if m.moe.num_experts % shards:
            raise ConfigError(
                f"model.moe.num_experts={m.moe.num_experts} is not divisible by the {shards} expert shards "
                f"(mesh axes {list(axes)}); choose mesh.ep dividing {m.moe.num_experts}"
            )
    return sizes


def check_batch(config: Config, sizes: dict[str, int]) -> None:
    """A ConfigError when `train.batch_size` (or a micro-batch of it) cannot be sharded over the
    mesh of `sizes` as the rules shard the batch."""
    try:
        logical_to_spec(("batch",), sizes, shape=(config.train.batch_size,), rules=config.sharding.rules,
                        what="train.batch_size")
        if config.train.grad_accum > 1:  # each micro-batch is sharded as the batch is
            micro = config.train.batch_size // config.train.grad_accum
            logical_to_spec(("batch",), sizes, shape=(micro,), rules=config.sharding.rules,
                            what=f"the micro-batch of train.batch_size / train.grad_accum={config.train.grad_accum}")
    except ValueError as e:
        raise ConfigError(str(e)) from None
