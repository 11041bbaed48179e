"""The pure train step `(state, batch) -> (state, metrics)` and the sharded state it works on."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from podtrain.models import causal_lm_loss
from podtrain.models.loss import chunked_causal_lm_loss
from podtrain.orchestrator.schema import OptimizerConfig
from podtrain.sharding.rules import Rules, logical_to_spec, use_rules


@struct.dataclass
class TrainState:
    """Everything that changes from step to step (and is checkpointed)."""

    step: jax.Array
    params: nnx.State
    opt_state: optax.OptState


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


def batch_shardings(mesh: Mesh, rules: Rules, batch_size: int) -> NamedSharding:
    spec = logical_to_spec(("batch", None), dict(mesh.shape), shape=(batch_size, 1), rules=rules, what="batch")
    return NamedSharding(mesh, spec)


def train_state_shardings(param_shardings: nnx.State, abstract_params: nnx.State, tx, mesh: Mesh):
    """Shardings of a TrainState: optimizer moments shaped like their params follow them; factored
    statistics (Adafactor's row and column moments), counters and the step are replicated."""
    replicated = NamedSharding(mesh, PartitionSpec())
    abstract_opt = jax.eval_shape(tx.init, abstract_params)
    opt_shardings = optax.tree_map_params(
        tx, lambda leaf, sharding, param: sharding if leaf.shape == param.shape else replicated,
        abstract_opt, param_shardings, abstract_params,
        transform_non_params=lambda _: replicated,
        is_leaf=lambda x: isinstance(x, nnx.Variable),
    )
    return TrainState(step=replicated, params=param_shardings, opt_state=opt_shardings)


def init_train_state(params: nnx.State, tx, shardings: TrainState) -> TrainState:
    """A step-0 state around existing (sharded) params; the optimizer state is born sharded."""

    def init(params):
        return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))

    return jax.jit(init, in_shardings=(shardings.params,), out_shardings=shardings)(params)


def make_train_step(
    graphdef: nnx.GraphDef, tx: optax.GradientTransformation, *, loss_chunk: int = 0, grad_accum: int = 1,
    schedule: optax.Schedule | None = None, expert_bias_rate: float = 0.0,
) -> Callable:
    """The pure step: forward, float32 causal-LM loss, backward, optimizer update.

    The batch holds `inputs`, `targets` and `weights` (B, T), optionally `positions` and
    `segment_ids`. `loss_chunk` > 0 computes the loss chunk by chunk (no full logits).
    `grad_accum` > 1 splits the batch into that many micro-batches inside the step and sums
    their token-weighted gradients, so loss and gradients equal those of the whole batch.
    MoE models add `expert_load` (tokens per expert per MoE layer) and `dropped_tokens` to the
    metrics; `expert_bias_rate` > 0 then moves the router biases towards balance after the update.
    """

    grad_fn = jax.value_and_grad(make_eval_step(graphdef, loss_chunk=loss_chunk), has_aux=True)

    def accumulate(params, batch):
        # Micro-batch i takes rows i, i + A, i + 2A, ...: each keeps the batch axis' sharding.
        micro = jax.tree.map(lambda x: x.reshape(x.shape[0] // grad_accum, grad_accum, *x.shape[1:]).swapaxes(0, 1),
                             batch)

        def one(carry, micro_batch):
            (total, (count, stats)), grads = grad_fn(params, micro_batch)
            return jax.tree.map(jnp.add, carry, ((total, count), grads)), stats

        zeros = ((jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32)), jax.tree.map(jnp.zeros_like, params))
        ((total, count), grads), stats = jax.lax.scan(one, zeros, micro)
        return (total, (count, jax.tree.map(lambda x: x.sum(0), stats))), grads

    def train_step(state: TrainState, batch: dict):
        (total, (count, stats)), grads = (
            grad_fn(state.params, batch) if grad_accum == 1 else accumulate(state.params, batch)
        )
        scale = 1.0 / jnp.maximum(count, 1.0)
        grads = jax.tree.map(lambda g: g * scale, grads)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        if expert_bias_rate and "expert_load" in stats:
            model = nnx.merge(graphdef, params)
            model.balance_experts(stats["expert_load"], expert_bias_rate)
            params = nnx.state(model)
        metrics = {"loss": total * scale, "grad_norm": optax.tree.norm(grads), "tokens": count}
        if "expert_load" in stats:
            metrics |= {"expert_load": stats["expert_load"], "dropped_tokens": stats["dropped_tokens"].sum()}
        if schedule is not None:
            metrics["lr"] = schedule(state.step)
        return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics

    return train_step


def make_eval_step(graphdef: nnx.GraphDef, *, loss_chunk: int = 0) -> Callable:
    """`(params, batch) -> (loss_sum, (num_tokens, stats))`: the training loss without an update.

    `stats` holds the model's layer statistics (MoE expert loads; empty for dense models).
    """

    def eval_step(params, batch):
        model = nnx.merge(graphdef, params)
        kwargs = {"positions": batch.get("positions"), "segment_ids": batch.get("segment_ids"), "return_stats": True}
        if loss_chunk:
            h, stats = model(batch["inputs"], return_hidden=True, **kwargs)
            loss, count = chunked_causal_lm_loss(h, model.head(compute_dtype=False), batch["targets"],
                                                 batch["weights"], chunk=loss_chunk)
        else:
            logits, stats = model(batch["inputs"], **kwargs)
            loss, count = causal_lm_loss(logits, batch["targets"], batch["weights"])
        return loss * count, (count, stats)

    return eval_step


class ShardedStep:
    """A jitted step with explicit in/out shardings, traced under the mesh and the rule table."""

    def __init__(self, fn: Callable, mesh: Mesh, rules: Rules, state_shardings, batch_sharding, *, donate=True):
        self.mesh, self.rules = mesh, rules
        self.jitted = jax.jit(
            fn,
            in_shardings=(state_shardings, batch_sharding),
            out_shardings=(state_shardings, NamedSharding(mesh, PartitionSpec())),
            donate_argnums=(0,) if donate else (),
        )

    @contextlib.contextmanager
    def _context(self):
        with jax.set_mesh(self.mesh), use_rules(self.rules):
            yield

    def __call__(self, state, batch):
        with self._context():
            return self.jitted(state, batch)

    def lower(self, state, batch):
        with self._context():
            return self.jitted.lower(state, batch)
