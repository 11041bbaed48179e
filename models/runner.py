"""The stacking helper and the one layer runner (scan, remat policy, stacked KV cache).

Layers are created stacked: every parameter of a stack has shape `(num_layers, ...)` and its
logical names start with "layers". `run_layers` runs a stack for training, prefill and decode
alike: one `jax.lax.scan` whose body is one layer, wrapped in `jax.checkpoint` with the chosen
policy.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx


@dataclasses.dataclass(frozen=True)
class Remat:
    """A remat policy: what the per-layer `jax.checkpoint` saves (`saveable`, a JAX policy; None:
    no checkpoint, everything kept), and what the backward pass then runs again, as the plans
    count it: the whole layer's forward (`reruns_forward`), and how many of the layer's
    tensor-parallel all-reduces (`tp_all_reduces_again`)."""

    saveable: Callable | None
    reruns_forward: bool
    tp_all_reduces_again: int


REMAT = {
    # Keep every intermediate for the backward pass: most memory, no recompute.
    "none": Remat(None, False, 0),
    # Save nothing: the backward pass recomputes the whole layer from its input. Least memory
    # (one residual per layer), about one extra forward of compute.
    "full": Remat(jax.checkpoint_policies.nothing_saveable, True, 1),
    # Save every matmul output: the backward pass recomputes only element-wise work (norms,
    # softmax, activations). Most memory of the remat policies, least recompute.
    "dots": Remat(jax.checkpoint_policies.dots_saveable, False, 0),
    # Save matmuls without batch dimensions (the projections), recompute attention scores.
    "dots_no_batch": Remat(jax.checkpoint_policies.dots_with_no_batch_dims_saveable, False, 0),
    # Save only the attention block's output: the backward pass recomputes the attention
    # sublayer only where it needs its internals, and the MLP from the saved residual.
    "save_attn_out": Remat(jax.checkpoint_policies.save_only_these_names("attn_out"), False, 1),
    # Save q, k, v and the attention output: recompute the MLP and the attention probabilities.
    "save_qkv_attn_out": Remat(jax.checkpoint_policies.save_only_these_names("query", "key", "value", "attn_out"),
                               False, 1),
}


_ONLY_LAYER: contextvars.ContextVar = contextvars.ContextVar("podtrain_only_layer", default=None)
_CURRENT_LAYER: contextvars.ContextVar = contextvars.ContextVar("podtrain_current_layer", default=None)


@contextlib.contextmanager
def only_layer(index):
    """Inside the block, `stack_layers` creates only layer `index` of each stack.

    The result has a leading axis of size 1 and exactly the values the full stack holds at
    `index` (same per-layer key). `index` may be traced, so one compiled program can create any
    layer: this is how `sharding.create_sharded` fills a stacked parameter one layer at a time.
    """
    token = _ONLY_LAYER.set(index)
    try:
        yield
    finally:
        _ONLY_LAYER.reset(token)


def created_layers(num_created: int) -> jax.Array:
    """The indices of the `num_created` layers a stack being created holds: all of them, or under
    `only_layer(index)` that one layer (what a feature adding per-layer values to a built stack
    keys them by)."""
    index = _ONLY_LAYER.get()
    return jnp.arange(num_created, dtype=jnp.int32) if index is None else jnp.reshape(index, (1,)).astype(jnp.int32)


def current_layer() -> jax.Array | None:
    """Inside `run_layers`, the index of the layer being run (traced); None elsewhere."""
    return _CURRENT_LAYER.get()


def stack_layers(make_layer: Callable[[nnx.Rngs], nnx.Module], num_layers: int, rngs: nnx.Rngs) -> nnx.Module:
    """Creates `num_layers` independent layers as one module whose params are `(num_layers, ...)`.

    Layer `i` is `make_layer(nnx.Rngs(params=keys[i]))` for `keys = split(rngs.params(), num_layers)`,
    created under `nnx.vmap`; the leading axis is annotated with the logical name "layers".
    """
    keys = jax.random.split(rngs.params(), num_layers)
    index = _ONLY_LAYER.get()
    if index is not None:
        keys = jax.lax.dynamic_slice_in_dim(keys, jnp.minimum(index, num_layers - 1), 1)

    @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def create(key: jax.Array) -> nnx.Module:
        return make_layer(nnx.Rngs(params=key))

    return create(keys)


def run_layers(
    stack: nnx.Module,
    h: jax.Array,
    *,
    remat: str = "none",
    scan: bool = True,
    kv: tuple[jax.Array, ...] | None = None,
    **layer_kwargs,
):
    """Runs the stacked layers over the hidden state `h`, layer 0 first.

    Args:
        stack: a module made by `stack_layers`; called per layer as
            `layer(h, **layer_kwargs) -> (h, outputs)` (with a cache also `kv=` and `layer=`),
            `outputs` a pytree holding "kv" (the updated cache, or None) and per-layer statistics.
        h: the hidden state entering layer 0.
        remat: a name from `REMAT`; "none" keeps every intermediate for the backward pass.
        scan: True runs one `lax.scan`; False unrolls a Python loop (the reference, and the
            baseline the benchmarks compare against).
        kv: optional stacked cache arrays, each `(num_layers, batch, entries, ...)`, read only:
            layer `i` gets `kv=kv, layer=i` and reads its own entries straight from the stacks
            (closed over by the scan, so never sliced into per-layer copies), and returns its new
            tokens' entries as `outputs["kv"]`; the caller writes them into the cache after the
            scan, in place (`models.kv_cache.write_tokens`). Writing inside the scan would make
            XLA copy the whole cache, since the layers read what the writes overwrite.

    Returns:
        (h, outputs): the final hidden state and every layer's outputs stacked on a leading
        layer axis (the new tokens' cache entries come back as `(num_layers, batch, T, ...)`).
    """
    if remat not in REMAT:
        raise ValueError(f"remat: unknown policy {remat!r}; valid: {', '.join(REMAT)}")
    graphdef, state = nnx.split(stack)
    num_layers = jax.tree.leaves(state)[0].shape[0]

    def body(h, xs):
        layer_state, index = xs
        layer = nnx.merge(graphdef, layer_state)
        per_layer = {} if kv is None else {"kv": kv, "layer": index}
        token = _CURRENT_LAYER.set(index)
        try:
            return layer(h, **per_layer, **layer_kwargs)
        finally:
            _CURRENT_LAYER.reset(token)

    if remat != "none":
        body = jax.checkpoint(body, policy=REMAT[remat].saveable, prevent_cse=not scan)
    if scan:
        return jax.lax.scan(body, h, (state, jnp.arange(num_layers, dtype=jnp.int32)))
    outputs = []
    for i, layer_state in enumerate(_layer_slices(state)):
        h, out = body(h, (layer_state, i))
        outputs.append(out)
    return h, jax.tree.map(lambda *xs: jnp.stack(xs), *outputs)


def _layer_slices(state: nnx.State) -> list[nnx.State]:
    """Layer `i`'s slice of every stacked array in `state`, for each `i`."""
    num_layers = jax.tree.leaves(state)[0].shape[0]
    return [jax.tree.map(lambda x, i=i: x[i], state) for i in range(num_layers)]
