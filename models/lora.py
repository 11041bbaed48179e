"""LoRA: low-rank adapters applied to a built model, a pass over its projections and routed experts.

`apply_lora(model, lora)` wraps every weight a config targets (by its HF module name, as PEFT's
`target_modules` do) in an adapter module holding the weight as `base` and two `LoRAParam`s:
`lora_a (*in, rank)` and `lora_b (rank, *out)`, with a leading layer axis inside a stack, so a
weight `W` computes `x @ W + scale * (x @ A) @ B` (`scale = alpha / rank`) and the frozen
matmul gets no gradient. `A` carries the weight's input logical axes and `B` its output axes,
so the sharding rules place them as they place the weight; the rank axis, "lora_rank", is
replicated. `B` starts at zero (for embeddings `A`, as PEFT does), so a new adapter leaves the
model unchanged; adapters draw their initial values from their own stream, so the base is the
same with and without them.

"experts" adapts DeepSeek-V3's routed experts as PEFT's `target_parameters` adapt transformers'
fused expert weights: one adapter per expert on `gate_up_proj` (gate and up share its `A`) and one
on `down_proj`, sharded over the expert axis with their experts and applied inside the expert
dispatch beside each grouped matmul (`AdaptedExperts`); the base experts then get no gradient.

Training drops an adapter's inputs at `lora.dropout` under `dropout(key)`: the mask of each
adapter comes from that key (the adapters' stream folded with the step and micro-batch) folded
with its stack, its layer and its target, so it is the same on any mesh and a resumed run draws
what the uninterrupted one would have.

With `slots=N`, every adapter holds N independent adapters along an adapter axis after the layer
axis (`A (layers, N, *in, rank)`, logical name "lora_adapters"), all empty (zero) until a slot is
initialised (`init_slot`). The model then runs inside `rows(...)`, which gives each batch row its
slot, that adapter's scale and its rank: ranks above a row's rank are masked, so adapters of any
rank up to the built one share a batch. Routed experts' adapters carry the adapter axis after the
expert axis (`A (layers, E, N, D, rank)`), and each row's tokens take its slot's through the
expert dispatch.

In a model with tied embeddings, "lm_head" adapts the output projection alone (`LoRATiedHead`), as
PEFT's adapter on such a model's `lm_head` does: the logits are `h @ E^T + scale * (h @ A) @ B`
and the embedding the input reads is unchanged.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from podtrain.models.config import ModelConfig
from podtrain.models.embedding import Embedding
from podtrain.models.linear import Linear, dense, gathered
from podtrain.models.lora_experts import LoRAExperts
from podtrain.models.lora_rows import Rows, current_rows, rows  # noqa: F401 (re-exported)
from podtrain.models.moe.block import MoE
from podtrain.models.runner import created_layers, current_layer
from podtrain.sharding.rules import constrain

ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLA_TARGETS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
TARGETS = (*ATTENTION_TARGETS, *MLA_TARGETS, *MLP_TARGETS, "experts", "embed_tokens", "lm_head")
# The HF module name of each projection weight, by its attribute name in the model.
WEIGHT_TARGETS = {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj", "wq_a": "q_a_proj",
                  "wq_b": "q_b_proj", "wkv_a": "kv_a_proj_with_mqa", "wkv_b": "kv_b_proj", "w_gate": "gate_proj",
                  "w_up": "up_proj", "w_down": "down_proj", "embed": "embed_tokens", "lm_head": "lm_head"}
# The adapters' own random stream: `train.seed`'s key folded with this.
_STREAM = 0x10A


@dataclass(frozen=True)
class LoRAConfig:
    """`rank` 0 means no adapters. `alpha / rank` scales the update (PEFT's `lora_alpha`);
    `dropout` is the rate at which training drops an adapter's inputs (PEFT's `lora_dropout`);
    `targets` are HF module names (`TARGETS`); `base` is what a training run adapts (an HF
    directory or a podtrain checkpoint; None: the base `train.seed` makes), `init` a PEFT adapter
    its adapters start from (None: new adapters)."""

    rank: int = 0
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    base: str | None = None
    init: str | None = None

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def wants(self, target: str) -> bool:
        return self.rank > 0 and target in self.targets

    def validate(self, prefix: str = "lora") -> None:
        if self.rank < 0:
            raise ValueError(f"{prefix}.rank: expected 0 (no adapters) or a positive integer, found {self.rank}")
        if not self.alpha > 0:
            raise ValueError(f"{prefix}.alpha: expected a number > 0, found {self.alpha}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"{prefix}.dropout: expected a rate in [0, 1), found {self.dropout}")
        undropped = [t for t in ("experts", "lm_head") if t in self.targets]
        if self.dropout and undropped:
            raise ValueError(f"{prefix}.dropout: expected 0 with the target(s) {undropped}, found {self.dropout} (the "
                             "experts' adapters, as PEFT's on fused expert weights, and the LM head's, which the loss "
                             "reads merged into the head, take no dropout); set lora.dropout=0 or leave them out")
        unknown = [t for t in self.targets if t not in TARGETS]
        if unknown:
            raise ValueError(f"{prefix}.targets: unknown module name(s) {unknown}; expected some of {list(TARGETS)}")
        if self.rank and not self.targets:
            raise ValueError(f"{prefix}.targets: expected at least one module name with {prefix}.rank > 0")


class LoRAParam(nnx.Param):
    """A LoRA adapter matrix: what a LoRA run trains and checkpoints."""


_DROPOUT_KEY: contextvars.ContextVar = contextvars.ContextVar("podtrain_lora_dropout", default=None)


@contextlib.contextmanager
def dropout(key: jax.Array | None):
    """Inside the block, model calls drop their adapters' inputs at `lora.dropout`, masks drawn from
    `key` (training: `dropout_stream(seed, step)` folded with the micro-batch); None drops nothing."""
    token = _DROPOUT_KEY.set(key)
    try:
        yield
    finally:
        _DROPOUT_KEY.reset(token)


def dropout_stream(seed: int, step) -> jax.Array:
    """The adapters' stream of `seed` folded with the training `step`."""
    return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), _STREAM), step)


def _param(value, names) -> LoRAParam:
    # Sharding comes from the logical names (`sharding/`), never eagerly at creation.
    return LoRAParam(nnx.with_partitioning(lambda *_: value, tuple(names), eager_sharding=False)(None))


class Adapter(nnx.Module):
    """`scale * (x @ A) @ B` beside a weight of input shape `(*lead, *in)` and output `out`: `A`
    is `(*lead, *in, rank)` and `B` `(*lead, rank, *out)`, `lead` the stack's layer axis and
    (experts) the expert axis or (`slots` > 0) the adapter axis, which index independent adapters."""

    def __init__(self, a: jax.Array, b: jax.Array, names_a, names_b, *, n_in: int, scale: float, target: str,
                 rate: float, stack: int | None, slots: int = 0):
        self.lora_a, self.lora_b = _param(a, names_a), _param(b, names_b)
        self.n_in, self.scale, self.target, self.rate, self.stack = n_in, scale, target, rate, stack
        self.slots = slots

    @property
    def per_row(self) -> bool:
        """Whether each batch row picks its adapter (`rows`)."""
        return self.slots > 0

    def dropped(self, x: jax.Array) -> jax.Array:
        """The adapter's input `x` in training: each entry zeroed at the dropout rate and the rest
        scaled up to keep the mean, as PEFT's `lora_dropout` does; `x` itself outside `dropout(key)`."""
        key = _DROPOUT_KEY.get()
        if key is None or not self.rate:
            return x
        for index in (self.stack, current_layer(), TARGETS.index(self.target)):
            key = jax.random.fold_in(key, 0 if index is None else index)
        keep = jax.random.bernoulli(key, 1 - self.rate, x.shape)
        return jnp.where(keep, x / jnp.asarray(1 - self.rate, x.dtype), jnp.zeros((), x.dtype))

    def update(self, x: jax.Array, dtype) -> jax.Array:
        """`scale * (x @ A) @ B` in `dtype`, each matrix gathered once over the batch axes."""
        if self.slots:
            return self._row_update(x, dtype)
        a = gathered(self.lora_a[...].astype(dtype), self.lora_a.get_metadata().get("out_sharding"))
        b = gathered(self.lora_b[...].astype(dtype), self.lora_b.get_metadata().get("out_sharding"))
        return dense(dense(self.dropped(x), a, self.n_in), b) * jnp.asarray(self.scale, dtype)

    def row_factors(self, x_B: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
        """(low (B, N, r), B (B, r, *out)): row b's `scale[b] * x[b] @ A[index[b]]` over its N
        inputs, ranks from `rank[b]` on masked, and `B[index[b]]`; the update is `low @ B`."""
        current = current_rows()
        a = gathered(self.lora_a[...].astype(dtype), self.lora_a.get_metadata().get("out_sharding"))[current.index]
        b = gathered(self.lora_b[...].astype(dtype), self.lora_b.get_metadata().get("out_sharding"))[current.index]
        batch, rank = a.shape[0], a.shape[-1]
        low = jnp.einsum("bti,bir->btr", self.dropped(x_B).reshape(batch, -1, math.prod(a.shape[1:-1])),
                         a.reshape(batch, -1, rank))
        keep = (jnp.arange(rank) < current.rank[:, None]) * current.scale[:, None]
        return low * keep[:, None, :].astype(dtype), b

    def _row_update(self, x_B: jax.Array, dtype) -> jax.Array:
        """Row b's `scale[b] * (x[b] @ A[index[b]]) @ B[index[b]]`, ranks from `rank[b]` on masked:
        one gathered einsum, so the work is one adapter's whatever the number of adapters."""
        low, b = self.row_factors(x_B, dtype)
        batch, rank = low.shape[0], low.shape[-1]
        out = jnp.einsum("btr,bro->bto", low, b.reshape(batch, rank, -1))
        return out.reshape(*x_B.shape[: x_B.ndim - self.n_in], *b.shape[2:])

    def delta(self) -> jax.Array:
        """`scale * A @ B`, shaped as the weight (leading axes included), in float32."""
        if self.slots:
            raise ValueError(f"{self.target}: an adapter with slots has no single update; take one slot's "
                             "adapter first (`slot_view`)")
        a, b = self.lora_a[...].astype(jnp.float32), self.lora_b[...].astype(jnp.float32)
        lead = a.ndim - self.n_in - 1
        a = a.reshape(*a.shape[:lead], -1, a.shape[-1])
        update = jnp.einsum("...ir,...ro->...io", a, b.reshape(*b.shape[: lead + 1], -1))
        return (update * self.scale).reshape(*self.lora_a.shape[:-1], *self.lora_b.shape[lead + 1:])


class AdaptedWeight(Adapter):
    """A weight with an adapter, the weight kept as `base`."""

    def __init__(self, base: Linear | Embedding, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.base = base

    def axes(self) -> tuple:
        """The weight's logical axes."""
        return self.base.axes()

    def frozen(self) -> jax.Array:
        """The weight without its adapter, as stored."""
        return self.base[...]

    def merged(self) -> jax.Array:
        """`W + scale * A @ B` as the weight is stored."""
        w = self.frozen()
        return (w.astype(jnp.float32) + self.delta()).astype(w.dtype)


class LoRALinear(AdaptedWeight):
    """A `Linear` with an adapter: `base(x) + scale * (x @ A) @ B`."""

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.base(x) + self.update(x, x.dtype)

    def matrix(self, dtype) -> jax.Array:
        """The merged weight as a matmul in `dtype` reads it."""
        return gathered(self.merged().astype(dtype), self.axes())

    def contract(self, equation: str, x: jax.Array, dtype, part: slice = slice(None)) -> jax.Array:
        """`einsum(equation, x, W[..., part])` with the adapter's update in `W`: merged, or with
        slots the base's product plus each row's low-rank one (`x` leads with the batch rows)."""
        if not self.slots:
            return jnp.einsum(equation, x, self.matrix(dtype)[..., part])
        (x_axes, w_axes), out_axes = equation.split("->")[0].split(","), equation.split("->")[1]
        w_in, w_out, row = w_axes[: self.n_in], w_axes[self.n_in:], x_axes[0]
        k = next(c for c in "zyxwvu" if c not in equation)  # the adapter's rank
        current = current_rows()
        a = gathered(self.lora_a[...].astype(dtype), self.lora_a.get_metadata().get("out_sharding"))[current.index]
        b = gathered(self.lora_b[...].astype(dtype), self.lora_b.get_metadata().get("out_sharding"))[current.index]
        keep = ((jnp.arange(a.shape[-1]) < current.rank[:, None]) * current.scale[:, None]).astype(dtype)
        low = jnp.einsum(f"{x_axes},{row}{w_in}{k},{row}{k}{w_out},{row}{k}->{out_axes}", x, a, b[..., part], keep)
        return self.base.contract(equation, x, dtype, part) + low


class LoRATiedHead(AdaptedWeight):
    """The output projection `(hidden, vocab)` of a model with tied embeddings, with an adapter:
    `base` is the model's embedding (the same variable, so it is stored once), read transposed."""

    def axes(self) -> tuple:
        return self.base.axes()[::-1]

    def frozen(self) -> jax.Array:
        return self.base[...].T

    def __call__(self, h: jax.Array) -> jax.Array:
        return dense(h, gathered(self.frozen().astype(h.dtype), self.axes())) + self.update(h, h.dtype)


class LoRAEmbedding(AdaptedWeight):
    """An `Embedding` with an adapter: the rows of the table plus `scale * A[ids] @ B`."""

    def __call__(self, ids_BT: jax.Array, dtype) -> jax.Array:
        if self.slots:
            current = current_rows()
            a, b = self.lora_a[...].astype(dtype), self.lora_b[...].astype(dtype)
            low = a[current.index[:, None], ids_BT]  # (B, T, r)
            keep = (jnp.arange(a.shape[-1]) < current.rank[:, None]) * current.scale[:, None]
            update = jnp.einsum("btr,brd->btd", low * keep[:, None, :].astype(dtype), b[current.index])
        else:
            low = jnp.take(self.lora_a[...].astype(dtype), ids_BT, axis=0)
            update = dense(low, self.lora_b[...].astype(dtype)) * jnp.asarray(self.scale, dtype)
        return self.base(ids_BT, dtype) + constrain(update, ("batch", "seq", "act_embed"))


def _stacked(variable: nnx.Variable) -> bool:
    names = variable.get_metadata().get("out_sharding") or ()
    return bool(names) and names[0] == "layers"


# Adapters are float32 whatever the base's dtype, as PEFT's `autocast_adapter_dtype` keeps them.
ADAPTER_DTYPE = jnp.float32


def _adapter_values(key, in_shape, out_shape, lead: int, dtype, rank: int, *, embedding: bool, batch=(),
                    empty: bool = False):
    """Initial `(A, B)` of adapters on `lead` created layers (0: unstacked) of a weight: PEFT's init,
    each layer from the key folded with its index (the index a `created_layers` stack gives it);
    with `empty`, zeros (adapter slots before `init_slot`)."""
    a_shape, b_shape = (*batch, *in_shape, rank), (*batch, rank, *out_shape)

    def one(key):
        key_a, key_b = jax.random.split(key)
        if empty:
            return jnp.zeros(a_shape, dtype), jnp.zeros(b_shape, dtype)
        if embedding:  # PEFT's init: for embeddings A zero and B normal, else A kaiming-uniform and B zero
            return jnp.zeros(a_shape, dtype), jax.random.normal(key_b, b_shape, dtype)
        bound = 1 / math.sqrt(math.prod(in_shape))
        return jax.random.uniform(key_a, a_shape, dtype, -bound, bound), jnp.zeros(b_shape, dtype)

    if not lead:
        return one(key)
    return jax.vmap(lambda i: one(jax.random.fold_in(key, i)))(created_layers(lead))


def _wrap_linear(weight: Linear | Embedding, target: str, lora: LoRAConfig, key, stack: int | None, slots: int):
    names = tuple(weight.get_metadata().get("out_sharding") or (None,) * weight.ndim)
    lead = 1 if _stacked(weight) else 0
    embedding = isinstance(weight, Embedding)
    n_in = 1 if embedding else weight.n_in
    in_shape, out_shape = weight.shape[lead:lead + n_in], weight.shape[lead + n_in:]
    batch, batch_names = ((slots,), ("lora_adapters",)) if slots else ((), ())
    a, b = _adapter_values(key, in_shape, out_shape, weight.shape[0] if lead else 0, ADAPTER_DTYPE, lora.rank,
                           embedding=embedding, batch=batch, empty=bool(slots))
    lead_names = (*names[:lead], *batch_names)
    in_names, out_names = names[lead:lead + n_in], names[lead + n_in:]
    args = (a, b, (*lead_names, *in_names, "lora_rank"), (*lead_names, "lora_rank", *out_names))
    kwargs = dict(n_in=n_in, scale=lora.scale, target=target, rate=lora.dropout, stack=stack, slots=slots)
    return LoRAEmbedding(weight, *args, **kwargs) if embedding else LoRALinear(weight, *args, **kwargs)


def _wrap_tied_head(embed: Embedding, lora: LoRAConfig, key, slots: int) -> LoRATiedHead:
    (vocab, hidden), (vocab_name, hidden_name) = embed.shape, embed.axes() or (None, None)
    batch, batch_names = ((slots,), ("lora_adapters",)) if slots else ((), ())
    a, b = _adapter_values(key, (hidden,), (vocab,), 0, ADAPTER_DTYPE, lora.rank, embedding=False, batch=batch,
                           empty=bool(slots))
    return LoRATiedHead(embed, a, b, (*batch_names, hidden_name, "lora_rank"), (*batch_names, "lora_rank", vocab_name),
                        n_in=1, scale=lora.scale, target="lm_head", rate=lora.dropout, stack=None, slots=slots)


def _wrap_experts(moe: MoE, lora: LoRAConfig, stream, where: str, stack: int | None, slots: int) -> LoRAExperts:
    """Adapters on `moe`'s experts, each drawn from `stream` folded with its path (`adapters`' key)."""
    stacked = _stacked(moe.w_gate)
    *layers, experts, d, f = moe.w_gate.shape
    dtype = ADAPTER_DTYPE
    kwargs = dict(scale=lora.scale, target="experts", rate=0.0, stack=stack, slots=slots)
    batch, batch_names = ((experts, slots), ("experts", "lora_adapters")) if slots else ((experts,), ("experts",))
    lead, count = ("layers", *batch_names) if stacked else batch_names, layers[0] if stacked else 0

    def values(name, in_shape, out_shape):
        key = jax.random.fold_in(stream, zlib.crc32(f"{where}.{name}".encode()))
        return _adapter_values(key, in_shape, out_shape, count, dtype, lora.rank, embedding=False, batch=batch,
                               empty=bool(slots))

    gate_up = Adapter(*values("w_gate_up", (d,), (2, f)), (*lead, "embed", "lora_rank"),
                      (*lead, "lora_rank", None, "mlp"), n_in=1, **kwargs)
    down = Adapter(*values("w_down", (f,), (d,)), (*lead, "mlp", "lora_rank"), (*lead, "lora_rank", "embed"), n_in=1,
                   **kwargs)
    return LoRAExperts(moe, gate_up, down)


def apply_lora(model: nnx.Module, lora: LoRAConfig, seed: int = 0, *, slots: int = 0) -> nnx.Module:
    """`model` with adapters on the weights `lora` targets (changed in place and returned); a
    model without adapters when `lora.rank` is 0. Adapters draw from `seed`'s adapter stream folded
    with each weight's path, so a weight's adapters are the same whatever else is targeted. With
    `slots`, each adapter holds that many empty adapters of rank up to `lora.rank` (see `rows`)."""
    if not lora.rank:
        return model
    lora.validate()
    if isinstance(getattr(model, "config", None), ModelConfig):  # a whole model, not a block of one
        check_targets(lora, model.config)
        if slots:
            check_slot_targets(lora, model.config)
    stream = jax.random.fold_in(jax.random.key(seed), _STREAM)
    stacks = {id(stack): i for i, stack in enumerate(model.stacks())} if hasattr(model, "stacks") else {}
    for path, module in list(nnx.iter_modules(model)):
        stack = next((stacks[id(m)] for m in _ancestors(model, path) if id(m) in stacks), None)
        for name, value in list(vars(module).items()):
            where = ".".join(str(p) for p in (*path, name))
            key = jax.random.fold_in(stream, zlib.crc32(where.encode()))
            if isinstance(value, MoE) and lora.wants("experts"):
                setattr(module, name, _wrap_experts(value, lora, stream, where, stack, slots))
            elif isinstance(value, Linear | Embedding) and lora.wants(WEIGHT_TARGETS.get(name, "")):
                setattr(module, name, _wrap_linear(value, WEIGHT_TARGETS[name], lora, key, stack, slots))
    if getattr(model, "lm_head", 0) is None and lora.wants("lm_head"):  # tied to the embedding
        key = jax.random.fold_in(stream, zlib.crc32(b"lm_head"))
        model.lm_head = nnx.data(_wrap_tied_head(model.embed, lora, key, slots))  # was a static None
    if isinstance(model, MoE) and lora.wants("experts"):  # a MoE block alone
        return _wrap_experts(model, lora, stream, "", None, slots)
    return model


def check_targets(lora: LoRAConfig, config) -> None:
    """Raises ValueError naming `lora.targets` for a target the model (a `ModelConfig`) lacks."""
    if not lora.rank:
        return
    if config.tie_word_embeddings and lora.wants("lm_head") and lora.wants("embed_tokens"):
        raise ValueError("lora.targets: lm_head and embed_tokens are one weight in a model with tied embeddings "
                         "(model.tie_word_embeddings); target one of them")
    if lora.wants("experts") and not config.num_moe_layers:
        raise ValueError(f"lora.targets: experts adapts routed experts, and this {config.model_type} model has none; "
                         "remove it from lora.targets")


def check_slot_targets(lora: LoRAConfig, config) -> None:
    """Raises ValueError naming `lora.targets` for a target that cannot hold adapter slots."""
    if config.tie_word_embeddings and lora.wants("embed_tokens"):
        raise ValueError("lora.targets: embed_tokens is also the LM head in a model with tied embeddings "
                         "(model.tie_word_embeddings), which takes no adapter slots; remove it from lora.targets")


def _ancestors(model: nnx.Module, path: Sequence) -> list[nnx.Module]:
    """The modules on the way from `model` to the one at `path` (that one included)."""
    modules, node = [], model
    for part in path:
        node = getattr(node, part) if isinstance(part, str) else node[part]
        modules.append(node)
    return modules


def _plain_path(model: nnx.Module, path: Sequence) -> tuple:
    """`path` without its steps into adapters' `base`: the path in the model without adapters."""
    parts, node = [], model
    for part in path:
        if not (part == "base" and isinstance(node, Adapter | LoRAExperts)):
            parts.append(part)
        node = getattr(node, part) if isinstance(part, str) else node[part]
    return tuple(parts)


def with_base(model: nnx.Module, plain: nnx.State, keep=None) -> nnx.State:
    """The variables of `model` (a model with adapters, abstract or not) that `keep` matches
    (default: all but the adapters), each the value `plain` (a state of the same model without
    adapters) holds at its path there."""
    values = dict(nnx.to_flat_state(plain))
    kept = nnx.filterlib.to_predicate(nnx.Not(LoRAParam) if keep is None else keep)
    return nnx.from_flat_state([(path, var.replace(values[_plain_path(model, path)].get_value()))
                                for path, var in nnx.to_flat_state(nnx.state(model)) if kept(path, var)])


def adapters(model: nnx.Module):
    """(the adapted weight's path in the model without adapters, adapter) of every adapter; an
    experts adapter's path is its MoE block's followed by `w_gate_up` or `w_down`."""
    for path, module in nnx.iter_modules(model):
        key = ".".join(str(p) for p in _plain_path(model, path))
        if isinstance(module, AdaptedWeight):
            yield key, module
        elif isinstance(module, LoRAExperts):
            yield f"{key}.w_gate_up", module.gate_up
            yield f"{key}.w_down", module.down


def merged(model: nnx.Module) -> nnx.State:
    """The parameters of the same model without adapters, each adapter's update added to its
    weight (`W + scale * A @ B`, in the weights' dtype). `model` is not changed."""
    plain = nnx.clone(model)
    for _, module in list(nnx.iter_modules(plain)):
        for name, value in list(vars(module).items()):
            if isinstance(value, LoRATiedHead):
                raise ValueError("lora.targets: the LM head's adapter of a model with tied embeddings cannot be "
                                 "merged into it (its head is its embedding); keep the adapter apart (PEFT)")
            if isinstance(value, AdaptedWeight):
                setattr(module, name, value.base.replace(value.merged()))
            elif isinstance(value, LoRAExperts):
                moe, gate_up = value.base, value.gate_up.delta()  # (..., E, D, 2, F)
                for w, delta in ((moe.w_gate, gate_up[..., 0, :]), (moe.w_up, gate_up[..., 1, :]),
                                 (moe.w_down, value.down.delta())):
                    w.set_value((w[...].astype(jnp.float32) + delta).astype(w.dtype))
                setattr(module, name, moe)
    return nnx.state(plain)

