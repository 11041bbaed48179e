"""The ragged all-to-all: rows of different counts to every device of a mesh axis, in one exchange."""

from __future__ import annotations

import jax
import jax.numpy as jnp

IMPLEMENTATIONS = ("auto", "ragged_all_to_all", "all_to_all")


def resolve_exchange(name: str, platform: str) -> str:
    """The implementation `name` resolves to on devices of `platform`: XLA's ragged all-to-all on
    TPU and GPU; on CPU devices, whose XLA lacks it, a padded all-to-all."""
    if name != "auto":
        return name
    return "all_to_all" if platform == "cpu" else "ragged_all_to_all"


def ragged_exchange(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis, chunk: int,
                    implementation: str = "ragged_all_to_all"):
    """Rows `[input_offsets[j], + send_sizes[j])` of `operand` go to device `j`'s `output` at
    `output_offsets[j]`; `recv_sizes[i]` rows come from device `i` (devices along the mesh axis
    `axis`; None: this device alone). `chunk` bounds any one send.

    "ragged_all_to_all" moves exactly the rows sent; "all_to_all" moves `chunk` rows per pair of
    devices, padded (the same offsets and sizes place them).
    """
    operand = operand.astype(output.dtype)
    if axis is not None and implementation == "ragged_all_to_all":
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
