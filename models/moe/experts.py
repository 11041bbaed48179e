"""The routed experts as the dispatch runs them: SwiGLU experts over rows grouped by expert.

An experts object is a pytree of per-expert weights that says how rows pass through them given a
`matmul(rows, w)` of rows by one weight of every expert (grouped matmuls in the dropless dispatch,
einsums over fixed buffer places in the capacity dispatch), the logical axes of each of its arrays
(the dispatch gathers their FSDP-sharded dimensions) and which of its arrays are trained. Features that
change the experts (adapters) are other such objects, made around these after the model is built.
One with `adapters()` > 1 holds arrays `(E, S, ...)`, one per adapter slot, and multiplies each row
by its own slot's with `matmul.by_adapter(rows, w)` (the dispatch carries each row's slot).
"""

from __future__ import annotations

import dataclasses

import jax

from podtrain.models.layers import swiglu

EXPERT_GATE_NAMES = ("experts", "embed", "mlp")  # w_gate and w_up, (E, D, F)
EXPERT_DOWN_NAMES = ("experts", "mlp", "embed")  # w_down, (E, F, D)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SwiGLUExperts:
    """Every expert's SwiGLU: down(swiglu(x @ gate, x @ up)), weights (E, D, F), (E, D, F), (E, F, D)."""

    gate: jax.Array
    up: jax.Array
    down: jax.Array

    def weights(self) -> SwiGLUExperts:
        """The experts' own weights."""
        return self

    def adapters(self) -> int:
        """Adapter slots whose arrays the rows pick by their slot (1: none)."""
        return 1

    def names(self) -> SwiGLUExperts:
        """The logical axes of each array, in the same structure."""
        return SwiGLUExperts(EXPERT_GATE_NAMES, EXPERT_GATE_NAMES, EXPERT_DOWN_NAMES)

    def in_projections(self, rows, matmul):
        """The gate and up projections of `rows`."""
        return matmul(rows, self.gate), matmul(rows, self.up)

    def out_projection(self, hidden, matmul):
        """The down projection of the experts' hidden rows."""
        return matmul(hidden, self.down)

    def split(self):
        """(frozen, trained): the arrays that get no gradient (None: none) and the ones that do."""
        return None, self

    @staticmethod
    def join(frozen, trained):
        """The experts of `split`'s two parts (a None frozen part: its gradient, none computed)."""
        return trained


def run_experts(experts, rows, matmul):
    """(gate, up, out): the experts' projections of `rows` and their output."""
    gate, up = experts.in_projections(rows, matmul)
    return gate, up, experts.out_projection(swiglu(gate, up), matmul)


def trained_vjp(f, x, experts):
    """`jax.vjp` of `f(x, experts)` in `x` and the trained part of `experts` only: the frozen
    arrays' cotangents are None, never computed."""
    frozen, trained = experts.split()
    pull = jax.vjp(lambda x, trained: f(x, experts.join(frozen, trained)), x, trained)[1]

    def pullback(cotangent):
        d_x, d_trained = pull(cotangent)
        return d_x, experts.join(None, d_trained)

    return pullback
