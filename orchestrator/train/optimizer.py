"""The optimizer and its learning-rate schedule, from the config's `optimizer` section."""

from __future__ import annotations

import jax
import optax

from podtrain.orchestrator.config.schema import OptimizerConfig


def _entry_name(entry) -> str:
    """A path entry's name: a dict key (DictKey.key) or an attribute (GetAttrKey.name)."""
    return str(getattr(entry, "key", getattr(entry, "name", entry)))


def _decays(path, _leaf) -> bool:
    """Weight decay applies to matrices, never to norm scales or biases (the router's included)."""
    name = _entry_name(path[-1])
    if name == "value" and len(path) > 1:  # a Variable's own node (`.value` of an nnx.State leaf)
        name = _entry_name(path[-2])
    return not (name == "scale" or name.startswith("b") or name.endswith("_bias"))


def make_schedule(config: OptimizerConfig, total_steps: int) -> optax.Schedule:
    """Learning rate per step: constant, or linear warmup then cosine or linear decay to `min_lr_ratio`."""
    peak, warmup = config.learning_rate, config.warmup_steps
    end = peak * config.min_lr_ratio
    if config.schedule == "constant":
        return optax.constant_schedule(peak) if not warmup else optax.join_schedules(
            [optax.linear_schedule(0.0, peak, warmup), optax.constant_schedule(peak)], [warmup])
    decay_steps = max(total_steps - warmup, 1)
    if config.schedule == "cosine":
        decay = optax.cosine_decay_schedule(peak, decay_steps, alpha=config.min_lr_ratio)
    else:
        decay = optax.linear_schedule(peak, end, decay_steps)
    return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), decay], [warmup])


def make_optimizer(config: OptimizerConfig, schedule: optax.Schedule) -> optax.GradientTransformation:
    """Global-norm clipping (none when `grad_clip` is 0), then AdamW, SGD with momentum or Adafactor;
    decay masked off norms and biases."""
    mask = lambda params: jax.tree.map_with_path(_decays, params)
    if config.name == "adamw":
        tx = optax.adamw(schedule, b1=config.b1, b2=config.b2, eps=config.eps, weight_decay=config.weight_decay,
                         mask=mask)
    elif config.name == "sgd":
        tx = optax.chain(optax.add_decayed_weights(config.weight_decay, mask),
                         optax.sgd(schedule, momentum=config.momentum or None))
    else:
        # optax applies Adafactor's decay after the learning rate: scale it by the schedule, so that
        # `weight_decay` means what it means for AdamW and SGD (a step decays by lr * weight_decay).
        rate = (lambda count: config.weight_decay * schedule(count)) if config.weight_decay else None
        tx = optax.adafactor(schedule, weight_decay_rate=rate, weight_decay_mask=mask)
    # 0 means no clipping (clip_by_global_norm(0) would zero every gradient); identity keeps the
    # optimizer state's structure, so a checkpoint resumes whatever grad_clip is.
    clip = optax.clip_by_global_norm(config.grad_clip) if config.grad_clip else optax.identity()
    return optax.chain(clip, tx)
