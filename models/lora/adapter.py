"""The adapter modules: `A (*in, rank)` and `B (rank, *out)` beside a weight, so that the weight
`W` computes `x @ W + scale * (x @ A) @ B`; their initial values (PEFT's) and training's dropout of
their inputs.

`A` carries the weight's input logical axes and `B` its output axes, so the sharding rules place
them as they place the weight; the rank axis, "lora_rank", is replicated. Adapters are float32
whatever the base's dtype (PEFT's `autocast_adapter_dtype`) and draw their initial values from
their own stream (`STREAM`), so the base is the same with and without them. With slots (an adapter
axis, "lora_adapters"), each batch row takes its own slot's adapter (`lora.rows`).
"""

from __future__ import annotations

import contextlib
import contextvars
import math

import jax
import jax.numpy as jnp
from flax import nnx

from podtrain.models.embedding import Embedding
from podtrain.models.linear import Linear, dense, gathered
from podtrain.models.lora.config import TARGETS
from podtrain.models.lora.rows import current_rows
from podtrain.models.runner import created_layers, current_layer
from podtrain.sharding.rules import axes_of, constrain, logical_to_spec

# The adapters' own random stream: `train.seed`'s key folded with this.
STREAM = 0x10A
ADAPTER_DTYPE = jnp.float32


class LoRAParam(nnx.Param):
    """A LoRA adapter matrix: what a LoRA run trains and checkpoints."""


_DROPOUT_KEY: contextvars.ContextVar = contextvars.ContextVar("podtrain_lora_dropout", default=None)


@contextlib.contextmanager
def dropout(key: jax.Array | None):
    """Inside the block, model calls drop their adapters' inputs at `lora.dropout`, masks drawn from
    `key` (training: `dropout_stream(seed, step)` folded with the micro-batch); None drops nothing.

    The mask of each adapter is that key folded with its stack, its layer and its target, so it is
    the same on any mesh and a resumed run draws what the uninterrupted one would have."""
    token = _DROPOUT_KEY.set(key)
    try:
        yield
    finally:
        _DROPOUT_KEY.reset(token)


def adapter_stream(seed) -> jax.Array:
    """The key every adapter of `seed` draws from (folded with its own path)."""
    return jax.random.fold_in(jax.random.key(seed), STREAM)


def dropout_stream(seed: int, step) -> jax.Array:
    """The adapters' stream of `seed` folded with the training `step`."""
    return jax.random.fold_in(adapter_stream(seed), step)


def lora_param(value, names) -> LoRAParam:
    """`value` as an adapter matrix of logical axes `names` (placed by the rules, never eagerly)."""
    return LoRAParam(nnx.with_partitioning(lambda *_: value, tuple(names), eager_sharding=False)(None))


def initial_values(key, in_shape, out_shape, lead: int, dtype, rank: int, *, embedding: bool, batch=(),
                   empty: bool = False):
    """Initial `(A, B)` of adapters on `lead` created layers (0: unstacked) of a weight: PEFT's init
    (for embeddings A zero and B normal, else A kaiming-uniform and B zero), each layer from the key
    folded with its index (the index a `created_layers` stack gives it); `batch` axes lead each
    layer's arrays (experts, adapter slots); with `empty`, zeros (adapter slots before `init_slot`)."""
    a_shape, b_shape = (*batch, *in_shape, rank), (*batch, rank, *out_shape)

    def one(key):
        key_a, key_b = jax.random.split(key)
        if empty:
            return jnp.zeros(a_shape, dtype), jnp.zeros(b_shape, dtype)
        if embedding:
            return jnp.zeros(a_shape, dtype), jax.random.normal(key_b, b_shape, dtype)
        bound = 1 / math.sqrt(math.prod(in_shape))
        return jax.random.uniform(key_a, a_shape, dtype, -bound, bound), jnp.zeros(b_shape, dtype)

    if not lead:
        return one(key)
    return jax.vmap(lambda i: one(jax.random.fold_in(key, i)))(created_layers(lead))


def _rows_of(param: LoRAParam, index: jax.Array, dtype) -> jax.Array:
    """`param`'s adapters of the batch rows (`index` into its leading adapter axis) in `dtype`,
    whole along the axes the batch axes hold. Each device receives the fewer of: its own rows'
    adapters (laid out as the rows, over the batch axes), or every slot's (gathered as FSDP
    gathers a weight). Cast after the rows are taken, so each slot's gradient sums its rows' in
    float32 and no table-sized cast is made."""
    names = param.get_metadata()["out_sharding"]
    value = param[...]
    names = names[len(names) - value.ndim:]  # one layer of a stack: no layer axis
    if names[0] != "lora_adapters":
        raise ValueError(f"adapter slots: expected the adapter axis first, found axes {names}")
    mesh = jax.sharding.get_abstract_mesh()
    sizes = {} if mesh is None or mesh.empty else dict(mesh.shape)
    shards = math.prod(sizes[a] for a in axes_of(logical_to_spec(("batch",), sizes)[0]))
    if value.shape[0] * shards <= index.shape[0]:
        return gathered(value, names)[index].astype(dtype)
    return constrain(value[index].astype(dtype), ("batch", *names[1:]))


class Adapter(nnx.Module):
    """`scale * (x @ A) @ B` beside a weight of input shape `(*lead, *in)` and output `out`: `A`
    is `(*lead, *in, rank)` and `B` `(*lead, rank, *out)`, `lead` the stack's layer axis and
    (experts) the expert axis or (`slots` > 0) the adapter axis, which index independent adapters."""

    def __init__(self, a: jax.Array, b: jax.Array, names_a, names_b, *, n_in: int, scale: float, target: str,
                 rate: float, stack: int | None, slots: int = 0):
        self.lora_a, self.lora_b = lora_param(a, names_a), lora_param(b, names_b)
        self.n_in, self.scale, self.target, self.rate, self.stack = n_in, scale, target, rate, stack
        self.slots = slots

    @property
    def per_row(self) -> bool:
        """Whether each batch row picks its adapter (`rows`)."""
        return self.slots > 0

    def slot_axis(self) -> int:
        """The adapter axis of an adapter with slots (after its layer and expert axes)."""
        return self.lora_a.get_metadata()["out_sharding"].index("lora_adapters")

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

    def matrices(self, dtype) -> tuple[jax.Array, jax.Array]:
        """(A, B) in `dtype`, each gathered once over the batch axes."""
        return (gathered(self.lora_a[...].astype(dtype), self.lora_a.get_metadata().get("out_sharding")),
                gathered(self.lora_b[...].astype(dtype), self.lora_b.get_metadata().get("out_sharding")))

    def update(self, x: jax.Array, dtype) -> jax.Array:
        """`scale * (x @ A) @ B` in `dtype`, each matrix gathered once over the batch axes."""
        if self.slots:
            return self._row_update(x, dtype)
        a, b = self.matrices(dtype)
        return dense(dense(self.dropped(x), a, self.n_in), b) * jnp.asarray(self.scale, dtype)

    def row_matrices(self, dtype) -> tuple[jax.Array, jax.Array]:
        """(A[index[b]], B[index[b]]) of every batch row b, in `dtype`: each slot's matrices stay
        where they are stored (sharded over the batch axes, `lora_slot_rank`) and only the rows'
        adapters travel, to the devices that hold those rows, whatever the number of slots."""
        index = current_rows().index
        return tuple(_rows_of(m, index, dtype) for m in (self.lora_a, self.lora_b))

    def row_factors(self, x_B: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
        """(low (B, N, r), B (B, r, *out)): row b's `scale[b] * x[b] @ A[index[b]]` over its N
        inputs, ranks from `rank[b]` on masked, and `B[index[b]]`; the update is `low @ B`."""
        current = current_rows()
        a, b = self.row_matrices(dtype)
        batch, rank = a.shape[0], a.shape[-1]
        low = jnp.einsum("bti,bir->btr", self.dropped(x_B).reshape(batch, -1, math.prod(a.shape[1:-1])),
                         a.reshape(batch, -1, rank))
        return low * current.mask(rank, dtype)[:, None, :], b

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

    def is_one_matrix(self) -> bool:
        """Not with slots (each row its own adapter) or while dropout drops the adapter's inputs."""
        return not self.slots and not (self.rate and _DROPOUT_KEY.get() is not None)

    def contract(self, equation: str, x: jax.Array, dtype, part: slice = slice(None)) -> jax.Array:
        """`einsum(equation, x, W[..., part])` with the adapter's update in `W`: merged, or with
        slots the base's product plus each row's low-rank one (`x` leads with the batch rows)."""
        if not self.slots:
            return jnp.einsum(equation, x, self.matrix(dtype)[..., part])
        (x_axes, w_axes), out_axes = equation.split("->")[0].split(","), equation.split("->")[1]
        w_in, w_out, row = w_axes[: self.n_in], w_axes[self.n_in:], x_axes[0]
        k = next(c for c in "zyxwvu" if c not in equation)  # the adapter's rank
        current = current_rows()
        a, b = self.row_matrices(dtype)
        keep = current.mask(a.shape[-1], dtype)
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
            low = self.lora_a[...][current.index[:, None], ids_BT].astype(dtype)  # (B, T, r)
            b = _rows_of(self.lora_b, current.index, dtype)
            update = jnp.einsum("btr,brd->btd", low * current.mask(low.shape[-1], dtype)[:, None, :], b)
        else:
            low = jnp.take(self.lora_a[...].astype(dtype), ids_BT, axis=0)
            update = dense(low, self.lora_b[...].astype(dtype)) * jnp.asarray(self.scale, dtype)
        return self.base(ids_BT, dtype) + constrain(update, ("batch", "seq", "act_embed"))
