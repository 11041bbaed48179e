"""The pure train step `(state, batch) -> (state, metrics)`, the eval step, and the state they carry."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct

from podtrain.models import causal_lm_loss
from podtrain.models.context import balance
from podtrain.models.lora import dropout, dropout_stream
from podtrain.models.loss import chunked_causal_lm_loss


@struct.dataclass
class TrainState:
    """Everything that changes from step to step (and is checkpointed)."""

    step: jax.Array
    params: nnx.State
    opt_state: optax.OptState


def make_train_step(
    graphdef: nnx.GraphDef, tx: optax.GradientTransformation, *, loss_chunk: int = 0, grad_accum: int = 1,
    schedule: optax.Schedule | None = None, expert_bias_rate: float = 0.0, trainable=nnx.Param,
    dropout_seed: int | None = None,
) -> Callable:
    """The pure step: forward, float32 causal-LM loss, backward, optimizer update.

    `state.params` are the trained parameters: all of them, or a LoRA run's adapters, whose
    frozen base the step takes as `frozen` (it gets no gradient and no optimizer state).
    The batch holds `inputs`, `targets` and `weights` (B, T), optionally `positions` and
    `segment_ids`. `loss_chunk` > 0 computes the loss chunk by chunk (no full logits).
    `grad_accum` > 1 splits the batch into that many micro-batches inside the step and sums
    their token-weighted gradients, so loss and gradients equal those of the whole batch.
    MoE models add `expert_load` (tokens per expert per MoE layer) and `dropped_tokens` to the
    metrics; `expert_bias_rate` > 0 then moves the router biases towards balance after the update
    (with a frozen base, `trainable` is the filter of the trained params, the biases among them).
    With `dropout_seed` the adapters' dropout draws from that seed's adapter stream folded with the
    step and the micro-batch (`models.lora.dropout_stream`), so a resumed run drops what the
    uninterrupted one would have.
    """

    grad_fn = jax.value_and_grad(make_eval_step(graphdef, loss_chunk=loss_chunk), has_aux=True)

    def accumulate(params, batch, frozen, key):
        # Micro-batch i takes rows i, i + A, i + 2A, ...: each keeps the batch axis' sharding.
        micro = jax.tree.map(lambda x: x.reshape(x.shape[0] // grad_accum, grad_accum, *x.shape[1:]).swapaxes(0, 1),
                             batch)

        def one(carry, micro_batch_index):
            micro_batch, i = micro_batch_index
            (total, (count, stats)), grads = grad_fn(params, micro_batch, frozen,
                                                     None if key is None else jax.random.fold_in(key, i))
            return jax.tree.map(jnp.add, carry, ((total, count), grads)), stats

        zeros = ((jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32)), jax.tree.map(jnp.zeros_like, params))
        ((total, count), grads), stats = jax.lax.scan(one, zeros, (micro, jnp.arange(grad_accum)))
        return (total, (count, jax.tree.map(lambda x: x.sum(0), stats))), grads

    def train_step(state: TrainState, batch: dict, frozen: nnx.State | None = None):
        key = None if dropout_seed is None else dropout_stream(dropout_seed, state.step)
        (total, (count, stats)), grads = (
            grad_fn(state.params, batch, frozen, key) if grad_accum == 1
            else accumulate(state.params, batch, frozen, key)
        )
        scale = 1.0 / jnp.maximum(count, 1.0)
        grads = jax.tree.map(lambda g: g * scale, grads)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        if expert_bias_rate and "expert_load" in stats:
            model = nnx.merge(graphdef, params, *(() if frozen is None else (frozen,)))
            model.balance_experts(stats["expert_load"], expert_bias_rate)  # the biases are trained params
            params = nnx.state(model) if frozen is None else nnx.state(model, trainable)
        metrics = {"loss": total * scale, "grad_norm": optax.tree.norm(grads), "tokens": count}
        if "expert_load" in stats:
            metrics |= {"expert_load": stats["expert_load"], "dropped_tokens": stats["dropped_tokens"].sum()}
        if schedule is not None:
            metrics["lr"] = schedule(state.step)
        return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics

    return train_step


def make_eval_step(graphdef: nnx.GraphDef, *, loss_chunk: int = 0) -> Callable:
    """`(params, batch, frozen, key) -> (loss_sum, (num_tokens, stats))`: the training loss
    without an update, of the model of `params` and the `frozen` base of a LoRA run (None without);
    `key` (training) drops the adapters' inputs (`models.lora.dropout`), None (evaluation) nothing.

    `stats` holds the model's layer statistics (MoE expert loads; empty for dense models).
    """

    def eval_step(params, batch, frozen=None, key=None):
        model = nnx.merge(graphdef, params, *(() if frozen is None else (frozen,)))
        batch = balance(batch)  # a sequence split over devices (context parallelism) in its balanced order
        inputs = (batch["inputs"], batch.get("positions"), batch.get("segment_ids"))
        with dropout(key):
            if loss_chunk:
                h, _, stats = model.hidden_states(*inputs)
                loss, count = chunked_causal_lm_loss(h, model.head(stored=True), batch["targets"],
                                                     batch["weights"], chunk=loss_chunk)
            else:
                logits, _, stats = model(*inputs)
                loss, count = causal_lm_loss(logits, batch["targets"], batch["weights"])
        return loss * count, (count, stats)

    return eval_step
