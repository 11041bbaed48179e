"""The service's engine: one base model, sharded as in training, with `serve.max_adapters` LoRA
adapter slots, and the pure jitted programs that run a step of many adapters' rows.

Every batch row carries its adapter's slot, scale and rank (`models.lora.rows`). Rows are padded
to a few fixed shapes (rows and tokens rounded up to powers of two), so steady work never
recompiles; a padded row or token has no loss and no gradient.

- `forward_backward`: target logprobs, each row's own loss (`losses.token_losses`), and the
  gradient of the trained rows' summed loss with respect to every slot: a slot's gradient is that
  of its rows alone, since a row reads only its own slot.
- `adam_steps`: one Adam step of any set of slots in one program, each with its own
  hyperparameters (optax's Adam with decoupled weight decay, clipped by that slot's gradient
  norm), slot after slot; the other slots' parameters and moments are not touched.
- `sample_rows`: prefill then decode in one program over the stacked KV cache, each row with its
  own adapter, temperature, top-k, top-p, seed, stop sequences and token budget.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.experimental import multihost_utils

from podtrain.models import lora
from podtrain.models.generate import RowSampling, decode
from podtrain.models.loss import vocab_slices


def to_host(x: jax.Array) -> np.ndarray:
    """A program's output as a NumPy array on every process. A part held by other processes is
    gathered from them: a collective, which every process of the gang reaches at the same point of
    the same step."""
    if x.is_fully_addressable or x.is_fully_replicated:
        return np.asarray(x)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def bucket(n: int, smallest: int = 1) -> int:
    """`n` rounded up to a power of two (at least `smallest`): the padded size of a batch axis."""
    size = smallest
    while size < n:
        size *= 2
    return size


def token_losses(lp, weights, sampling_lp, advantages, loss_index, low, high, beta):
    """Elementwise losses (B, T) float32 of rows whose loss is `NAMES[loss_index[b]]` with config
    `low`/`high`/`beta` (B,): `lp` the target logprobs under the adapter, the rest each row's inputs.

    A row's other losses are computed too and dropped; their ratio is taken against `lp` itself
    (not the row's, possibly absent, sampling logprobs), so what is dropped cannot make NaNs.
    """
    rl = loss_index[:, None] > 0
    q = jnp.where(rl, sampling_lp, jax.lax.stop_gradient(lp))
    ratio = jnp.exp(lp - q)
    clipped = jnp.clip(ratio, low[:, None], high[:, None])
    losses = jnp.stack([
        -weights * lp,
        -ratio * advantages,
        -jnp.minimum(ratio * advantages, clipped * advantages),
        -jax.lax.stop_gradient(clipped) * lp * advantages,
        -(lp * advantages - 0.5 * beta[:, None] * (lp - q) ** 2),
    ])
    return jnp.take_along_axis(losses, loss_index[None, :, None], axis=0)[0]


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Batch:
    """A padded training batch of B rows of T tokens. Per token: `tokens` (int32), `targets`
    (int32), `weights`, `sampling_lp` (the sampler's logprobs) and `advantages` (float32), and
    `real` (1 for the row's tokens, 0 for padding). Per row: its adapter `slot`, `scale` and
    `rank`; its loss (`loss`, an index into `losses.NAMES`) with `low`, `high` and `beta`; and
    `train`, 1 when its gradient is kept (`forward_backward`), 0 for a forward only."""

    tokens: jax.Array
    targets: jax.Array
    weights: jax.Array
    sampling_lp: jax.Array
    advantages: jax.Array
    real: jax.Array
    slot: jax.Array
    scale: jax.Array
    rank: jax.Array
    loss: jax.Array
    low: jax.Array
    high: jax.Array
    beta: jax.Array
    train: jax.Array


def batch_losses(model: nnx.Module, batch: Batch, loss_chunk: int) -> tuple[jax.Array, jax.Array]:
    """(target logprobs, elementwise losses), each (B, T) float32 and zero on padding."""
    with lora.rows(batch.slot, batch.scale, batch.rank):
        hidden = model.hidden_states(batch.tokens)[0]
        lp = model.target_logprobs(hidden, batch.targets, slices=vocab_slices(batch.tokens.shape[1], loss_chunk))
    losses = token_losses(lp, batch.weights, batch.sampling_lp, batch.advantages, batch.loss, batch.low, batch.high,
                          batch.beta)
    real = batch.real > 0
    return jnp.where(real, lp, 0.0), jnp.where(real, losses, 0.0)


@functools.partial(jax.jit, static_argnames=("graphdef", "loss_chunk"), donate_argnums=(3,))
def forward_backward(graphdef: nnx.GraphDef, adapters: nnx.State, rest: nnx.State, grads: nnx.State, batch: Batch,
                     *, loss_chunk: int):
    """(`grads` plus the gradient of the trained rows' summed loss for every slot, logprobs (B, T),
    losses (B, T)). A batch of forward passes only leaves `grads` exactly as they were. The head
    is applied a vocabulary slice at a time (`vocab_slices`), so no (B, T, vocab) logits are made."""

    def objective(adapters):
        lp, losses = batch_losses(nnx.merge(graphdef, adapters, rest), batch, loss_chunk)
        return jnp.sum(losses * batch.train[:, None]), (lp, losses)

    new, (lp, losses) = jax.grad(objective, has_aux=True)(adapters)
    trained = jnp.any(batch.train > 0)
    return jax.tree.map(lambda g, n: jnp.where(trained, g + n.astype(g.dtype), g), grads, new), lp, losses


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class AdamState:
    """Every slot's Adam moments, slot-major (`mu`, `nu`: the adapters' leaves with their adapter
    axis moved first), and each slot's step count (N,)."""

    mu: nnx.State
    nu: nnx.State
    count: jax.Array


def slot_axes(adapters: nnx.State) -> tuple[int, ...]:
    """Each adapter leaf's adapter axis (its position in the leaf's logical axes), in leaf order."""
    variables = jax.tree.leaves(adapters, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return tuple(v.get_metadata()["out_sharding"].index("lora_adapters") for v in variables)


def axes_tree(adapters, axes: tuple[int, ...]):
    return jax.tree.unflatten(jax.tree.structure(adapters), axes)


def init_adam(adapters: nnx.State, axes: tuple[int, ...], slots: int) -> AdamState:
    """Zero moments and counts for every slot."""
    def zeros(x, axis):
        return jnp.zeros((x.shape[axis], *x.shape[:axis], *x.shape[axis + 1:]), jnp.float32)

    mu = jax.tree.map(zeros, adapters, axes_tree(adapters, axes))
    return AdamState(mu, jax.tree.map(jnp.zeros_like, mu), jnp.zeros((slots,), jnp.int32))


def _slot_major(tree, axes):
    return jax.tree.map(lambda x, axis: jnp.moveaxis(x, axis, 0), tree, axes)


def _slot_minor(tree, like, axes):
    return jax.tree.map(lambda v, x, axis: jnp.moveaxis(v, 0, axis).astype(x.dtype), tree, like, axes)


# The most slots one Adam program steps (more run as several): what it holds beside the engine's
# arrays grows with the slots it steps, not with the slots the engine has.
ADAM_CHUNK = 4


@functools.partial(jax.jit, static_argnames=("axes",), donate_argnums=(0, 1, 2))
def adam_steps(adapters: nnx.State, grads: nnx.State, state: AdamState, hyper: dict, *, axes):
    """One Adam step of each slot `hyper["slot"]` (k,), each on its own gradient with its own
    hyperparameters (Tinker's AdamParams, each a (k,) array: learning_rate, beta1, beta2, eps,
    weight_decay, grad_clip_norm (0: none)): optax's Adam with decoupled weight decay, the gradient
    clipped by the slot's own norm. The k slots are taken out, stepped one after another by the
    same loop body (so a slot's step is the same bits whatever the number of slots, or of slots
    stepped beside it) and put back; a slot named twice must come with the same hyperparameters
    (padding). Other slots keep their parameters, moments, count and gradient exactly. Returns
    (adapters, grads with the stepped slots' zeroed, state, each entry's gradient norm before
    clipping (k,))."""
    tree = axes_tree(adapters, axes)
    slots = hyper["slot"]
    take = lambda x, axis: jnp.moveaxis(x[at_slot(axis, slots)], axis, 0).astype(jnp.float32)  # noqa: E731

    def one(args):
        p, g, mu, nu, count, h = args
        norm = optax.tree.norm(g)
        clip = h["grad_clip_norm"]
        g = optax.tree.scale(jnp.where((clip > 0) & (norm > clip), clip / norm, 1.0), g)
        tx = optax.chain(optax.scale_by_adam(b1=h["beta1"], b2=h["beta2"], eps=h["eps"]),
                         optax.add_decayed_weights(h["weight_decay"]), optax.scale_by_learning_rate(h["learning_rate"]))
        updates, (moments, _, _) = tx.update(g, (optax.ScaleByAdamState(count, mu, nu), optax.EmptyState(),
                                                 optax.EmptyState()), p)
        return optax.apply_updates(p, updates), moments.mu, moments.nu, moments.count, norm

    per_slot = {key: value for key, value in hyper.items() if key != "slot"}
    new, mu, nu, count, norms = jax.lax.map(one, (jax.tree.map(take, adapters, tree), jax.tree.map(take, grads, tree),
                                                  jax.tree.map(lambda m: m[slots], state.mu),
                                                  jax.tree.map(lambda m: m[slots], state.nu), state.count[slots],
                                                  per_slot))
    put = lambda x, v, axis: x.at[at_slot(axis, slots)].set(jnp.moveaxis(v, 0, axis).astype(x.dtype))  # noqa: E731
    zero = lambda x, axis: x.at[at_slot(axis, slots)].set(0)  # noqa: E731
    return (jax.tree.map(put, adapters, new, tree), jax.tree.map(zero, grads, tree),
            AdamState(jax.tree.map(lambda m, v: m.at[slots].set(v), state.mu, mu),
                      jax.tree.map(lambda m, v: m.at[slots].set(v), state.nu, nu), state.count.at[slots].set(count)),
            norms)


def at_slot(axis: int, index):
    """The index of slot(s) `index` along an array's adapter axis `axis`."""
    return (slice(None),) * axis + (index,)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SampleBatch:
    """B prompts right-padded to P (`prompt`, `length`), each row's adapter (`slot`, `scale`,
    `rank`), sampling (`temperature` (0: greedy), `top_k` (0: all), `top_p`, `seed`), its stop
    sequences `stop` (B, S, L: each right-aligned, -1 before it; a stop token is a sequence of one;
    all -1: none) and its token budget `max_tokens`."""

    prompt: jax.Array
    length: jax.Array
    slot: jax.Array
    scale: jax.Array
    rank: jax.Array
    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    seed: jax.Array
    stop: jax.Array
    max_tokens: jax.Array


@functools.partial(jax.jit, static_argnames=("graphdef", "new_tokens", "filtered", "prompt_logprobs", "loss_chunk"))
def sample_rows(graphdef: nnx.GraphDef, adapters: nnx.State, rest: nnx.State, batch: SampleBatch, *,
                new_tokens: int, filtered: bool, prompt_logprobs: bool, loss_chunk: int = 0):
    """Prefill then decode up to `new_tokens` tokens per row, as one program. Returns (tokens
    (B, new_tokens), their logprobs, steps made, prompt logprobs (B, P) or None); a row's tokens
    end at a stop sequence (included) or its budget, the rest is padding. Prompt logprobs apply the
    head a vocabulary slice at a time, as the loss does."""
    model = nnx.merge(graphdef, adapters, rest)
    sampling = RowSampling(batch.temperature, batch.top_k, batch.top_p, jax.vmap(jax.random.key)(batch.seed))
    with lora.rows(batch.slot, batch.scale, batch.rank):
        return decode(model, batch.prompt, batch.length, sampling, batch.stop, batch.max_tokens, new_tokens=new_tokens,
                      filtered=filtered, prompt_logprobs=prompt_logprobs, loss_chunk=loss_chunk)
