"""Expert parallelism: tokens travel to the devices that own their experts and back (all-to-all).

Expert weights `(E, ...)` are sharded over the mesh axis the rule for "experts" names (`ep` by
default); tokens are sharded over the batch axes, which must include it. Inside one `shard_map`
each device sorts its token-expert assignments by expert, packs them into a per-expert buffer of
`capacity` places, and an all-to-all over the expert axis hands every device the places of its
own experts from every device. It runs only its `E / ep` experts on them (all-gathering the weight
dimensions sharded over `fsdp`, summing partial results over `tp`), and a second all-to-all
brings the results home, where they are weighted and summed per token. Partial results are summed
only over mesh axes that split the expert hidden dimension but not the tokens (devices along such
an axis hold the same tokens); a hidden dimension split over a token axis is all-gathered instead.
Whatever arrays the experts object holds (`moe.experts`) travel and are gathered alike. Experts
with adapter slots get each batch row's slot (`adapter_B`), which travels with its tokens.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from podtrain.models.kernels.grouped_matmul import grouped_matmul
from podtrain.models.moe.dropless import Kernels, buffer_rows, dropless_rows
from podtrain.models.moe.experts import EXPERT_GATE_NAMES, run_experts
from podtrain.sharding.rules import axes_of, logical_to_spec


def capacity(tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """Buffer places per expert for `tokens` tokens of one shard.

    Dropless (`capacity_factor == 0`): `tokens`, as a token picks an expert at most once.
    Otherwise `ceil(capacity_factor * tokens * top_k / num_experts)`, at most `tokens`.
    """
    if capacity_factor <= 0:
        return tokens
    return max(1, min(tokens, math.ceil(capacity_factor * tokens * top_k / num_experts)))


def _places(tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int | None:
    """The capacity dispatch's places per expert, or None for the dropless dispatch."""
    return capacity(tokens, top_k, num_experts, capacity_factor) if capacity_factor > 0 else None


def _gather_weights(experts, *, embed_axes, mlp_axes, token_axes):
    """My experts' arrays with the dimensions sharded over `fsdp`-like axes all-gathered, and the
    mesh axes whose partial results are to be summed (they split F but hold the same tokens)."""
    gathered_mlp = tuple(a for a in mlp_axes if a in token_axes)  # devices there hold other tokens
    gather = {"embed": embed_axes, "mlp": gathered_mlp}

    def gathered(w, names):
        for dim, name in enumerate(names):
            if gather.get(name):
                w = jax.lax.all_gather(w, gather[name], axis=dim, tiled=True)
        return w

    return jax.tree.map(gathered, experts, experts.names()), tuple(a for a in mlp_axes if a not in token_axes)


@dataclasses.dataclass(frozen=True)
class _Buffered:
    """The experts' matmuls of rows in fixed buffers `(L, M, K)`: einsums; `adapter` (L, M) is each
    row's adapter slot of `adapters` (None: no slots)."""

    adapter: jax.Array | None
    adapters: int
    kernels: Kernels

    def __call__(self, rows, w_LKN):
        """rows @ w[expert]."""
        return jnp.einsum("eck,ekn->ecn", rows, w_LKN)

    def by_adapter(self, rows, w_LSKN):
        """rows @ w[expert, slot]: the rows sorted by (expert, slot) through a grouped matmul."""
        experts, m, k = rows.shape
        group = (jnp.arange(experts)[:, None] * self.adapters + self.adapter).reshape(-1)
        order = jnp.argsort(group, stable=True)
        sizes = jnp.bincount(group, length=experts * self.adapters).astype(jnp.int32)
        out = grouped_matmul(rows.reshape(experts * m, k)[order], w_LSKN.reshape(-1, k, w_LSKN.shape[-1]), sizes,
                             implementation=self.kernels.grouped_matmul, interpret=self.kernels.interpret)
        return jnp.zeros_like(out).at[order].set(out).reshape(experts, m, -1)


def _capacity_rows(x_ND, token, sorted_expert, sorted_adapter, load, experts, *, num_experts, places, ep_axis, ep,
                   sum_axes, kernels):
    """Capacity dispatch: each expert takes its first `places` rows from each device, in fixed
    buffers moved by all-to-all (with their adapter slots, `sorted_adapter`, if not None). Returns
    (rows' results, kept)."""
    d = x_ND.shape[1]
    local_experts = num_experts // ep
    first = jnp.cumsum(load) - load
    place = jnp.arange(sorted_expert.shape[0]) - first[jnp.minimum(sorted_expert, num_experts - 1)]
    kept = (place < places) & (sorted_expert < num_experts)  # padding tokens pick expert id `num_experts`
    target = jnp.where(kept, sorted_expert * places + place, num_experts * places)

    def to_owners(values):
        """(E * places, ...) buffers in sender order -> (L, ep * places, ...) of my experts."""
        buf = values.reshape(ep, local_experts * places, *values.shape[1:])
        if ep_axis is not None:
            buf = jax.lax.all_to_all(buf, ep_axis, 0, 0)  # [source device] -> places of my experts
        buf = buf.reshape(ep, local_experts, places, *values.shape[1:])
        return jnp.moveaxis(buf, 0, 1).reshape(local_experts, ep * places, *values.shape[1:])

    rows = to_owners(jnp.zeros((num_experts * places, d), x_ND.dtype).at[target].set(x_ND[token], mode="drop"))
    adapter = None if sorted_adapter is None else to_owners(
        jnp.zeros((num_experts * places,), jnp.int32).at[target].set(sorted_adapter, mode="drop"))
    _, _, out = run_experts(experts, rows, _Buffered(adapter, experts.adapters(), kernels))
    if sum_axes:
        out = jax.lax.psum(out, sum_axes)
    out = out.reshape(local_experts, ep, places, d).transpose(1, 0, 2, 3).reshape(ep, local_experts * places, d)
    if ep_axis is not None:
        out = jax.lax.all_to_all(out, ep_axis, 0, 0)  # results back to the devices that sent the tokens
    out = out.reshape(num_experts * places, d)
    return jnp.where(kept[:, None], out[jnp.minimum(target, num_experts * places - 1)], 0), kept


def _local_experts(x_ND, expert_NK, weight_NK, adapter_N, experts, *, num_experts, places, ep_axis, ep, embed_axes,
                   mlp_axes, token_axes, buffer_factor, kernels):
    """One device's dispatch, expert computation and combine (the body of the shard_map).

    `places=None` is dropless: rows sorted by expert (and adapter slot), grouped matmuls over
    exactly those rows (`ragged.dropless_rows`); else the capacity dispatch of `places` per expert
    and device. `adapter_N` is each token's adapter slot (None: no slots).
    """
    n, d = x_ND.shape
    k = expert_NK.shape[1]
    per_expert = experts.adapters()
    flat_expert = expert_NK.reshape(-1)
    flat_adapter = None if adapter_N is None else jnp.repeat(adapter_N.astype(jnp.int32), k)
    group = flat_expert if places is not None or flat_adapter is None else flat_expert * per_expert + flat_adapter
    order = jnp.argsort(group, stable=True)
    sorted_expert = flat_expert[order]
    load = jnp.bincount(flat_expert, length=num_experts)
    token = order // k
    experts, sum_axes = _gather_weights(experts, embed_axes=embed_axes, mlp_axes=mlp_axes, token_axes=token_axes)
    real = sorted_expert < num_experts
    if places is None:
        groups = per_expert if flat_adapter is not None else 1
        counts = jnp.bincount(group, length=num_experts * groups).reshape(1, ep, num_experts // ep * groups)
        if ep_axis is not None:
            counts = jax.lax.all_gather(counts[0], ep_axis)  # (sender, owner, local expert)
        buffer = buffer_rows(n * k, ep, k, num_experts // ep, buffer_factor)
        one_round = buffer >= ep * n * min(k, num_experts // ep)
        contribution = dropless_rows(x_ND[token], weight_NK.reshape(-1)[order], counts, experts, ep_axis, buffer,
                                     sum_axes, one_round, kernels)
        kept = real
    else:
        out, kept = _capacity_rows(x_ND, token, sorted_expert, None if flat_adapter is None else flat_adapter[order],
                                   load, experts, num_experts=num_experts, places=places, ep_axis=ep_axis, ep=ep,
                                   sum_axes=sum_axes, kernels=kernels)
        contribution = out * weight_NK.reshape(-1)[order][:, None].astype(out.dtype)
    y = jnp.zeros((n, d), contribution.dtype).at[token].add(contribution)
    dropped = jnp.sum(real & ~kept).astype(jnp.float32)
    load = load.astype(jnp.float32)
    if token_axes:
        load, dropped = jax.lax.psum(load, token_axes), jax.lax.psum(dropped, token_axes)
    return y, load, dropped


def routed_experts(x_BTD, expert_BTK, weight_BTK, experts, *, capacity_factor: float, buffer_factor: float,
                   kernels: Kernels, adapter_B=None):
    """sum_k weight[k] * expert `expert[k]`(x) for every token, experts run where they live.

    Args:
        x_BTD: tokens (B, T, D), sharded over the batch axes.
        expert_BTK: int expert ids chosen per token (B, T, K).
        weight_BTK: their combine weights (B, T, K).
        experts: the experts (`moe.experts.SwiGLUExperts`, or what a feature made around them),
            in the compute dtype; only their trained arrays get gradients.
        capacity_factor: 0 for dropless, else the per-expert budget of buffer places (see `capacity`).
        buffer_factor: dropless only: rows per exchange round as a multiple of a device's own
            assignments (see `dropless.buffer_rows`); routing beyond it takes more rounds.
        kernels: the dropless dispatch's grouped matmul and exchange.
        adapter_B: int (B,) each batch row's adapter slot, for experts with slots (`adapters()`).

    Returns:
        (y_BTD, load_E, dropped): the combined expert outputs, the tokens routed to each expert
        over the whole batch, and how many token-expert assignments were over capacity (dropped).
    """
    b, t, d = x_BTD.shape
    gate = experts.weights().gate
    num_experts = gate.shape[0]
    options = dict(buffer_factor=buffer_factor, kernels=kernels)
    mesh = jax.sharding.get_abstract_mesh()
    sizes = {} if mesh is None or mesh.empty else dict(mesh.shape)
    adapter_BT = None if adapter_B is None else jnp.broadcast_to(adapter_B.astype(jnp.int32)[:, None], (b, t))
    if not any(size > 1 for size in sizes.values()):
        y, load, dropped = _local_experts(
            x_BTD.reshape(b * t, d), expert_BTK.reshape(b * t, -1), weight_BTK.reshape(b * t, -1),
            None if adapter_BT is None else adapter_BT.reshape(-1), experts, num_experts=num_experts,
            places=_places(b * t, expert_BTK.shape[-1], num_experts, capacity_factor), ep_axis=None, ep=1,
            embed_axes=(), mlp_axes=(), token_axes=(), **options,
        )
        return y.reshape(b, t, d), load, dropped

    specs = jax.tree.map(lambda w, names: logical_to_spec(names, sizes, shape=w.shape, what="MoE expert weights"),
                         experts, experts.names())
    gate_spec = logical_to_spec(EXPERT_GATE_NAMES, sizes, shape=gate.shape, what="MoE expert weights")
    token_spec = logical_to_spec(("batch", "seq"), sizes, what="MoE tokens")
    # The shard_map needs token dimensions its mesh axes divide: a batch of one prompt (generation,
    # samples at evals) on an fsdp or ep mesh gets padding rows, which pick no expert and are dropped.
    pad_b, pad_t = (-n % math.prod(sizes[a] for a in axes_of(entry))
                    for n, entry in zip((b, t), token_spec, strict=True))
    if pad_b or pad_t:
        widths = ((0, pad_b), (0, pad_t), (0, 0))
        y, load, dropped = routed_experts(
            jnp.pad(x_BTD, widths), jnp.pad(expert_BTK, widths, constant_values=num_experts),
            jnp.pad(weight_BTK, widths), experts, capacity_factor=capacity_factor,
            adapter_B=None if adapter_B is None else jnp.pad(adapter_B, (0, pad_b)), **options)
        return y[:b, :t], load, dropped
    expert_axes = axes_of(gate_spec[0])
    token_axes = tuple(a for entry in token_spec for a in axes_of(entry))
    if len(expert_axes) > 1:
        raise ValueError(
            f"sharding.rules.experts: experts can be sharded over one mesh axis, found {list(expert_axes)}"
        )
    if expert_axes and expert_axes[0] not in token_axes:
        raise ValueError(
            f"sharding.rules: experts are sharded over {expert_axes[0]!r}, so tokens must be too; "
            f"add {expert_axes[0]!r} to the rule for 'batch' (found {token_spec})"
        )
    ep_axis = expert_axes[0] if expert_axes else None
    ep = sizes[ep_axis] if ep_axis else 1
    local_tokens = (b * t) // math.prod(sizes[a] for a in token_axes)
    x_spec = PartitionSpec(*token_spec, None)
    body = functools.partial(
        _local_experts, num_experts=num_experts, places=_places(local_tokens, expert_BTK.shape[-1], num_experts,
                                                                capacity_factor),
        ep_axis=ep_axis, ep=ep, embed_axes=axes_of(gate_spec[1]), mlp_axes=axes_of(gate_spec[2]),
        token_axes=token_axes, **options,
    )

    def flat(x, expert, weight, experts, *adapter):
        lb, lt = x.shape[:2]
        y, load, dropped = body(x.reshape(lb * lt, d), expert.reshape(lb * lt, -1), weight.reshape(lb * lt, -1),
                                adapter[0].reshape(-1) if adapter else None, experts)
        return y.reshape(lb, lt, d), load, dropped

    adapters = () if adapter_BT is None else (adapter_BT,)
    return jax.shard_map(
        flat,
        in_specs=(x_spec, x_spec, x_spec, specs, *(PartitionSpec(*token_spec) for _ in adapters)),
        out_specs=(x_spec, PartitionSpec(), PartitionSpec()),
        check_vma=body.keywords["places"] is not None,  # see dropless.dropless_rows
    )(x_BTD, expert_BTK, weight_BTK, experts, *adapters)
