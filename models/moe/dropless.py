"""Dropless expert computation at the routed cost: grouped matmuls over exactly the rows routed.

Inside the expert dispatch's `shard_map`, each device holds its token-expert assignments sorted
by expert, `rows` (one row per assignment). The devices along the expert axis exchange counts
(an all-gather of `(E,)` integers), from which every device knows where every row goes: device
`j` owns experts `j*L .. (j+1)*L - 1` and receives, in sender order, the rows of its experts
from every device. It takes them in rounds of `buffer` rows: in round `r` each sender sends the
part of its rows for `j` that falls in `j`'s positions `[r*buffer, (r+1)*buffer)` (a ragged
all-to-all, `kernels.exchange`), `j` groups its window by local expert, runs its experts as
grouped matmuls (`kernels.grouped_matmul`), and a second ragged all-to-all puts the results in
their senders' rows. Routing no worse than the buffer takes one round; more takes more rounds,
and nothing is dropped. The backward pass (a custom VJP) keeps round 0's windows at their owners
and sends only gradients; later rounds send the rows again and the owners recompute their
projections. Experts with adapter slots (`experts.adapters()` = S) make every expert S groups, one
per slot: rows are sorted and counted by (expert, slot), so an owner knows each row's slot from
where it lands, as it knows its expert.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from podtrain.models.kernels.exchange import ragged_exchange
from podtrain.models.kernels.grouped_matmul import grouped_matmul
from podtrain.models.layers import swiglu
from podtrain.models.moe.experts import run_experts, trained_vjp


@dataclasses.dataclass(frozen=True)
class Kernels:
    """The implementations the dispatch runs (resolved when the run is built): the grouped matmul
    (`model.moe.grouped_matmul`), the ragged exchange (`model.moe.exchange`), and whether Pallas
    kernels run interpreted (`model.interpret_kernels`)."""

    grouped_matmul: str = "ragged_dot"
    exchange: str = "ragged_all_to_all"
    interpret: bool = False


def buffer_rows(rows: int, ep: int, top_k: int, local_experts: int, buffer_factor: float) -> int:
    """Rows a device's experts take per round: `buffer_factor` x the balanced share (`rows`, a
    device's own assignments), or all it could ever receive if that is less, rounded up to a
    multiple of 128 (of 16 when small: whole tiles of the TPU grouped matmul)."""
    most = ep * (rows // top_k) * min(top_k, local_experts)  # every token picks each expert at most once
    want = min(most, buffer_factor * rows)
    step = 128 if want > 128 else 16
    return step * max(1, math.ceil(want / step))


def _exclusive_cumsum(x, axis):
    return jnp.cumsum(x, axis=axis) - x


@dataclasses.dataclass(frozen=True)
class _Grouped:
    """The experts' matmuls of rows sorted by expert and, within one, by adapter slot: `sizes` rows
    in each (local expert, slot) group, `adapters` slots per expert."""

    sizes: jax.Array
    adapters: int
    kernels: Kernels

    def _gmm(self, rows, w, sizes):
        k = self.kernels
        return grouped_matmul(rows, w, sizes, implementation=k.grouped_matmul, interpret=k.interpret)

    def __call__(self, rows, w_LKN):
        """rows @ w[expert]."""
        return self._gmm(rows, w_LKN, self.sizes.reshape(-1, self.adapters).sum(1, dtype=jnp.int32))

    def by_adapter(self, rows, w_LSKN):
        """rows @ w[expert, slot]."""
        return self._gmm(rows, w_LSKN.reshape(-1, *w_LSKN.shape[2:]), self.sizes)


class _Plan:
    """Offsets of every round, from the counts `(ep senders, ep owners, G)`, G = L local experts
    times `adapters` slots, in (expert, slot) order."""

    def __init__(self, counts_SJG, axis, buffer: int, kernels: Kernels, adapters: int):
        self.counts, self.axis, self.buffer, self.kernels = counts_SJG, axis, buffer, kernels
        self.adapters = adapters
        self.me = me = jax.lax.axis_index(axis) if axis is not None else 0
        sent = counts_SJG.sum(-1)  # (s, j): rows s sends to j
        self.sent = sent
        self.start = _exclusive_cumsum(sent, 1)  # where s's rows for j begin among s's rows
        self.place = _exclusive_cumsum(sent, 0)  # where they begin among j's received rows
        received = sent.sum(0)
        self.rounds = (jnp.max(received) + buffer - 1) // buffer
        self.received = received[me]

    def exchange(self, operand, output, *offsets_and_sizes):
        """The ragged all-to-all of `kernels.exchange` over the expert axis, at most a buffer per send."""
        return ragged_exchange(operand, output, *offsets_and_sizes, axis=self.axis, chunk=self.buffer,
                               implementation=self.kernels.exchange)

    def matmul(self, sizes) -> _Grouped:
        """The experts' matmuls of rows in group order, `sizes[g]` rows in group g."""
        return _Grouped(sizes, self.adapters, self.kernels)

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
        """(order, group sizes): my window's rows in (local expert, slot) order, and rows per group."""
        local = self.counts.shape[-1]
        ends = jnp.cumsum(self.counts[:, self.me].reshape(-1))  # segments (sender, group) in order
        position = r * self.buffer + jnp.arange(self.buffer)
        segment = jnp.searchsorted(ends, position, side="right")
        group = jnp.where(position < self.received, segment % local, local)
        order = jnp.argsort(group, stable=True)
        sizes = jnp.sum(group[:, None] == jnp.arange(local), axis=0, dtype=jnp.int32)
        return order, sizes


def _round(plan, r, rows, experts, sum_axes):
    """Round `r` at the owner: its window through my experts, the results in the window's sender
    order (summed over `sum_axes`), and what the backward pass needs of it (the window in expert
    order, its gate and up projections and my F slice's part of its results, the order and the
    group sizes)."""
    window, order, sizes = _window_rows(plan, r, rows)
    gate, up, partial = run_experts(experts, window, plan.matmul(sizes))
    result = _unsort(partial, order)
    if sum_axes:
        result = jax.lax.psum(result, sum_axes)
    return result, (window, gate, up, partial, order, sizes)


def _expert_grads(plan, window, gate, up, partial, sizes, experts, d_y, weight):
    """(d window | d combine weight, d experts) of the weighted experts at a window, from its gate
    and up projections and results (no forward matmul of the weights is recomputed: the outputs
    of those the VJPs trace go unused); only the experts' trained arrays get gradients."""
    matmul = plan.matmul(sizes)
    d_weight = jnp.sum(d_y.astype(jnp.float32) * partial.astype(jnp.float32), axis=1, keepdims=True)
    hidden, act_vjp = jax.vjp(swiglu, gate, up)
    d_hidden, d_out_experts = trained_vjp(lambda h, e: e.out_projection(h, matmul), hidden,
                                          experts)((d_y * weight).astype(hidden.dtype))
    d_window, d_in_experts = trained_vjp(lambda x, e: e.in_projections(x, matmul), window,
                                         experts)(act_vjp(d_hidden))
    return (jnp.concatenate([d_window.astype(jnp.float32), d_weight], axis=1),
            _add(_add(None, d_out_experts), d_in_experts))


def _window_rows(plan, r, rows):
    """My window of round `r`: the rows sent to me, in local-expert order, and that order."""
    window = plan.exchange(rows, jnp.zeros((plan.buffer, rows.shape[1]), rows.dtype), *plan.dispatch(r))
    order, sizes = plan.groups(r)
    return window[order], order, sizes


def _unsort(values, order):
    return jnp.zeros_like(values).at[order].set(values)


def _overflow(plan, one_round, body, init):
    """Rounds 1 .. rounds - 1 (none when the routing fits the buffer, or cannot exceed it)."""
    return init if one_round else jax.lax.fori_loop(1, plan.rounds, body, init)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8))
def dropless_rows(rows, row_weights, counts_SJL, experts, axis, buffer, sum_axes, one_round, kernels: Kernels):
    """`row_weights[i]` x expert `e`(rows[i]) for each of my rows (sorted by expert), the expert
    run on the device owning `e`.

    Args:
        rows: (N, D) my assignments' token vectors, sorted by expert (and slot); rows past the
            counted ones (padding) are not sent and give zeros.
        row_weights: (N,) their combine weights.
        counts_SJL: int (ep, ep, L * S): rows device s has for local expert l of device j (and
            each of its S = `experts.adapters()` slots).
        experts: my experts (`moe.experts`): their weights, or what a feature made around them;
            only their trained arrays get gradients.
        axis: the expert mesh axis (None: one device holds every expert).
        buffer: rows per round (`buffer_rows`).
        sum_axes: mesh axes whose devices hold the same rows and other slices of F.
        one_round: the buffer holds whatever a device can receive (no loop is built).
        kernels: the grouped matmul and exchange implementations.

    The backward pass keeps round 0 at the owners (each its window, gate and up projections and
    results): the output gradients and combine weights go to the owners, and the rows' and
    weights' gradients come back. Later rounds, which routing beyond the buffer takes, send the
    rows again with them and the owners recompute their projections. Under remat the kept values
    are recomputed with one dispatch (their combine is not needed). It runs inside a `shard_map`
    with `check_vma=False` (the Pallas grouped matmul has no varying-axes types), whose gradients
    share a replicated output's cotangent among its copies and sum a replicated input's: the
    output's is summed over `sum_axes` here.
    """
    return _forward(rows, counts_SJL, experts, axis, buffer, sum_axes, one_round, kernels)[0] \
        * row_weights[:, None].astype(rows.dtype)


def _forward(rows, counts_SJL, experts, axis, buffer, sum_axes, one_round, kernels):
    """(my rows' unweighted results, round 0's owner-side values)."""
    plan = _Plan(counts_SJL, axis, buffer, kernels, experts.adapters())

    def round_(r, out):
        result, _ = _round(plan, r, rows, experts, sum_axes)
        return plan.exchange(result, out, *plan.combine(r))

    first, kept = _round(plan, 0, rows, experts, sum_axes)
    out = plan.exchange(first, jnp.zeros_like(rows), *plan.combine(0))
    return _overflow(plan, one_round, round_, out), kept


def _dropless_fwd(rows, row_weights, counts_SJL, experts, axis, buffer, sum_axes, one_round, kernels):
    out, kept = _forward(rows, counts_SJL, experts, axis, buffer, sum_axes, one_round, kernels)
    weighted = out * row_weights[:, None].astype(out.dtype)
    return weighted, (rows, row_weights, counts_SJL, experts, kept)


def _dropless_bwd(axis, buffer, sum_axes, one_round, kernels, residuals, d_out):
    rows, row_weights, counts_SJL, experts, (window, gate, up, partial, order, sizes) = residuals
    plan = _Plan(counts_SJL, axis, buffer, kernels, experts.adapters())
    width = rows.shape[1]
    if sum_axes:  # the output is the same along these axes: each device got a share of its gradient
        d_out = jax.lax.psum(d_out, sum_axes)
    # The output's gradient and the weights travel together, in the rows' dtype (as the forward
    # pass applies the weights).
    d_y = jnp.concatenate([d_out.astype(rows.dtype), row_weights[:, None].astype(rows.dtype)], axis=1)

    def send_back(r, result, order, back):
        # My F slice's part of the rows' and weights' gradients, in the rows' dtype (as autodiff
        # of the forward would give them); the shard_map sums them over `sum_axes`.
        return plan.exchange(_unsort(result.astype(rows.dtype), order), back, *plan.combine(r))

    def round_(r, carry):
        back, grads = carry
        sent, order, sizes = _window_rows(plan, r, jnp.concatenate([rows, d_y], axis=1))
        x, d_window_y = sent[:, :width], sent[:, width:]
        gate, up, partial = run_experts(experts, x, plan.matmul(sizes))
        result, d_experts = _expert_grads(plan, x, gate, up, partial, sizes, experts, d_window_y[:, :width],
                                          d_window_y[:, width:])
        return send_back(r, result, order, back), _add(grads, d_experts)

    d_window_y = _window_rows(plan, 0, d_y)[0]
    result, d_experts = _expert_grads(plan, window, gate, up, partial, sizes, experts, d_window_y[:, :width],
                                      d_window_y[:, width:])
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
