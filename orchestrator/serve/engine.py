"""`Engine`: the service's backend on one JAX process (every host's worker runs one, in lockstep).

It holds the base model with its adapter slots, each slot's pending gradient and Adam state, and
which adapter (model id) sits in which slot. `run` takes the front end's ordered work items and
packs them: each model's items keep their order, and the next items of all models that are
forward/backward passes (or samples) run as one padded batch (`batches.py`), so many clients' rows
share a step. Saved adapters are directories (`adapter_files.py`).
"""

from __future__ import annotations

import dataclasses
import logging
import zlib
from collections import OrderedDict
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from podtrain.models import ARCHITECTURES
from podtrain.models.lora import LoRAConfig, LoRAParam, slot_view, to_peft
from podtrain.orchestrator.placed.restore import load_base
from podtrain.orchestrator.serve.adapter_files import finish_save, partial, read_saved, saved_tree, start_save
from podtrain.orchestrator.serve.base_info import serve_info
from podtrain.orchestrator.serve.batches import sample_batch, stop_at, train_batch
from podtrain.orchestrator.serve.checks import check_adapter, check_work
from podtrain.orchestrator.serve.layout import engine_layout
from podtrain.orchestrator.serve.pages import Pager
from podtrain.orchestrator.serve.programs import (
    ADAM_CHUNK,
    adam_steps,
    bucket,
    forward_backward,
    init_adam,
    sample_rows,
    to_host,
)
from podtrain.orchestrator.serve.slots import clear_slot, cut_rank, flat_names, new_slot, read_slot, write_slot
from podtrain.orchestrator.serve.warm import RowWarmer
from podtrain.orchestrator.serve.work import (
    ADAM_KEYS,
    BaseInfo,
    Create,
    ForwardBackward,
    ForwardBackwardResult,
    Load,
    LoadResult,
    OptimStep,
    OptimStepResult,
    Sample,
    SampledSequence,
    SampleResult,
    Save,
    ServeError,
    Unload,
    Work,
)
from podtrain.sharding.rules import use_rules

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class LoadedAdapter:
    """An adapter alive in the engine: its slot `index` (None while paged out, `pages.py`), rank,
    targets and optimizer steps taken; when it was last used, and whether it has a gradient pending
    (a forward/backward since its last optimizer step)."""

    index: int | None
    rank: int
    targets: tuple[str, ...]
    steps: int = 0
    used: int = 0
    pending: bool = False


class Engine:
    """The Backend of one process: see the module docstring."""

    def __init__(self, config, devices=None, eos_token_ids: tuple[int, ...] | None = None,
                 page_dir: Path | None = None):
        self._info, _ = serve_info(config, eos_token_ids)
        layout = engine_layout(config, devices)
        placed = layout.placed
        self.config, self.mesh, self.rules = config, placed.mesh, placed.rules
        self.targets = placed.spec.lora.targets  # every target the slots hold
        with use_rules(self.rules):
            base = load_base(placed)
            frozen = placed.create(nnx.Not(LoRAParam)) if base is None else placed.from_base(base)
            adapters = placed.create(LoRAParam)
        self.model = nnx.merge(placed.graphdef, adapters, frozen)
        self.graphdef, self.adapters, self.rest = nnx.split(self.model, LoRAParam, ...)
        self.axes = layout.axes
        self.grads = jax.tree.map(jnp.zeros_like, self.adapters)
        self.adam = init_adam(self.adapters, self.axes, self._info.max_adapters)
        self._layout = jax.tree.map(lambda x: x.sharding, self.adapters)
        self._adam_layout = layout.adam_shardings()
        self._pin()
        self._warmer = RowWarmer(self.mesh, self.rules, self.graphdef, (self.adapters, self.rest, self.grads),
                                 loss_chunk=self.config.serve.loss_chunk,
                                 max_rows=self.config.serve.max_rows if self.config.serve.compile_ahead else 0,
                                 wait_s=self.config.cluster.compile_timeout_s)
        self.loaded: dict[str, LoadedAdapter] = {}
        self.pager = Pager(config.serve.host_adapters, page_dir)
        self._clock = 0
        self.sample_count = 0

    def _pin(self) -> None:
        """Every slot array back in the layout the engine was built with (the moments in their
        adapters' layout, adapter axis first), so that the compiled programs see the same shardings
        whatever changed the arrays (an eager update, a step's outputs) and never compile again."""
        self.adapters = jax.device_put(self.adapters, self._layout)
        self.grads = jax.device_put(self.grads, self._layout)
        self.adam = jax.device_put(self.adam, self._adam_layout)
        nnx.update(self.model, self.adapters)

    # -- the Backend interface --

    def info(self) -> BaseInfo:
        return self._info

    def generation(self) -> int:
        return 0  # this process's engine is the only one

    def check(self, work: Work) -> None:
        check_work(self._info, self.targets, work)

    def run(self, works: list[Work], generation: int | None = None) -> list[object]:
        """Each model's items in order; the next forward/backward passes (or samples) of all
        models in one padded batch. The items were checked before they were queued (`check`);
        what needs the engine's state (a free slot, a loaded adapter, a saved one) is checked here."""
        results: list[object] = [None] * len(works)
        queues: OrderedDict[str, list[int]] = OrderedDict()
        for i, work in enumerate(works):
            queues.setdefault(work.model_id or "", []).append(i)
        with jax.set_mesh(self.mesh), use_rules(self.rules):
            while queues:
                heads = [q[0] for q in queues.values()]
                kind = type(works[heads[0]])
                if kind in (ForwardBackward, Sample, OptimStep):
                    group, named = [], set()
                    for q in queues.values():
                        # An adapter's passes (or samples) may share a batch; its steps follow one
                        # another; a group names no more adapters than there are slots.
                        while q and type(works[q[0]]) is kind and (kind is not OptimStep or not any(
                                works[i].model_id == works[q[0]].model_id for i in group)) and (
                                works[q[0]].model_id in named or len(named) < self._info.max_adapters):
                            named.add(works[q[0]].model_id)
                            group.append(q.pop(0))
                    run = {ForwardBackward: self._passes, Sample: self._samples, OptimStep: self._optim_steps}[kind]
                    self._guarded(self._paged(run), works, group, results)
                else:
                    index = heads[0]
                    queues[works[index].model_id or ""].pop(0)
                    self._guarded(self._single, works, [index], results)
                for key in [k for k, q in queues.items() if not q]:
                    del queues[key]
            self.pager.settle()
        self.pager.report(sum(1 for s in self.loaded.values() if s.index is not None))
        return results

    # -- paging (`pages.py`) --

    def _paged(self, run):
        """`run` on a group's items once their adapters are in device slots."""
        def paged(works, group, results):
            self._resident({works[i].model_id for i in group} - {None})
            run(works, group, results)
        return paged

    def _resident(self, model_ids: set[str]) -> None:
        """The adapters `model_ids` (those alive) in device slots, paged in together; the slots
        they take are free ones, else those of the least recently used adapters not named."""
        self._clock += 1
        coming = sorted((m for m in model_ids if m in self.loaded and self.loaded[m].index is None),
                        key=lambda m: self.loaded[m].used)
        for m in model_ids:
            if m in self.loaded:
                self.loaded[m].used = self._clock
        if not coming:
            return
        slots = self._take_slots(len(coming), model_ids, settle=False)
        self.adapters, self.grads, self.adam = self.pager.page_in(
            (self.adapters, self.grads, self.adam), self.axes, (self._layout, self._adam_layout),
            list(zip(coming, slots, strict=True)))
        for m, slot in zip(coming, slots, strict=True):
            self.loaded[m].index = slot
        self._pin()

    def _take_slots(self, count: int, keep: set[str], *, settle: bool = True) -> list[int]:
        """`count` device slots: free ones, else those of the least recently used adapters not in
        `keep`, which are paged out together (with `settle`, into host memory before this returns)."""
        used = {s.index for s in self.loaded.values() if s.index is not None}
        slots = [i for i in range(self._info.max_adapters) if i not in used][:count]
        victims = sorted((s.used, m) for m, s in self.loaded.items() if s.index is not None and m not in keep)
        if len(slots) + len(victims) < count:
            raise ServeError(f"no free adapter slot: all {self._info.max_adapters} (serve.max_adapters) hold "
                             "adapters this step needs", status=429)
        outgoing = []
        for _, model_id in victims[:count - len(slots)]:
            victim = self.loaded[model_id]
            outgoing.append((model_id, victim.index, victim.pending))
            slots.append(victim.index)
            victim.index = None
        self.pager.page_out((self.adapters, self.grads, self.adam), self.axes, (self._layout, self._adam_layout),
                            outgoing)
        if settle:
            self.pager.settle()
        return slots

    def paging(self) -> dict:
        """Where the live adapters are (device slots, host memory, disk) and what paging did."""
        resident = sum(1 for s in self.loaded.values() if s.index is not None)
        return {"resident": resident, **self.pager.counts(), **self.pager.stats}

    def _slot(self, model_id: str) -> LoadedAdapter:
        slot = self.loaded.get(model_id)
        if slot is None:
            raise ServeError(f"model_id: no adapter {model_id!r} is loaded", status=404)
        return slot

    def _guarded(self, fn, works, group, results) -> None:
        """Runs `fn` on the items `group`; a ServeError of the whole group goes to each of them.

        Any other error of a group leaves the engine's arrays as they were (a program that ran has
        replaced them, one that failed before running has not): the group's items are run again one
        at a time, and one that fails alone gets the error, so one request that breaks the engine
        fails by itself and the others (of the group, and of the call) get their results. An error
        after which an array is gone (a program failed while running) is the engine's: it is raised."""
        try:
            fn(works, group, results)
        except ServeError as e:
            for index in group:
                if results[index] is None:
                    results[index] = e
        except Exception as e:
            if not self._intact():
                raise
            left = [index for index in group if results[index] is None]
            if len(left) > 1:
                logger.warning("%d %s items failed together (%s: %s); each is run alone", len(left),
                               type(works[left[0]]).__name__, type(e).__name__, e)
                for index in left:
                    self._guarded(fn, works, [index], results)
            elif left:
                work = works[left[0]]
                logger.exception("the engine failed on %s of %r", type(work).__name__, work.model_id)
                results[left[0]] = ServeError(f"the engine failed on this request, run alone (the other requests of "
                                              f"its step ran): {type(e).__name__}: {e}", status=500)

    def _intact(self) -> bool:
        """Whether every array the engine holds is still there (none donated to a program that failed)."""
        return not any(x.is_deleted() for x in jax.tree.leaves((self.adapters, self.rest, self.grads, self.adam)))

    # -- one item --

    def _single(self, works, group, results) -> None:
        index = group[0]
        work = works[index]
        if isinstance(work, Create):
            results[index] = self._create(work)
        elif isinstance(work, Save):
            self._resident({work.model_id})
            results[index] = self._save(work)
        elif isinstance(work, Load):
            results[index] = self._load(work)
        elif isinstance(work, Unload):
            slot = self._slot(work.model_id)
            if slot.index is None:
                self.pager.drop(work.model_id)
            else:
                self._clear(slot.index)
            del self.loaded[work.model_id]

    def _free_slot(self, model_id: str) -> int:
        """A device slot for a new adapter `model_id`, if one more may be alive."""
        live, slots = self._info.live_adapters(), self._info.max_adapters
        if len(self.loaded) >= live:
            key = "serve.max_adapters" if live == slots else "serve.max_live_adapters"
            raise ServeError(f"no free adapter slot: all {live} ({key}) hold adapters; unload one first", status=429)
        self._clock += 1
        return self._take_slots(1, {model_id})[0]

    def _create(self, work: Create) -> None:
        if work.model_id in self.loaded:
            raise ServeError(f"model_id: {work.model_id!r} already exists", status=409)
        index = self._free_slot(work.model_id)
        self._clear(index)
        chosen = {target: jnp.asarray(target in work.targets) for target in self.targets}
        self.adapters = new_slot(self.graphdef, self.adapters, self.rest, jnp.int32(index), jnp.int32(work.seed),
                                 jnp.int32(work.rank), chosen)
        self._pin()
        self.loaded[work.model_id] = LoadedAdapter(index, work.rank, tuple(work.targets), used=self._clock)

    def _clear(self, index: int) -> None:
        """Slot `index` empty: zero adapters, gradient and Adam state."""
        self.adapters, self.grads, self.adam = clear_slot(self.adapters, self.grads, self.adam, jnp.int32(index),
                                                          axes=self.axes)
        self._pin()

    def _optim_steps(self, works, group, results) -> None:
        """One Adam step of each item's adapter, each with its own AdamParams, up to `ADAM_CHUNK`
        adapters in one program."""
        stepped = []
        for index in group:
            try:
                stepped.append((index, self._slot(works[index].model_id)))
            except ServeError as e:
                results[index] = e
        for start in range(0, len(stepped), ADAM_CHUNK):
            chunk = stepped[start:start + ADAM_CHUNK]
            padded = chunk + chunk[-1:] * (bucket(len(chunk)) - len(chunk))  # the last one again: the same step
            hyper = {key: jnp.asarray([float(works[i].adam[key]) for i, _ in padded], jnp.float32)
                     for key in ADAM_KEYS} | {"slot": jnp.asarray([slot.index for _, slot in padded], jnp.int32)}
            self.adapters, self.grads, self.adam, norms = adam_steps(self.adapters, self.grads, self.adam, hyper,
                                                                     axes=self.axes)
            self._pin()
            norms = to_host(norms)
            for j, (index, slot) in enumerate(chunk):
                slot.steps, slot.pending = slot.steps + 1, False
                results[index] = OptimStepResult({"grad_norm:mean": float(norms[j])})

    # -- forward/backward passes of many adapters --

    def _passes(self, works, group, results) -> None:
        rows = []  # (item index, datum index, datum)
        for index in group:
            work = works[index]
            try:
                self._slot(work.model_id)
            except ServeError as e:
                results[index] = e
                continue
            rows.extend((index, j, datum) for j, datum in enumerate(work.data))
            self.loaded[work.model_id].pending |= work.backward
        outputs: dict[int, list] = {index: [None] * len(works[index].data) for index in group if results[index] is None}
        width = self.config.serve.max_rows
        for start in range(0, len(rows), width):
            chunk = rows[start:start + width]
            lp, loss = self._run_batch(works, chunk)
            for r, (index, j, datum) in enumerate(chunk):
                n = len(datum.tokens)
                outputs[index][j] = {"logprobs": lp[r, :n], "elementwise_loss": loss[r, :n]}
        for index, per_datum in outputs.items():
            total = float(sum(float(o["elementwise_loss"].sum()) for o in per_datum))
            results[index] = ForwardBackwardResult(tuple(per_datum), {"loss:sum": total})

    def _run_batch(self, works, chunk) -> tuple[np.ndarray, np.ndarray]:
        batch = train_batch(works, chunk, self.loaded, self.config.serve.lora_alpha)
        batch = jax.tree.map(jnp.asarray, batch)
        self._warmer.ready(batch)
        self.grads, lp, loss = forward_backward(self.graphdef, self.adapters, self.rest, self.grads, batch,
                                                 loss_chunk=self.config.serve.loss_chunk)
        self._pin()
        return to_host(lp), to_host(loss)

    # -- sampling --

    def _samples(self, works, group, results) -> None:
        rows = []  # (item index, sample number)
        for index in group:
            work = works[index]
            try:
                if work.model_id is not None:
                    self._slot(work.model_id)
            except ServeError as e:
                results[index] = e
                continue
            rows.extend((index, k) for k in range(work.num_samples))
        sequences: dict[int, list] = {index: [] for index in group if results[index] is None}
        prompt_lps: dict[int, np.ndarray] = {}
        width = self.config.serve.max_rows
        for start in range(0, len(rows), width):
            chunk = rows[start:start + width]
            self._sample_batch(works, chunk, sequences, prompt_lps)
        for index, seqs in sequences.items():
            results[index] = SampleResult(tuple(seqs), prompt_lps.get(index))

    def _sample_batch(self, works, chunk, sequences, prompt_lps) -> None:
        packed = sample_batch(works, chunk, self.loaded, self.config.serve.lora_alpha, self._seed)
        tokens, logprobs, _, prompt_lp = sample_rows(self.graphdef, self.adapters, self.rest,
                                                     jax.tree.map(jnp.asarray, packed.batch),
                                                     new_tokens=packed.new_tokens, filtered=packed.filtered,
                                                     prompt_logprobs=packed.prompt_logprobs,
                                                     loss_chunk=self.config.serve.loss_chunk)
        tokens, logprobs = to_host(tokens), to_host(logprobs)
        prompt_lp = None if prompt_lp is None else to_host(prompt_lp)
        for r, (index, k) in enumerate(chunk):
            work = works[index]
            row = tokens[r, :work.max_tokens].tolist()
            end = stop_at(row, packed.stops[index])
            end, reason = (len(row), "length") if end is None else (end, "stop")
            sequences[index].append(SampledSequence(np.asarray(row[:end], np.int32),
                                                    logprobs[r, :end].astype(np.float32), reason))
            if work.prompt_logprobs and k == 0:
                prompt_lps[index] = prompt_lp[r, :len(work.prompt)].astype(np.float32)

    def _seed(self, work: Sample, k: int) -> int:
        """Sample `k`'s seed: from the request's seed, else from the count of samples drawn (the
        same on every host, which all run the same items)."""
        if work.seed is None:
            self.sample_count += 1
            return zlib.crc32(f"sample-{self.sample_count}".encode()) & 0x7FFFFFFF
        return zlib.crc32(f"{work.seed}-{k}".encode()) & 0x7FFFFFFF

    # -- saving and loading --

    def _slot_arrays(self, slot: LoadedAdapter, *, optimizer: bool) -> dict[str, np.ndarray]:
        """The slot's adapters (and moments), each cut to its rank, as host arrays by name."""
        values, moments = read_slot(self.adapters, self.adam, jnp.int32(slot.index), axes=self.axes,
                                    optimizer=optimizer)
        named = [("adapter", values)] + ([] if moments is None else list(zip(("mu", "nu"), moments, strict=True)))
        names = flat_names(self.adapters)
        return {f"{prefix}.{name}": cut_rank(np.asarray(value), name, axis, slot.rank)
                for prefix, tree in named
                for name, value, axis in zip(names, jax.tree.leaves(tree), self.axes, strict=True)}

    def _save(self, work: Save) -> None:
        """Every process reads the slot (the reads are collective); process 0 alone writes, into a
        partial directory renamed over `work.path` when whole."""
        slot = self._slot(work.model_id)
        arrays = self._slot_arrays(slot, optimizer=work.optimizer)
        state = {"rank": slot.rank, "alpha": self.config.serve.lora_alpha, "targets": list(slot.targets),
                 "steps": slot.steps, "optimizer": work.optimizer,
                 "adam_count": int(self.adam.count[slot.index]) if work.optimizer else 0,
                 "model_type": self.config.model.model_type, "base_model": self._info.base_model}
        writer, final = jax.process_index() == 0, Path(work.path)
        if writer:
            start_save(final, arrays, state)
        if not work.optimizer and not set(slot.targets) & set(ARCHITECTURES[self.config.model.model_type]
                                                               .peft_unwritable):
            lora = LoRAConfig(rank=slot.rank, alpha=self.config.serve.lora_alpha, targets=slot.targets)
            view = slot_view(self.model, slot.index, slot.rank, lora.alpha, slot.targets)
            to_peft(view, self.config.model, lora, partial(final), base=self._info.base_model)  # process 0 writes
        if writer:
            finish_save(final)

    def _load(self, work: Load) -> LoadResult:
        state, arrays = read_saved(work.path)
        if state["model_type"] != self.config.model.model_type:
            raise ServeError(f"path: {work.path} holds a {state['model_type']} adapter; this service serves "
                             f"{self.config.model.model_type}")
        if work.optimizer and not state["optimizer"]:
            raise ServeError(f"path: {work.path} holds weights only (save_weights_for_sampler); load it without "
                             "the optimizer")
        rank, targets = int(state["rank"]), tuple(state["targets"])
        check_adapter(self._info, self.targets, rank, targets)
        names = flat_names(self.adapters)

        def tree(prefix):
            return saved_tree(arrays, prefix, self.adapters, names, self.axes, self._info.max_rank, work.path)

        values = tree("adapter")
        moments = (tree("mu"), tree("nu")) if work.optimizer else None
        slot = self.loaded.get(work.model_id)
        if slot is None:
            slot = LoadedAdapter(self._free_slot(work.model_id), rank, targets, used=self._clock)
        elif slot.index is None:
            self.pager.drop(work.model_id)
            slot.index = self._take_slots(1, {work.model_id})[0]
        self._clear(slot.index)
        slot.pending = False
        slot.rank, slot.targets, slot.steps = rank, targets, int(state["steps"])
        self.adapters, self.adam = write_slot(self.adapters, self.adam, jnp.int32(slot.index), values, moments,
                                              jnp.int32(state["adam_count"]), axes=self.axes)
        self._pin()
        self.loaded[work.model_id] = slot
        return LoadResult(rank, targets, slot.steps)

