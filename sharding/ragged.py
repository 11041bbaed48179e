"""Dropless expert computation at the routed cost: grouped matmuls over exactly the rows routed.

Inside the expert dispatch's `shard_map`, each device holds its token-expert assignments sorted
by expert, `rows` (one row per assignment). The devices along the expert axis exchange counts
(an all-gather of `(E,)` integers), from which every device knows where every row goes: device
`j` owns experts `j*L .. (j+1)*L - 1` and receives, in sender order, the rows of its experts
from every device. It takes them in rounds of `buffer` rows: in round `r` each sender sends the
part of its rows for `j` that falls in `j`'s positions `[r*buffer, (r+1)*buffer)` (a ragged
all-to-all), `j` groups its window by local expert, runs the SwiGLU experts as grouped matmuls
(`grouped_matmul`), and a second ragged all-to-all puts the results in their senders' rows.
Routing no worse than the buffer takes one round; more takes more rounds, and nothing is
dropped. The backward pass (a custom VJP) keeps round 0's windows at their owners and sends
only gradients; later rounds send the rows again and the owners recompute their projections.

XLA:CPU has no ragged all-to-all: there the same offsets and sizes drive a padded `all_to_all`
(`exchange` chooses; the offset arithmetic is the same on every platform).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from podtrain.sharding.mesh import current_platform


class ExpertAdapters(NamedTuple):
    """LoRA adapters of the experts, `B`s already scaled: gate and up share `gate_up_a` (the
    adapter of HF's fused `gate_up_proj`)."""

    gate_up_a: jax.Array  # (L, D, r)
    gate_up_b: jax.Array  # (L, r, 2, F): gate's, then up's
    down_a: jax.Array  # (L, F, r)
    down_b: jax.Array  # (L, r, D)


class ExpertWeights(NamedTuple):
    """A device's SwiGLU experts (F possibly a shard) and, with LoRA, their adapters."""

    gate: jax.Array  # (L, D, F)
    up: jax.Array  # (L, D, F)
    down: jax.Array  # (L, F, D)
    lora: ExpertAdapters | None = None


def buffer_rows(rows: int, ep: int, top_k: int, local_experts: int, buffer_factor: float) -> int:
    """Rows a device's experts take per round: `buffer_factor` x the balanced share (`rows`, a
    device's own assignments), or all it could ever receive if that is less, rounded up to a
    multiple of 128 (of 16 when small: whole tiles of the TPU grouped matmul)."""
    most = ep * (rows // top_k) * min(top_k, local_experts)  # every token picks each expert at most once
    want = min(most, buffer_factor * rows)
    step = 128 if want > 128 else 16
    return step * max(1, math.ceil(want / step))


def exchange(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis, chunk: int):
    """A ragged all-to-all over `axis`: rows `[input_offsets[j], + send_sizes[j])` of `operand`
    go to device `j`'s `output` at `output_offsets[j]`; `recv_sizes[i]` rows come from device
    `i`. `chunk` bounds any one send. TPU and GPU run `jax.lax.ragged_all_to_all`; XLA:CPU, which
    lacks it, a padded all-to-all of `chunk` rows per pair (and no collective without `axis`)."""
    operand = operand.astype(output.dtype)
    if axis is not None and current_platform() != "cpu":
        return jax.lax.ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                                         axis_name=axis)
    at = jnp.arange(chunk)
    rows = jnp.clip(input_offsets[:, None] + at, 0, operand.shape[0] - 1)
    block = jnp.where((at < send_sizes[:, None])[..., None], operand[rows], 0)  # (devices, chunk, D)
    where = output_offsets
    if axis is not None:
        block = jax.lax.all_to_all(block, axis, 0, 0)
        where = jax.lax.all_to_all(output_offsets[:, None], axis, 0, 0)[:, 0]  # each sender's offset for me
    target = jnp.where(at < recv_sizes[:, None], where[:, None] + at, output.shape[0])
    return output.at[target.reshape(-1)].set(block.reshape(-1, operand.shape[1]), mode="drop")


def _exclusive_cumsum(x, axis):
    return jnp.cumsum(x, axis=axis) - x


class _Plan:
    """Offsets of every round, from the counts `(ep senders, ep owners, L local experts)`."""

    def __init__(self, counts_SJL, me, buffer: int):
        self.counts, self.me, self.buffer = counts_SJL, me, buffer
        sent = counts_SJL.sum(-1)  # (s, j): rows s sends to j
        self.sent = sent
        self.start = _exclusive_cumsum(sent, 1)  # where s's rows for j begin among s's rows
        self.place = _exclusive_cumsum(sent, 0)  # where they begin among j's received rows
        received = sent.sum(0)
        self.rounds = (jnp.max(received) + buffer - 1) // buffer
        self.received = received[me]

    def _window(self, r):
        """(s, j) rows of the round's window: first position among j's rows, and how many."""
        lo = jnp.clip(self.place, r * self.buffer, (r + 1) * self.buffer)
        hi = jnp.clip(self.place + self.sent, r * self.buffer, (r + 1) * self.buffer)
        return lo, hi - lo

    def dispatch(self, r):
        """exchange() arguments taking my rows of round `r` to their owners' windows."""
        lo, size = self._window(r)
        me = self.me
        return (self.start[me] + lo[me] - self.place[me], size[me], lo[me] - r * self.buffer, size[:, me])

    def combine(self, r):
        """exchange() arguments taking my window's results of round `r` back to their senders."""
        lo, size = self._window(r)
        me = self.me
        return (lo[:, me] - r * self.buffer, size[:, me], self.start[:, me] + lo[:, me] - self.place[:, me], size[me])

    def groups(self, r):
        """(order, group sizes): my window's rows in local-expert order, and rows per expert."""
        local = self.counts.shape[-1]
        ends = jnp.cumsum(self.counts[:, self.me].reshape(-1))  # segments (sender, local expert) in order
        position = r * self.buffer + jnp.arange(self.buffer)
        segment = jnp.searchsorted(ends, position, side="right")
        expert = jnp.where(position < self.received, segment % local, local)
        order = jnp.argsort(expert, stable=True)
        sizes = jnp.sum(expert[:, None] == jnp.arange(local), axis=0, dtype=jnp.int32)
        return order, sizes


def grouped_matmul(rows, w_LKN, sizes):
    """rows[i] @ w[group of i] with rows in group order, `sizes[l]` rows in group l (rows past
    them give zeros). On TPU the Pallas grouped matmul that ships with JAX (megablox: its weight
    gradient visits only the rows of each group, where XLA's ragged dot transposed costs every row
    times every group); elsewhere `jax.lax.ragged_dot`."""
    if current_platform() != "tpu":
        return jax.lax.ragged_dot(rows, w_LKN, sizes)
    from jax.experimental.pallas.ops.tpu.megablox import ops

    tiling = (math.gcd(rows.shape[0], 128), 128, 128)
    return ops.gmm(rows, w_LKN.astype(rows.dtype), sizes, rows.dtype, tiling)


def _in_projections(window, experts: ExpertWeights, sizes):
    """The gate and up projections of a window in expert order (with the adapters' updates)."""
    gate, up = grouped_matmul(window, experts.gate, sizes), grouped_matmul(window, experts.up, sizes)
    if experts.lora is None:
        return gate, up
    local, rank, _, f = experts.lora.gate_up_b.shape
    low = grouped_matmul(window, experts.lora.gate_up_a, sizes)
    update = grouped_matmul(low, experts.lora.gate_up_b.reshape(local, rank, 2 * f), sizes)
    return gate + update[:, :f], up + update[:, f:]


def _out_projection(hidden, experts: ExpertWeights, sizes):
    """The down projection of the experts' hidden rows (with the adapter's update)."""
    out = grouped_matmul(hidden, experts.down, sizes)
    if experts.lora is None:
        return out
    return out + grouped_matmul(grouped_matmul(hidden, experts.lora.down_a, sizes), experts.lora.down_b, sizes)


def _round(plan, r, rows, experts, axis, sum_axes):
    """Round `r` at the owner: its window through my experts, the results in the window's sender
    order (summed over `sum_axes`), and what the backward pass needs of it (the window in expert
    order, its gate and up projections and my F slice's part of its results, the order and the
    group sizes)."""
    window, order, sizes = _window_rows(plan, r, rows, axis)
    gate, up, partial = _experts(window, sizes, experts)
    result = _unsort(partial, order)
    if sum_axes:
        result = jax.lax.psum(result, sum_axes)
    return result, (window, gate, up, partial, order, sizes)


def _experts(window, sizes, experts: ExpertWeights):
    """The SwiGLU experts over a window in expert order: (gate and up projections, results)."""
    gate, up = _in_projections(window, experts, sizes)
    return gate, up, _out_projection(jax.nn.silu(gate) * up, experts, sizes)


def _trained_vjp(f, x, experts: ExpertWeights, train_base: bool):
    """`jax.vjp` of `f(x, experts)` in `x` and the trained part of `experts`: all of it, or with a
    frozen base only the adapters (the base weights' cotangents are None, never computed)."""
    if train_base:
        return jax.vjp(f, x, experts)[1]
    pull = jax.vjp(lambda x, lora: f(x, experts._replace(lora=lora)), x, experts.lora)[1]

    def pullback(cotangent):
        d_x, d_lora = pull(cotangent)
        return d_x, ExpertWeights(None, None, None, d_lora)

    return pullback


def _expert_grads(window, gate, up, partial, sizes, experts, d_y, weight, train_base):
    """(d window | d combine weight, d experts) of the weighted SwiGLU experts at a window, from
    its gate and up projections and results (no forward matmul of the weights is recomputed: the
    outputs of those the VJPs trace go unused)."""
    d_weight = jnp.sum(d_y.astype(jnp.float32) * partial.astype(jnp.float32), axis=1, keepdims=True)
    hidden, act_vjp = jax.vjp(lambda g, u: jax.nn.silu(g) * u, gate, up)
    d_hidden, d_out_experts = _trained_vjp(lambda h, e: _out_projection(h, e, sizes), hidden, experts,
                                           train_base)((d_y * weight).astype(hidden.dtype))
    d_window, d_in_experts = _trained_vjp(lambda x, e: _in_projections(x, e, sizes), window, experts,
                                          train_base)(act_vjp(d_hidden))
    return (jnp.concatenate([d_window.astype(jnp.float32), d_weight], axis=1),
            _add(_add(None, d_out_experts), d_in_experts))


def _window_rows(plan, r, rows, axis):
    """My window of round `r`: the rows sent to me, in local-expert order, and that order."""
    window = exchange(rows, jnp.zeros((plan.buffer, rows.shape[1]), rows.dtype), *plan.dispatch(r), axis=axis,
                      chunk=plan.buffer)
    order, sizes = plan.groups(r)
    return window[order], order, sizes


def _unsort(values, order):
    return jnp.zeros_like(values).at[order].set(values)


def _overflow(plan, one_round, body, init):
    """Rounds 1 .. rounds - 1 (none when the routing fits the buffer, or cannot exceed it)."""
    return init if one_round else jax.lax.fori_loop(1, plan.rounds, body, init)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8))
def dropless_rows(rows, row_weights, counts_SJL, experts: ExpertWeights, axis, buffer, sum_axes, one_round,
                  train_base):
    """`row_weights[i]` x SwiGLU expert `e`(rows[i]) for each of my rows (sorted by expert), the
    expert run on the device owning `e`.

    Args:
        rows: (N, D) my assignments' token vectors, sorted by expert; rows past the counted ones
            (padding) are not sent and give zeros.
        row_weights: (N,) their combine weights.
        counts_SJL: int (ep, ep, L): rows device s has for local expert l of device j.
        experts: my experts' weights (and adapters).
        axis: the expert mesh axis (None: one device holds every expert).
        buffer: rows per round (`buffer_rows`).
        sum_axes: mesh axes whose devices hold the same rows and other slices of F.
        one_round: the buffer holds whatever a device can receive (no loop is built).
        train_base: False gives the experts' base weights no gradient (a LoRA run's frozen base:
            the backward pass computes only the adapters' gradients and the rows').

    The backward pass keeps round 0 at the owners (each its window, gate and up projections and
    results): the output gradients and combine weights go to the owners, and the rows' and
    weights' gradients come back. Later rounds, which routing beyond the buffer takes, send the
    rows again with them and the owners recompute their projections. Under remat the kept values
    are recomputed with one dispatch (their combine is not needed). It runs inside a `shard_map`
    with `check_vma=False` (the Pallas grouped matmul has no varying-axes types), whose gradients
    share a replicated output's cotangent among its copies and sum a replicated input's: the
    output's is summed over `sum_axes` here.
    """
    return _forward(rows, counts_SJL, experts, axis, buffer, sum_axes, one_round)[0] \
        * row_weights[:, None].astype(rows.dtype)


def _forward(rows, counts_SJL, experts, axis, buffer, sum_axes, one_round):
    """(my rows' unweighted results, round 0's owner-side values)."""
    plan = _Plan(counts_SJL, jax.lax.axis_index(axis) if axis is not None else 0, buffer)

    def round_(r, out):
        result, _ = _round(plan, r, rows, experts, axis, sum_axes)
        return exchange(result, out, *plan.combine(r), axis=axis, chunk=plan.buffer)

    first, kept = _round(plan, 0, rows, experts, axis, sum_axes)
    out = exchange(first, jnp.zeros_like(rows), *plan.combine(0), axis=axis, chunk=plan.buffer)
    return _overflow(plan, one_round, round_, out), kept


def _dropless_fwd(rows, row_weights, counts_SJL, experts, axis, buffer, sum_axes, one_round, train_base):
    out, kept = _forward(rows, counts_SJL, experts, axis, buffer, sum_axes, one_round)
    weighted = out * row_weights[:, None].astype(out.dtype)
    return weighted, (rows, row_weights, counts_SJL, experts, kept)


def _dropless_bwd(axis, buffer, sum_axes, one_round, train_base, residuals, d_out):
    rows, row_weights, counts_SJL, experts, (window, gate, up, partial, order, sizes) = residuals
    plan = _Plan(counts_SJL, jax.lax.axis_index(axis) if axis is not None else 0, buffer)
    width = rows.shape[1]
    if sum_axes:  # the output is the same along these axes: each device got a share of its gradient
        d_out = jax.lax.psum(d_out, sum_axes)
    # The output's gradient and the weights travel together, in the rows' dtype (as the forward
    # pass applies the weights).
    d_y = jnp.concatenate([d_out.astype(rows.dtype), row_weights[:, None].astype(rows.dtype)], axis=1)

    def send_back(r, result, order, back):
        # My F slice's part of the rows' and weights' gradients, in the rows' dtype (as autodiff
        # of the forward would give them); the shard_map sums them over `sum_axes`.
        return exchange(_unsort(result.astype(rows.dtype), order), back, *plan.combine(r), axis=axis,
                        chunk=plan.buffer)

    def round_(r, carry):
        back, grads = carry
        sent, order, sizes = _window_rows(plan, r, jnp.concatenate([rows, d_y], axis=1), axis)
        x, d_window_y = sent[:, :width], sent[:, width:]
        result, d_experts = _expert_grads(x, *_experts(x, sizes, experts), sizes, experts, d_window_y[:, :width],
                                          d_window_y[:, width:], train_base)
        return send_back(r, result, order, back), _add(grads, d_experts)

    d_window_y = _window_rows(plan, 0, d_y, axis)[0]
    result, d_experts = _expert_grads(window, gate, up, partial, sizes, experts, d_window_y[:, :width],
                                      d_window_y[:, width:], train_base)
    first = (send_back(0, result, order, jnp.zeros((rows.shape[0], width + 1), rows.dtype)), _add(None, d_experts))
    back, grads = _overflow(plan, one_round, round_, first)
    d_experts = jax.tree.map(lambda g, w: None if g is None else g.astype(w.dtype), grads, experts,
                             is_leaf=lambda x: x is None)
    return back[:, :width], back[:, width].astype(row_weights.dtype), None, d_experts


def _add(total, grads):
    """`total + grads` in float32 over pytrees whose None leaves are gradients not computed."""
    grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
    if total is None:
        return grads
    return jax.tree.map(lambda t, g: None if t is None else t + g, total, grads, is_leaf=lambda x: x is None)


dropless_rows.defvjp(_dropless_fwd, _dropless_bwd, optimize_remat=True)
