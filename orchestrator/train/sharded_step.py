"""A step compiled for a mesh: explicit in/out shardings, the state donated, traced under the rule table."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import jax
from jax.sharding import Mesh, NamedSharding

from podtrain.sharding.rules import Rules, use_rules
from podtrain.sharding.state import replicated


class ShardedStep:
    """A jitted `(state, batch, frozen) -> (state, metrics)` with explicit in/out shardings (metrics
    replicated), traced under the mesh and the rule table; `frozen` is the frozen base of a LoRA
    run (None without). The input state is donated: its buffers become the new state's, so a step
    holds one state, not two."""

    def __init__(self, fn: Callable, mesh: Mesh, rules: Rules, state_shardings, batch_sharding: NamedSharding,
                 frozen_shardings=None):
        self._mesh, self._rules = mesh, rules
        self._jitted = jax.jit(
            fn,
            in_shardings=(state_shardings, batch_sharding, frozen_shardings),
            out_shardings=(state_shardings, replicated(mesh)),
            donate_argnums=0,
        )

    @contextlib.contextmanager
    def _context(self):
        with jax.set_mesh(self._mesh), use_rules(self._rules):
            yield

    def __call__(self, state, batch, frozen=None):
        with self._context():
            return self._jitted(state, batch, frozen)

    def lower(self, state, batch, frozen=None):
        with self._context():
            return self._jitted.lower(state, batch, frozen)
