"""The stacking helper and the one layer runner (scan, remat policy, stacked KV cache).

Layers are created stacked: every parameter of a stack has shape `(num_layers, ...)` and its
logical names start with "layers". `run_layers` runs a stack for training, prefill and decode
alike: one `jax.lax.scan` whose body is one layer, wrapped in `jax.checkpoint` with the chosen
policy.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from podtrain.models.config import REMAT_POLICIES
from podtrain.models.lora import layer_rngs

_POLICIES = {
    # Save nothing: the backward pass recomputes the whole layer from its input. Least memory
    # (one residual per layer), about one extra forward of compute.
    "full": jax.checkpoint_policies.nothing_saveable,
    # Save every matmul output: the backward pass recomputes only element-wise work (norms,
    # softmax, activations). Most memory of the remat policies, least recompute.
    "dots": jax.checkpoint_policies.dots_saveable,
    # Save matmuls without batch dimensions (the projections), recompute attention scores.
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    # Save only the attention block's output: the backward pass recomputes the attention
    # sublayer only where it needs its internals, and the MLP from the saved residual.
    "save_attn_out": jax.checkpoint_policies.save_only_these_names("attn_out"),
    # Save q, k, v and the attention output: recompute the MLP and the attention probabilities.
    "save_qkv_attn_out": jax.checkpoint_policies.save_only_these_names("query", "key", "value", "attn_out"),
}
assert set(_POLICIES) | {"none"} == set(REMAT_POLICIES)


_ONLY_LAYER: contextvars.ContextVar = contextvars.ContextVar("podtrain_only_layer", default=None)


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


def stack_layers(make_layer: Callable[[nnx.Rngs], nnx.Module], num_layers: int, rngs: nnx.Rngs) -> nnx.Module:
    """Creates `num_layers` independent layers as one module whose params are `(num_layers, ...)`.

    Layer `i` is `make_layer(lora.layer_rngs(keys[i]))` for `keys = split(rngs.params(), num_layers)`
    (its params stream, and a separate one for LoRA adapters), created under `nnx.vmap`; the
    leading axis is annotated with the logical name "layers".
    """
    keys = jax.random.split(rngs.params(), num_layers)
    index = _ONLY_LAYER.get()
    if index is not None:
        keys = jax.lax.dynamic_slice_in_dim(keys, jnp.minimum(index, num_layers - 1), 1)

    @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def create(key: jax.Array) -> nnx.Module:
        return make_layer(layer_rngs(key))

    return create(keys)


def run_layers(
    stack: nnx.Module,
    h: jax.Array,
    *,
    remat: str = "none",
    scan: bool = True,
    kv: tuple[jax.Array, ...] | None = None,
    dropout_key: jax.Array | None = None,
    **layer_kwargs,
):
    """Runs the stacked layers over the hidden state `h`, layer 0 first.

    Args:
        stack: a module made by `stack_layers`; called per layer as
            `layer(h, **layer_kwargs) -> (h, outputs)` (with a cache also `kv=` and `layer=`),
            `outputs` a pytree holding "kv" (the updated cache, or None) and per-layer statistics.
        h: the hidden state entering layer 0.
        remat: a name from `REMAT_POLICIES`; "none" keeps every intermediate for the backward pass.
        scan: True runs one `lax.scan`; False unrolls a Python loop (the reference, and the
            baseline the benchmarks compare against).
        kv: optional stacked cache arrays, each `(num_layers, batch, slots, ...)`, read only:
            layer `i` gets `kv=kv, layer=i` and reads its own slots straight from the stacks
            (closed over by the scan, so never sliced into per-layer copies), and returns its new
            tokens' entries as `outputs["kv"]`; the caller writes them into the cache after the
            scan, in place (`models.kv_cache.write_tokens`). Writing inside the scan would make
            XLA copy the whole cache, since the layers read what the writes overwrite.
        dropout_key: training's LoRA dropout key; layer `i` gets it folded with `i`.

    Returns:
        (h, outputs): the final hidden state and every layer's outputs stacked on a leading
        layer axis (the new tokens' cache entries come back as `(num_layers, batch, T, ...)`).
    """
    if remat not in REMAT_POLICIES:
        raise ValueError(f"remat: unknown policy {remat!r}; valid: {', '.join(REMAT_POLICIES)}")
    graphdef, state = nnx.split(stack)
    num_layers = jax.tree.leaves(state)[0].shape[0]

    def body(h, xs):
        layer_state, index = xs
        layer = nnx.merge(graphdef, layer_state)
        per_layer = {} if kv is None else {"kv": kv, "layer": index}
        if dropout_key is not None:
            per_layer["dropout_key"] = jax.random.fold_in(dropout_key, index)
        return layer(h, **per_layer, **layer_kwargs)

    if remat != "none":
        body = jax.checkpoint(body, policy=_POLICIES[remat], prevent_cse=not scan)
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
