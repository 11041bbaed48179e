"""The thread that owns the backend: it takes every queued job, orders them, runs them as one
`Backend.run` call and stores each result in its future.

Jobs of one model (or sampling session) run in the SDK's order, their `seq`; jobs of different
models keep their arrival order and share the call, so the engine can pack several clients'
work into one step. Sampling from saved weights needs them in an adapter slot: the scheduler
loads each sampler directory once into a slot of its own (`Load`), keeps the most recently
used ones and unloads the oldest when it needs room.

A new engine (at start, or after the engine's processes were lost) holds no adapter: before its
first step the scheduler brings back every live model from its last whole save (`save_state`, or
the automatic save every `autosave_every` optimizer steps), or re-creates it from its seed when it
has none. A step the lost engine was running runs again on the new one for each model that the
restore brings back as it was; a model that lost steps or a pending gradient is told so, once, on
its request in flight or its next one. An optimizer step of such a model before any new
gradient was asked for the gradient it lost (a client pipelines `forward_backward` and
`optim_step`): it fails with a short line pointing at the notice, and does not run.
"""

from __future__ import annotations

import logging
import math
import shutil
import threading
import time
from collections import OrderedDict, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, replace

from podtrain.orchestrator.serve.store import Store
from podtrain.orchestrator.serve.work import (
    Backend,
    Create,
    EngineLost,
    EngineRestarted,
    ForwardBackward,
    Load,
    OptimStep,
    Save,
    ServeError,
    Unload,
    Work,
)

logger = logging.getLogger(__name__)
# A request in flight when the engine's workers were lost runs again alone; lost again then, it is
# what brings them down: it fails with the error, and the other requests go on.
MAX_LOSSES = 2
STOP_WAIT_S = 120.0  # how long `stop` waits for the step in flight
# How long the scheduler waits for more requests before it runs what it has (see `_gather`).
GATHER_QUIET_S = 0.01
GATHER_MAX_S = 0.1


@dataclass(frozen=True)
class Job:
    """One work item: `on_done` turns its result into the stored answer (bytes and media type),
    after any bookkeeping; `request_id` None is a job no client waits for."""

    request_id: str | None
    key: str  # the model or sampling session whose order it keeps
    seq: float
    work: Work
    on_done: Callable[[object], tuple[bytes, str]]
    sampler_dir: str | None = None  # Sample only: the saved weights it samples from


class Scheduler:
    def __init__(self, backend: Backend, store: Store, notify: Callable[[list[str]], None], sampler_slots: int,
                 autosave_every: int = 0):
        self._backend = backend
        self._store = store
        self._notify = notify
        self._sampler_slots = sampler_slots
        self._autosave_every = autosave_every
        self._slots: OrderedDict[str, str] = OrderedDict()  # sampler directory -> adapter slot, oldest first
        self._slot_counter = 0
        self._pending: list[Job] = []
        self._alone: list[Job] = []  # requests in flight when the engine was lost: each runs in a step of its own
        self._losses: dict[object, int] = {}  # request -> engine losses it was in flight for
        self._wake = threading.Condition()
        self._stopping = False
        self._generation: int | None = None  # the engine whose slots hold the live models
        self._restore_due = any(model.state == "live" for model in store.models())
        self._notices: dict[str, str] = {}  # model -> what its next request is told (it lost steps)
        self._told: set[str] = set()  # models whose requests in flight were told already
        self._no_gradient: dict[str, str] = {}  # model told of a restore -> that request, until a new gradient
        self._forgotten: set[str] = set()  # sampler directories whose slots are to be freed
        self.engine_note: str | None = None  # why the engine is not running, while it is being restarted
        self._thread = threading.Thread(target=self._loop, name="serve-scheduler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = STOP_WAIT_S) -> None:
        """Stops taking jobs and waits for the step in flight, up to `timeout_s`: a step stuck in
        the engine is named and left (its thread is a daemon) rather than waited for forever."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.warning("the scheduler did not stop within %gs: a step is still running in the engine; "
                           "leaving it", timeout_s)

    def submit(self, job: Job) -> None:
        with self._wake:
            self._pending.append(job)
            self._wake.notify()

    def forget_sampler_weights(self, directory: str) -> None:
        """Frees the slot holding `directory`'s weights (overwritten, deleted, or no longer sampled
        from) before the next step, in the scheduler's thread, which owns the slots."""
        with self._wake:
            self._forgotten.add(directory)
            self._wake.notify()

    def save_unsaved(self, timeout_s: float) -> tuple[int, list[str]]:
        """Saves, as the automatic save does, every live adapter with optimizer steps since its last
        save (before the service stops), waiting up to `timeout_s`: (how many it saved, the models
        still unsaved then)."""
        def unsaved(model_id: str) -> bool:
            progress = self._store.progress(model_id)
            return progress is not None and progress.steps != progress.saved_step

        models = [m.model_id for m in self._store.models() if m.state == "live" and unsaved(m.model_id)]
        for model_id in models:
            self._autosave(model_id)
        deadline = time.monotonic() + timeout_s
        while (left := [m for m in models if unsaved(m)]) and time.monotonic() < deadline:
            time.sleep(0.05)
        return len(models) - len(left), left

    def take_notice(self, model_id: str, request_id: str) -> str | None:
        """The notice a new request of the model fails with, once: a new engine brought the model
        back from an earlier save."""
        with self._wake:
            return self._take_notice(model_id, request_id)

    def _take_notice(self, model_id: str, request_id: str) -> str | None:
        if (notice := self._notices.pop(model_id, None)) is not None:
            self._no_gradient[model_id] = request_id
        return notice

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not (self._pending or self._alone or self._stopping or self._restore_due or self._forgotten):
                    self._wake.wait()
                if not self._alone:
                    self._gather()
                if self._stopping:
                    return
                if self._alone:
                    jobs = [self._alone.pop(0)]
                else:
                    jobs, self._pending = self._pending, []
                    forgotten, self._forgotten = self._forgotten, set()
                    jobs = [*self._unload_slots(forgotten), *jobs]
            try:
                self.run(jobs)
            except Exception as error:
                logger.exception("settling %d jobs failed", len(jobs))
                self._fail(jobs, error)

    def _unload_slots(self, directories: set[str]) -> list[Job]:
        slots = [slot for directory in directories if (slot := self._slots.pop(directory, None)) is not None]
        return [Job(None, slot, 0, Unload(model_id=slot), lambda _: (b"", "")) for slot in slots]

    def _gather(self) -> None:
        """Waits while requests keep arriving (each within `GATHER_QUIET_S` of the last, for at most
        `GATHER_MAX_S`): the requests a client loop submits together then share one engine step,
        and steps keep the same few padded shapes instead of whatever split their arrival made."""
        deadline = time.monotonic() + GATHER_MAX_S
        while not self._stopping:
            count = len(self._pending)
            self._wake.wait(min(GATHER_QUIET_S, max(deadline - time.monotonic(), 0.0)))
            if len(self._pending) == count or time.monotonic() >= deadline:
                return

    def _fail(self, jobs: list[Job], error: Exception) -> None:
        """Fails what `run` left pending, so that no client waits forever."""
        failed = []
        for job in jobs:
            record = self._store.future(job.request_id) if job.request_id is not None else None
            if record is not None and record.status == "pending":
                self._store.fail_future(job.request_id, f"the service failed: {error}", "server")
                failed.append(job.request_id)
        self._notify(failed)

    def run(self, jobs: list[Job]) -> None:
        """Runs `jobs` as one backend call (after the restores a new engine needs) and settles their futures."""
        while True:
            generation = self._backend.generation()
            if generation != self._generation:
                self._slots.clear()  # sampler weights are loaded again as needed
            restores = self._restores() if generation != self._generation else []
            jobs = self._tell(in_model_order(jobs))
            works, owners = self._plan(jobs)
            if not restores and not works:
                return
            try:
                results = self._backend.run([work for _, work in restores] + works, generation=generation)
            except EngineRestarted:
                continue
            except EngineLost as lost:
                self._engine_lost(jobs, lost)
                return
            except Exception as error:  # the restores are tried again with the next step
                logger.exception("backend.run failed")
                failure = error if isinstance(error, ServeError) else ServeError(f"the engine failed: {error}", 500)
                if restores:
                    time.sleep(1.0)  # before the next try, when no step brings it on
                results, restores, generation = [failure] * len(works), [], self._generation
            break
        if generation != self._generation:
            self._settle_restores(restores, results[:len(restores)])
            self._generation, self._restore_due, self.engine_note = generation, False, None
        results = results[len(restores):]
        done: list[str] = []
        failed_dirs: dict[str, object] = {}
        for work, owner, result in zip(works, owners, results, strict=True):
            if owner is None:
                self._settle_slot(work, result, failed_dirs)
                continue
            if owner.sampler_dir in failed_dirs:
                result = failed_dirs[owner.sampler_dir]
            self._settle(owner, result)
            self._losses.pop(_loss_key(owner), None)
            if owner.request_id is not None:
                done.append(owner.request_id)
        if done:
            self._notify(done)

    def _restores(self) -> list[tuple[str, Work]]:
        """Per live model, what brings it back on a new engine: its last whole save, else its
        creation. A model that comes back at an earlier state gets a notice for its requests."""
        restores: list[tuple[str, Work]] = []
        for model in self._store.models():
            if model.state != "live":
                continue
            progress = self._store.progress(model.model_id)
            if progress is not None and progress.unsaved and model.model_id not in self._told:
                with self._wake:
                    self._notices[model.model_id] = (
                        f"model {model.model_id!r} was brought back from its last save, at step "
                        f"{progress.saved_step}, on a new engine ({self.engine_note or 'the service restarted'}): its "
                        f"later steps and any gradient since its last optimizer step are gone; continue from step "
                        f"{progress.saved_step} (serve.autosave_every sets how often adapters are saved)")
            if progress is not None and progress.saved_dir is not None:
                restores.append((model.model_id, Load(model.model_id, progress.saved_dir, progress.saved_optimizer)))
            elif progress is not None and model.seed is not None:
                restores.append((model.model_id, Create(model.model_id, model.rank, model.targets, model.seed)))
            else:
                logger.warning("model %s has no save to come back from; it is unloaded", model.model_id)
                self._store.set_model_state(model.model_id, "unloaded")
        return restores

    def _settle_restores(self, restores: list[tuple[str, Work]], results: list[object]) -> None:
        for (model_id, _), result in zip(restores, results, strict=True):
            if isinstance(result, Exception):
                logger.warning("model %s could not be brought back from its save (%s); it is unloaded", model_id,
                               result)
                self._store.set_model_state(model_id, "unloaded")
                continue
            self._store.restored(model_id)
        self._told.clear()
        if restores:
            logger.info("brought back %d adapters on a new engine", len(restores))

    def _tell(self, jobs: list[Job]) -> list[Job]:
        """`jobs` (in model order) but the requests that fail instead: the first of a model with a
        notice, with it, and an optimizer step of a model told so, before any new gradient (it was
        asked for the gradient the model lost), with a line pointing at the notice."""
        kept, failed = [], []
        gradients: set[str] = set()  # models with a gradient asked for earlier in this step
        for job in jobs:
            work = job.work
            refusal = None
            if job.request_id is not None:
                with self._wake:
                    refusal = self._take_notice(job.key, job.request_id)
                    telling = self._no_gradient.get(job.key)
                if refusal is None and isinstance(work, OptimStep) and telling is not None and job.key not in gradients:
                    refusal = (f"model {job.key!r} was brought back from an earlier save (request {telling} says so) "
                               "and has no gradient since: this optimizer step did not run")
            if refusal is None:
                kept.append(job)
                if isinstance(work, ForwardBackward) and work.backward:
                    gradients.add(job.key)
                continue
            self._told.add(job.key)
            self._store.fail_future(job.request_id, refusal, "server")
            failed.append(job.request_id)
        if failed:
            self._notify(failed)
        return kept

    def _engine_lost(self, jobs: list[Job], lost: EngineLost) -> None:
        """The engine died during `jobs`: those of models a restore brings back as they were run again
        on the next engine, each in a step of its own, so that one that brings the engine down again
        is found (and fails alone, `MAX_LOSSES`); the others fail, naming the step their model comes
        back at."""
        self.engine_note = str(lost)
        again, failed = [], []
        alone = len(jobs) == 1
        told: dict[str, str] = {}  # model -> the request of these that tells it
        for job in jobs:
            model_id = job.work.model_id if job.sampler_dir is None else None
            progress = self._store.progress(model_id) if model_id else None
            if progress is not None and progress.unsaved and job.request_id is not None:
                self._told.add(model_id)
                self._losses.pop(_loss_key(job), None)
                if model_id in told:
                    answer = (f"{lost}; model {model_id!r} comes back from an earlier save (request {told[model_id]} "
                              "says so): this request ran on the state it lost")
                else:
                    told[model_id] = job.request_id
                    with self._wake:
                        self._notices.pop(model_id, None)
                        self._no_gradient[model_id] = job.request_id
                    answer = (f"{lost}; model {model_id!r} comes back from its last save, at step "
                              f"{progress.saved_step}: its later steps and any gradient since its last optimizer step "
                              f"are gone, so continue from step {progress.saved_step}")
                self._store.fail_future(job.request_id, answer, "server")
                failed.append(job.request_id)
                continue
            losses = self._losses[_loss_key(job)] = self._losses.get(_loss_key(job), 0) + 1
            if alone and losses >= MAX_LOSSES and job.request_id is not None:
                self._losses.pop(_loss_key(job))
                self._store.fail_future(job.request_id, f"{lost}; this request was in the engine's step each of the "
                                        f"{losses} times its workers were lost, the last time alone: it is failed, "
                                        "and the other requests go on", "user")
                failed.append(job.request_id)
                continue
            again.append(job)
        logger.warning("%s; %d requests run again on the next engine, %d failed", lost, len(again), len(failed))
        with self._wake:
            self._alone = again + self._alone
            self._restore_due = True
        self._notify(failed)

    def _plan(self, jobs: list[Job]) -> tuple[list[Work], list[Job | None]]:
        """The works to run, with the sampler-slot loads and unloads they need; per work, its job
        (None for those slot works). Sampler snapshots only cache saved weights: a new adapter that
        finds every slot taken gets the slot of one this step does not sample from."""
        needed = {job.sampler_dir for job in jobs if job.sampler_dir is not None}
        live = {m.model_id for m in self._store.models() if m.state == "live"}
        works: list[Work] = []
        owners: list[Job | None] = []
        for job in jobs:
            work = job.work
            if job.sampler_dir is None and isinstance(work, Create | Load) and work.model_id not in live:
                idle = [d for d in self._slots if d not in needed]
                if len(live) + len(self._slots) >= self._backend.info().live_adapters() and idle:
                    works.append(Unload(model_id=self._slots.pop(idle[0])))
                    owners.append(None)
                live.add(work.model_id)
            if job.sampler_dir is not None:
                slot, loads = self._slot_for(job.sampler_dir, needed)
                works += loads
                owners += [None] * len(loads)
                work = replace(work, model_id=slot)
            works.append(work)
            owners.append(job)
        return works, owners

    def _slot_for(self, directory: str, needed: set[str]) -> tuple[str, list[Work]]:
        if directory in self._slots:
            self._slots.move_to_end(directory)
            return self._slots[directory], []
        works: list[Work] = []
        for old in [old for old in self._slots if old not in needed]:
            if len(self._slots) < self._sampler_slots:
                break
            works.append(Unload(model_id=self._slots.pop(old)))
        self._slot_counter += 1
        slot = f"sampler-slot:{self._slot_counter}"
        self._slots[directory] = slot
        works.append(Load(model_id=slot, path=directory, optimizer=False))
        return slot, works

    def _settle_slot(self, work: Work, result: object, failed_dirs: dict[str, object]) -> None:
        if isinstance(work, Load) and isinstance(result, Exception):
            failed_dirs[work.path] = result
            self._slots.pop(work.path, None)
        elif isinstance(result, Exception):
            logger.warning("unloading sampler slot %s failed: %s", work.model_id, result)

    def _settle(self, job: Job, result: object) -> None:
        if not isinstance(result, Exception):
            try:
                self._record(job.work, result)
                answer, media_type = job.on_done(result)
            except Exception as error:
                logger.exception("storing the result of %s failed", type(job.work).__name__)
                result = error
            else:
                if job.request_id is not None:
                    self._store.complete_future(job.request_id, answer, media_type)
                return
        if job.request_id is None:
            logger.warning("%s failed: %s", type(job.work).__name__, result)
            return
        user = isinstance(result, ServeError) and result.status < 500
        self._store.fail_future(job.request_id, str(result), "user" if user else "server")

    def _record(self, work: Work, result: object) -> None:
        """A client's work done: where its model now is, and what it would be restored from."""
        if isinstance(work, Create | Load) or (isinstance(work, ForwardBackward) and work.backward):
            with self._wake:
                self._no_gradient.pop(work.model_id, None)  # a state the client chose, or a new gradient
        if isinstance(work, Create):
            self._store.start_progress(work.model_id, 0, None, optimizer=True)
        elif isinstance(work, Load):
            self._store.start_progress(work.model_id, result.steps, work.path, work.optimizer)
        elif isinstance(work, ForwardBackward) and work.backward:
            self._store.gradient_pending(work.model_id)
        elif isinstance(work, OptimStep):
            steps = self._store.stepped(work.model_id)
            if self._autosave_every and steps % self._autosave_every == 0:
                self._autosave(work.model_id)
        elif isinstance(work, Save) and work.optimizer:
            self._saved(work.model_id, work.path)

    def _autosave(self, model_id: str) -> None:
        """Saves the model's whole state before any request of it that is not yet running (its
        first place in the next step); the save records the steps it holds when it is done."""
        path = str(self._store.autosave_dir(model_id))

        def on_done(_: object) -> tuple[bytes, str]:
            self._saved(model_id, path)
            return b"", ""

        self.submit(Job(None, model_id, -math.inf, Save(model_id, path, optimizer=True), on_done))

    def _saved(self, model_id: str, path: str) -> None:
        replaced = self._store.saved(model_id, path)
        if replaced is not None and replaced != path and self._store.is_autosave(replaced):
            shutil.rmtree(replaced, ignore_errors=True)


def _loss_key(job: Job) -> object:
    return job.request_id if job.request_id is not None else id(job)


def in_model_order(jobs: list[Job]) -> list[Job]:
    """`jobs` in arrival order, except that each key's jobs fill that key's places in `seq` order."""
    by_key: dict[str, list[Job]] = defaultdict(list)
    for job in jobs:
        by_key[job.key].append(job)
    ordered = {key: iter(sorted(group, key=lambda job: job.seq)) for key, group in by_key.items()}
    return [next(ordered[job.key]) for job in jobs]
