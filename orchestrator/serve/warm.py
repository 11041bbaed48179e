"""Row buckets compiled ahead: when a forward/backward batch first uses a token bucket, the engine's
`forward_backward` is compiled for that token bucket's other row buckets in a background thread.

A batch's rows follow the requests that arrive together (one client loop's 16 requests can be
gathered as 15 and 1), so a new padded row count otherwise stops the step that first meets it for a
whole compile. Each program is still compiled once: a batch whose shape is being compiled waits
for that compile rather than starting its own. The compile has no collectives, so each host of a
gang runs its own.
"""

from __future__ import annotations

import logging
import queue
import threading

import jax

from podtrain.orchestrator.serve.programs import Batch, bucket, forward_backward
from podtrain.sharding.rules import use_rules

log = logging.getLogger(__name__)


def _struct(x: jax.Array, rows: int | None = None) -> jax.ShapeDtypeStruct:
    shape = x.shape if rows is None else (rows, *x.shape[1:])
    return jax.ShapeDtypeStruct(shape, x.dtype, sharding=x.sharding)


class RowWarmer:
    """Compiles `forward_backward(graphdef, *state, batch)` for row buckets 1 to `max_rows` (rounded
    up to a power of two; 0: none) of each token bucket a batch uses. `state` is (adapters, rest,
    grads), whose shapes and shardings stay fixed (`Engine._pin`)."""

    def __init__(self, mesh, rules, graphdef, state, *, loss_chunk: int, max_rows: int, wait_s: float = 3600.0):
        self._mesh, self._rules, self._graphdef, self._loss_chunk = mesh, rules, graphdef, loss_chunk
        self._wait_s = wait_s  # a step waits this long for a compile ahead, then compiles its shape itself
        self._state = jax.tree.map(_struct, state)
        self._rows = sorted({bucket(n) for n in range(1, max_rows + 1)})
        self._shapes: dict[tuple[int, int], threading.Event] = {}  # compiled or queued
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._work, name="serve-row-warmer", daemon=True).start()

    def wait(self) -> None:
        """Until every queued compile has finished."""
        for done in list(self._shapes.values()):
            done.wait()

    def ready(self, batch: Batch) -> None:
        """Called before `batch` runs: on its token bucket's first batch, queues the other row
        buckets; waits while `batch`'s own shape is being compiled in the background (up to
        `wait_s`)."""
        rows, tokens = batch.tokens.shape
        done = self._shapes.get((rows, tokens))
        if done is not None:
            if not done.wait(self._wait_s):
                log.warning("the compile ahead of forward_backward for %d rows x %d tokens did not finish within "
                            "%gs (cluster.compile_timeout_s); this step compiles it", rows, tokens, self._wait_s)
            return
        self._shapes[(rows, tokens)] = _DONE  # this call compiles it
        for other in self._rows:
            if (other, tokens) not in self._shapes:
                self._shapes[(other, tokens)] = threading.Event()
                self._jobs.put((other, tokens, jax.tree.map(lambda x, n=other: _struct(x, n), batch)))

    def _work(self) -> None:
        while True:
            rows, tokens, batch = self._jobs.get()
            try:
                with jax.set_mesh(self._mesh), use_rules(self._rules):
                    forward_backward.lower(self._graphdef, *self._state, batch, loss_chunk=self._loss_chunk).compile()
            except Exception as e:  # the step that needs it compiles it and meets the error there
                log.warning("compiling forward_backward for %d rows x %d tokens ahead failed: %s", rows, tokens, e)
            finally:
                self._shapes[(rows, tokens)].set()


_DONE = threading.Event()
_DONE.set()
