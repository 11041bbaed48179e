"""The paged adapter table: more adapters alive than the engine has device slots.

An adapter is alive from its create (or load) to its unload. Alive, it is in one of three tiers:
- a device slot (`serve.max_adapters` of them), where the engine's programs read it;
- host memory (`serve.host_adapters` pages), as this process's shards of its weights, its Adam
  moments and step count, and its pending gradient when a forward/backward has run since its last
  optimizer step;
- the disk (`<run dir>/pages/`), the same shards in one safetensors file per process.

A request brings its adapter into a slot; the slot taken is a free one, else that of the least
recently used adapter the step does not name, which is written back to host memory first. Host
pages over `serve.host_adapters` go to disk, least recently used first. The values move
unchanged, so a paged adapter's losses, gradients, samples and saves are those it would have had
in a slot all along.

The moves of one step are batched: one program takes every outgoing slot, one puts every incoming
page; the outgoing pages reach host memory while the step runs (their copies are started before the
step and waited for after it).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from collections import OrderedDict
from pathlib import Path

import jax
import numpy as np
from safetensors.numpy import load_file, save_file

from podtrain.orchestrator.serve.programs import AdamState, at_slot, axes_tree, bucket

ShardKey = tuple[tuple[int, int], ...]



def _key(index: tuple, shape: tuple[int, ...]) -> ShardKey:
    """A shard's place in its array, as (start, stop) per dimension."""
    return tuple((s.start or 0, shape[d] if s.stop is None else s.stop) for d, s in enumerate(index))


@dataclasses.dataclass
class Page:
    """One adapter out of its slot: per array (the adapters' leaves, the gradient's when `pending`,
    then the two moments'), this process's shards by their place; and its Adam step count."""

    shards: list[dict[ShardKey, np.ndarray]]
    count: int
    pending: bool

    def nbytes(self) -> int:
        return sum(a.nbytes for arrays in self.shards for a in arrays.values())


@functools.partial(jax.jit, static_argnames=("axes",))
def take_slots(adapters, grads, state: AdamState, indices, *, axes):
    """The slots `indices` (k,): adapters and gradient with their adapter axis k long, moments with
    their leading one, and the step counts (k,)."""
    tree = axes_tree(adapters, axes)
    pick = lambda x, axis: x[at_slot(axis, indices)]  # noqa: E731
    return (jax.tree.map(pick, adapters, tree), jax.tree.map(pick, grads, tree),
            jax.tree.map(lambda m: m[indices], state.mu), jax.tree.map(lambda m: m[indices], state.nu),
            state.count[indices])


@functools.partial(jax.jit, static_argnames=("axes",), donate_argnums=(0, 1, 2))
def put_slots(adapters, grads, state: AdamState, indices, values, grad_values, mu, nu, count, *, axes):
    """`take_slots` undone: slots `indices` set to the given pages (a repeated index repeats its page)."""
    tree = axes_tree(adapters, axes)
    put = lambda x, v, axis: x.at[at_slot(axis, indices)].set(v.astype(x.dtype))  # noqa: E731
    return (jax.tree.map(put, adapters, values, tree), jax.tree.map(put, grads, grad_values, tree),
            AdamState(jax.tree.map(lambda m, v: m.at[indices].set(v), state.mu, mu),
                      jax.tree.map(lambda m, v: m.at[indices].set(v), state.nu, nu),
                      state.count.at[indices].set(count)))


class Pager:
    """The host and disk tiers of one engine process, and what moved between the tiers."""

    def __init__(self, host_capacity: int | None, directory: Path | None):
        self.host: OrderedDict[str, Page] = OrderedDict()  # least recently used first
        self.disk: set[str] = set()
        self.host_capacity, self.directory = host_capacity, directory
        self.stats = {"page_ins": 0, "page_outs": 0, "disk_writes": 0, "disk_reads": 0, "seconds": 0.0}
        self._outgoing: list[tuple[list[str], list[bool], list, int]] = []
        self._reported: dict | None = None
        if directory is not None:  # an earlier engine's pages: its adapters come back from their saves
            for stale in directory.glob(f"*/process-{jax.process_index()}.safetensors*"):
                stale.unlink(missing_ok=True)

    def report(self, resident: int) -> None:
        """Writes where the live adapters are and what paging did to `<directory>/paging.json`
        (process 0, when it changed), which the service's `get_info` answers with."""
        if self.directory is None or jax.process_index() != 0:
            return
        now = {"resident": resident, **self.counts(), **self.stats}
        if now == self._reported:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        partial = self.directory / "paging.json.partial"
        partial.write_text(json.dumps(now) + "\n")
        partial.replace(self.directory / "paging.json")
        self._reported = now

    def __contains__(self, model_id: str) -> bool:
        return model_id in self.host or model_id in self.disk

    def counts(self) -> dict[str, int]:
        return {"host": len(self.host), "disk": len(self.disk)}

    def drop(self, model_id: str) -> None:
        """Forgets a paged adapter (unloaded)."""
        if any(model_id in model_ids for model_ids, *_ in self._outgoing):
            self.settle()
        self.host.pop(model_id, None)
        if model_id in self.disk:
            self.disk.discard(model_id)
            self._file(model_id).unlink(missing_ok=True)

    # -- device slots <-> host --

    def page_out(self, engine_arrays, axes, shardings, outgoing: list[tuple[str, int, bool]]) -> None:
        """Starts taking the slots of `outgoing` ((model id, slot, pending)) to host memory; `settle`
        finishes it. The engine's arrays are only read; `shardings`: the adapters' and the moments'
        layouts, which the taken pages keep (so each process keeps the shards it will put back)."""
        if not outgoing:
            return
        start = time.perf_counter()
        adapters, grads, state = engine_arrays
        layout, adam_layout = shardings
        indices = [slot for _, slot, _ in outgoing]
        indices += indices[-1:] * (bucket(len(indices)) - len(indices))
        taken = take_slots(adapters, grads, state, jax.device_put(np.asarray(indices, np.int32), state.count.sharding),
                           axes=axes)
        taken = jax.device_put(taken, (layout, layout, adam_layout.mu, adam_layout.nu, state.count.sharding))
        for x in jax.tree.leaves(taken):
            x.copy_to_host_async()
        leaf_axes = [*axes, *axes, *[0] * len(axes), *[0] * len(axes)]
        self._outgoing.append(([m for m, _, _ in outgoing], [p for _, _, p in outgoing], [taken, leaf_axes],
                               len(axes)))
        self.stats["page_outs"] += len(outgoing)
        self.stats["seconds"] += time.perf_counter() - start

    def settle(self) -> None:
        """The pages started by `page_out` in host memory; then the least recently used host pages
        over the host's capacity on disk."""
        start = time.perf_counter()
        for model_ids, pending, (taken, leaf_axes), n in self._outgoing:
            leaves, counts = jax.tree.leaves(taken[:4]), np.asarray(taken[4])
            for j, (model_id, has_grad) in enumerate(zip(model_ids, pending, strict=True)):
                shards = []
                for i, (x, axis) in enumerate(zip(leaves, leaf_axes, strict=True)):
                    if n <= i < 2 * n and not has_grad:
                        continue  # no pending gradient: zero, not kept
                    one = {}
                    for shard in x.addressable_shards:
                        key = _key(shard.index, x.shape)
                        key = key[:axis] + key[axis + 1:]
                        if key not in one:
                            one[key] = np.ascontiguousarray(np.take(np.asarray(shard.data), j, axis=axis))
                    shards.append(one)
                self.host[model_id] = Page(shards, int(counts[j]), has_grad)
                self.host.move_to_end(model_id)
        self._outgoing.clear()
        while self.host_capacity is not None and len(self.host) > self.host_capacity:
            self._to_disk(next(iter(self.host)))
        self.stats["seconds"] += time.perf_counter() - start

    def page_in(self, engine_arrays, axes, shardings, incoming: list[tuple[str, int]]):
        """The engine's arrays with the pages of `incoming` ((model id, slot)) in their slots (the
        arrays given are donated). `shardings`: the adapters' and the moments' layouts."""
        if not incoming:
            return engine_arrays
        if any(model_id in model_ids for model_ids, *_ in self._outgoing for model_id, _ in incoming):
            self.settle()  # an adapter paged out earlier in this call of the engine, wanted again
        start = time.perf_counter()
        pages = [self._take(model_id) for model_id, _ in incoming]
        k = bucket(len(incoming))
        pages += pages[-1:] * (k - len(pages))
        indices = [slot for _, slot in incoming]
        indices += indices[-1:] * (k - len(indices))
        adapters, grads, state = engine_arrays
        layout, adam_layout = shardings
        n = len(axes)

        def stacked(i, like, axis, sharding):
            shape = like.shape[:axis] + (k,) + like.shape[axis + 1:]

            def piece(index):
                key = _key(index, shape)
                key = key[:axis] + key[axis + 1:]
                parts = []
                for page in pages:
                    if n <= i < 2 * n and not page.pending:
                        size = [b - a for a, b in key]
                        parts.append(np.zeros(size, like.dtype))
                    else:
                        parts.append(page.shards[self._slot_of(page, i, n)][key])
                return np.stack(parts, axis=axis)[(slice(None),) * axis + (slice(index[axis].start or 0,
                                                                                   index[axis].stop or k),)]
            return jax.make_array_from_callback(shape, sharding, piece)

        leaves = jax.tree.leaves(adapters)
        flat_layout, flat_moments = jax.tree.leaves(layout), jax.tree.leaves(adam_layout.mu)
        mu_leaves = jax.tree.leaves(state.mu)
        structure, moments = jax.tree.structure(adapters), jax.tree.structure(state.mu)
        values = [stacked(i, x, a, s) for i, (x, a, s) in enumerate(zip(leaves, axes, flat_layout, strict=True))]
        grad_values = [stacked(n + i, x, a, s) for i, (x, a, s) in enumerate(zip(leaves, axes, flat_layout,
                                                                                  strict=True))]
        mu = [stacked(2 * n + i, m, 0, s) for i, (m, s) in enumerate(zip(mu_leaves, flat_moments, strict=True))]
        nu = [stacked(3 * n + i, m, 0, s) for i, (m, s) in enumerate(zip(mu_leaves, flat_moments, strict=True))]
        count = jax.device_put(np.asarray([p.count for p in pages], np.int32), state.count.sharding)
        out = put_slots(adapters, grads, state, jax.device_put(np.asarray(indices, np.int32), state.count.sharding),
                        jax.tree.unflatten(structure, values), jax.tree.unflatten(structure, grad_values),
                        jax.tree.unflatten(moments, mu), jax.tree.unflatten(moments, nu), count, axes=axes)
        self.stats["page_ins"] += len(incoming)
        self.stats["seconds"] += time.perf_counter() - start
        return out

    @staticmethod
    def _slot_of(page: Page, i: int, n: int) -> int:
        """Where array `i` (of adapters, gradient, mu, nu: n each) is in `page.shards`."""
        return i if page.pending or i < n else i - n

    def _take(self, model_id: str) -> Page:
        if model_id in self.disk:
            self._from_disk(model_id)
        return self.host.pop(model_id)

    # -- host <-> disk --

    def _file(self, model_id: str) -> Path:
        if self.directory is None:
            raise RuntimeError("paging to disk needs the engine's page directory")
        name = "".join(c if c.isalnum() or c in "-_." else f"%{ord(c):02x}" for c in model_id)
        return self.directory / name / f"process-{jax.process_index()}.safetensors"

    def _to_disk(self, model_id: str) -> None:
        page = self.host.pop(model_id)
        arrays = {f"{i}|" + ",".join(f"{a}:{b}" for a, b in key): value
                  for i, shards in enumerate(page.shards) for key, value in shards.items()}
        path = self._file(model_id)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".partial")
        save_file(arrays, str(partial), metadata={"count": str(page.count), "pending": str(int(page.pending)),
                                                  "arrays": str(len(page.shards))})
        partial.replace(path)
        self.disk.add(model_id)
        self.stats["disk_writes"] += 1

    def _from_disk(self, model_id: str) -> None:
        from safetensors import safe_open

        path = self._file(model_id)
        with safe_open(str(path), "np") as f:
            meta = f.metadata()
        arrays = load_file(str(path))
        shards: list[dict[ShardKey, np.ndarray]] = [{} for _ in range(int(meta["arrays"]))]
        for name, value in arrays.items():
            i, key = name.split("|")
            shards[int(i)][tuple(tuple(int(v) for v in part.split(":")) for part in key.split(",") if part)] = value
        self.host[model_id] = Page(shards, int(meta["count"]), meta["pending"] == "1")
        self.disk.discard(model_id)
        path.unlink(missing_ok=True)
        self.stats["disk_reads"] += 1
