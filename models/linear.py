"""Parameters and projections: `param`, the `Linear` projection weight, and the FSDP gather.

Every parameter names its logical axes through `nnx.with_partitioning`; `sharding/` decides the
mesh axes. A projection's weight is a `Linear`, a parameter that projects: it keeps the weight's
own path in the model (checkpoints and HF names are those of the weight), and features such as
adapters wrap it after the model is built.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from podtrain.sharding.rules import axes_of, logical_to_spec

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def dtype_of(name: str):
    return DTYPES[name]


def param(rngs: nnx.Rngs, init, shape, names, dtype) -> nnx.Param:
    """A parameter created by `init` and annotated with logical axis `names`."""
    # Sharding is applied by `sharding/` from the logical names, never eagerly at creation.
    return nnx.Param(nnx.with_partitioning(init, tuple(names), eager_sharding=False)(rngs.params(), shape, dtype))


def dense(x: jax.Array, w: jax.Array, n_in: int = 1) -> jax.Array:
    """`x (..., *in) @ w (*in, *out)` as one 2-D (tokens, features) matmul: the weight gradient of
    a 3-D einsum would make XLA copy the (tokens, features) cotangent into a transposed layout."""
    in_size = math.prod(w.shape[:n_in])
    y = x.reshape(-1, in_size) @ w.reshape(in_size, -1)
    return y.reshape(*x.shape[: x.ndim - n_in], *w.shape[n_in:])


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _gathered(w, whole: PartitionSpec, sharded: PartitionSpec):
    """`w` itself; differentiated, `w` pinned to `whole` and its cotangent to `sharded` (see `weight`)."""
    return w


def _gathered_fwd(w, whole, sharded):
    return jax.lax.with_sharding_constraint(w, whole), None


def _gathered_bwd(whole, sharded, _, d_w):
    return (jax.lax.with_sharding_constraint(d_w, sharded),)


_gathered.defvjp(_gathered_fwd, _gathered_bwd)


def weight(w: nnx.Variable, dtype) -> jax.Array:
    """The weight `w` cast to `dtype`; when differentiated, gathered once for all the matmuls that read it.

    GSPMD gathers a weight sharded over the batch axes (FSDP) at each matmul that reads it, so under
    remat the recomputed forward matmul and the backward one would each gather it again. Pinning the
    cast weight to its layout without the batch axes makes it one value that both read; the
    cotangent is pinned to the weight's own layout, so the gradient is reduce-scattered (a plain
    sharding constraint would transpose to a replicated, all-reduced gradient).
    """
    return gathered(w[...].astype(dtype), w.get_metadata().get("out_sharding"))


def gathered(w: jax.Array, names) -> jax.Array:
    """`weight` for an array `w` whose dimensions have the logical `names` (a leading "layers" name
    beyond `w`'s dimensions is that of the stack `w` is one layer of).

    Undifferentiated (inference), without a mesh or for expert weights (kept sharded over their
    expert axis: the expert dispatch gathers what it needs) `w` is returned as it is.
    """
    specs = gather_specs(names, w.ndim)
    return w if specs is None else _gathered(w, *specs)


def gather_specs(names, ndim: int) -> tuple[PartitionSpec, PartitionSpec] | None:
    """(whole, sharded): the layout of an `ndim`-dimensional weight with logical `names` once
    gathered over the batch and sequence axes, and its own; None when there is nothing to gather."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty or not names or "experts" in names:
        return None
    sizes = dict(mesh.shape)
    spec = list(logical_to_spec(names, sizes))[len(names) - ndim:]
    # Devices that hold different tokens (the batch axes, and the sequence's under context
    # parallelism) each need the whole weight: it is gathered over all of them at once.
    tokens = set(axes_of(logical_to_spec(("batch",), sizes)[0])) | set(axes_of(logical_to_spec(("seq",), sizes)[0]))
    kept = [tuple(a for a in axes_of(entry) if a not in tokens) for entry in spec]
    whole = PartitionSpec(*(None if not axes else axes[0] if len(axes) == 1 else axes for axes in kept))
    sharded = PartitionSpec(*spec)
    return None if whole == sharded else (whole, sharded)


class Linear(nnx.Param):
    """A projection's weight `(*in, *out)`: `n_in` input axes, logical axes in its sharding
    metadata. Called on `x (..., *in)` it returns `x @ W (..., *out)` computed in `x`'s dtype (the
    compute dtype), the weight gathered once over the batch axes (`weight`).
    """

    def __call__(self, x: jax.Array) -> jax.Array:
        return dense(x, self.matrix(x.dtype), self.n_in)

    def matrix(self, dtype) -> jax.Array:
        """The weight as a matmul in `dtype` reads it: cast, gathered over the batch axes."""
        return weight(self, dtype)

    def is_one_matrix(self) -> bool:
        """Whether `self(x)` is `x @ self.matrix(dtype)` for every row of `x`, so that a caller may
        take the matrix and apply it elsewhere (always, for a plain weight)."""
        return True

    def contract(self, equation: str, x: jax.Array, dtype, part: slice = slice(None)) -> jax.Array:
        """`einsum(equation, x, W[..., part])` in `dtype`, `part` a slice of the weight's last axis
        (how MLA's cached decoding absorbs its key and value up-projection into other products)."""
        return jnp.einsum(equation, x, self.matrix(dtype)[..., part])

    def merged(self) -> jax.Array:
        """The weight as stored (dtype and sharding)."""
        return self[...]

    def axes(self) -> tuple:
        """The weight's logical axes."""
        return tuple(self.get_metadata().get("out_sharding") or ())


def linear(rngs: nnx.Rngs, init, in_shape, out_shape, names, param_dtype) -> Linear:
    """A `Linear` of input shape `in_shape` and output shape `out_shape` (logical axes `names`,
    inputs first), created by `init` in `param_dtype`."""
    shape = (*in_shape, *out_shape)
    value = nnx.with_partitioning(init, tuple(names), eager_sharding=False)(rngs.params(), shape, param_dtype)
    return Linear(value, n_in=len(in_shape))
