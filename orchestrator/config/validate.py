"""The cross-section rules of a merged `Config`: each section's own checks, then what holds between
sections (model and mesh, train and optimizer, LoRA and model), and with a device count, the mesh."""

from __future__ import annotations

import dataclasses

from podtrain.models.kernels.attention import check_backend
from podtrain.models.lora import check_targets
from podtrain.orchestrator.config.errors import ConfigError
from podtrain.orchestrator.config.schema import OPTIMIZERS, SCHEDULES, Config
from podtrain.sharding.mesh import resolve_axis_sizes
from podtrain.sharding.rules import check_rules, logical_to_spec, sharded_over


def cluster_platform(cluster) -> str | None:
    """The JAX platform the run's workers will have ("tpu", "gpu", "cpu"), or None when only the
    process that trains knows it (`cluster.kind=none`)."""
    if "JAX_PLATFORMS" in cluster.env:
        return str(cluster.env["JAX_PLATFORMS"]).split(",")[0] or None
    return {"tpu": "tpu", "gpu": "gpu", "local": "cpu"}.get(cluster.kind)


def validate(config: Config, num_devices: int | None = None) -> dict[str, int] | None:
    """Cross-field rules; with `num_devices`, also the mesh against the devices present.

    Returns:
        The resolved mesh axis sizes when `num_devices` is given.
    """
    try:
        config.model.validate()
        config.lora.validate()
        check_targets(config.lora, config.model)
        config.data.validate()
        config.checkpoint.validate()
        config.cluster.validate()
        config.plan.validate()
        config.generate.validate()
        config.export.validate()
        check_rules(config.sharding.rules)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    m, mesh = config.model, config.mesh
    platform = cluster_platform(config.cluster)
    if platform is not None:
        try:
            check_backend(m.attention, platform, m.dtype, config.train.seq_len)
        except ValueError as e:
            raise ConfigError(f"{e} (cluster.kind={config.cluster.kind})") from None
    if mesh.tp > 0:
        for name in ("num_heads", "num_kv_heads"):
            if getattr(m, name) % mesh.tp:
                raise ConfigError(
                    f"model.{name}={getattr(m, name)} is not divisible by mesh.tp={mesh.tp}; "
                    f"choose mesh.tp dividing {getattr(m, name)}"
                )
    train = config.train
    for name in ("batch_size", "seq_len", "steps", "sample_tokens", "eval_batches"):
        if getattr(train, name) <= 0:
            raise ConfigError(f"train.{name}: expected a positive integer, found {getattr(train, name)}")
    if train.eval_every < 0:
        raise ConfigError(f"train.eval_every: expected a number of steps >= 0 (0: no evals), found {train.eval_every}")
    if not 0 <= train.seed < 2**63:
        raise ConfigError(f"train.seed: expected an integer in [0, 2**63), found {train.seed}")
    if not train.peak_flops_per_device >= 0:
        raise ConfigError(f"train.peak_flops_per_device: expected FLOP/s > 0, or 0 to look the device kind up, "
                          f"found {train.peak_flops_per_device}")
    if train.seq_len > m.max_position_embeddings:
        raise ConfigError(f"train.seq_len={train.seq_len} is longer than model.max_position_embeddings="
                          f"{m.max_position_embeddings}, the positions the model is made for; raise "
                          "model.max_position_embeddings (and its RoPE scaling) to train longer sequences")
    if train.sample_prompt == "":
        raise ConfigError("train.sample_prompt: expected a non-empty prompt or null (no samples), found ''")
    if train.sample_prompt and not train.eval_every:
        raise ConfigError("train.sample_prompt: samples are taken at evals, but train.eval_every=0; "
                          "set train.eval_every > 0 or unset train.sample_prompt")
    opt = config.optimizer
    for name, value, valid in (("name", opt.name, OPTIMIZERS), ("schedule", opt.schedule, SCHEDULES)):
        if value not in valid:
            raise ConfigError(f"optimizer.{name}: expected one of {list(valid)}, found {value!r}")
    for name in ("learning_rate", "eps"):
        if not getattr(opt, name) > 0:
            raise ConfigError(f"optimizer.{name}: expected a number > 0, found {getattr(opt, name)}")
    if not opt.weight_decay >= 0:
        raise ConfigError(f"optimizer.weight_decay: expected a number >= 0 (0: no decay), found {opt.weight_decay}")
    if not 0 <= opt.min_lr_ratio <= 1:
        raise ConfigError(f"optimizer.min_lr_ratio: expected the final share of optimizer.learning_rate, in [0, 1], "
                          f"found {opt.min_lr_ratio}")
    for name in ("b1", "b2", "momentum"):
        if not 0 <= getattr(opt, name) < 1:
            raise ConfigError(f"optimizer.{name}: expected a decay rate in [0, 1), found {getattr(opt, name)}")
    if opt.grad_clip < 0:
        raise ConfigError(f"optimizer.grad_clip: expected a global gradient norm > 0, or 0 for no clipping, "
                          f"found {opt.grad_clip}")
    if opt.warmup_steps < 0 or opt.warmup_steps > config.train.steps:
        raise ConfigError(f"optimizer.warmup_steps={opt.warmup_steps} must be in [0, train.steps={config.train.steps}]")
    accum = config.train.grad_accum
    if accum < 1 or config.train.batch_size % accum:
        raise ConfigError(
            f"train.grad_accum={accum} must be >= 1 and divide train.batch_size={config.train.batch_size}"
        )
    chunk = config.train.loss_chunk
    if chunk < 0 or (chunk and config.train.seq_len % chunk):
        raise ConfigError(f"train.loss_chunk={chunk} must be 0 (off) or divide train.seq_len={config.train.seq_len}")
    if num_devices is None:
        return None
    try:
        sizes = resolve_axis_sizes(dataclasses.asdict(mesh), num_devices)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    try:
        logical_to_spec(("batch",), sizes, shape=(config.train.batch_size,), rules=config.sharding.rules,
                        what="train.batch_size")
        if config.train.grad_accum > 1:  # each micro-batch is sharded as the batch is
            micro = config.train.batch_size // config.train.grad_accum
            logical_to_spec(("batch",), sizes, shape=(micro,), rules=config.sharding.rules,
                            what=f"the micro-batch of train.batch_size / train.grad_accum={config.train.grad_accum}")
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
