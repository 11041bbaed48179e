"""The thread that owns the backend: it takes every queued job, orders them, runs them as one
`Backend.run` call and stores each result in its future.

Jobs of one model (or sampling session) run in the SDK's order, their `seq`; jobs of different
models keep their arrival order and share the call, so the engine can pack several clients'
work into one step. Sampling from saved weights needs them in an adapter slot: the scheduler
loads each sampler directory once into a slot of its own (`Load`), keeps the most recently
used ones and unloads the oldest when it needs room.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, replace

from podtrain.orchestrator.serve.store import Store
from podtrain.orchestrator.serve.work import Backend, Load, ServeError, Unload, Work

logger = logging.getLogger(__name__)
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
    def __init__(self, backend: Backend, store: Store, notify: Callable[[list[str]], None], sampler_slots: int):
        self._backend = backend
        self._store = store
        self._notify = notify
        self._sampler_slots = sampler_slots
        self._slots: OrderedDict[str, str] = OrderedDict()  # sampler directory -> adapter slot, oldest first
        self._slot_counter = 0
        self._pending: list[Job] = []
        self._wake = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="serve-scheduler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join()

    def submit(self, job: Job) -> None:
        with self._wake:
            self._pending.append(job)
            self._wake.notify()

    def forget_sampler_weights(self, directory: str) -> None:
        """Frees the slot holding `directory`'s weights, which were just overwritten."""
        with self._wake:
            if (slot := self._slots.pop(directory, None)) is not None:
                self._pending.append(Job(None, slot, 0, Unload(model_id=slot), lambda _: (b"", "")))
                self._wake.notify()

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._pending and not self._stopping:
                    self._wake.wait()
                self._gather()
                if self._stopping:
                    return
                jobs, self._pending = self._pending, []
            try:
                self.run(jobs)
            except Exception as error:
                logger.exception("settling %d jobs failed", len(jobs))
                self._fail(jobs, error)

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
        """Runs `jobs` as one backend call and settles their futures."""
        works, owners = self._plan(in_model_order(jobs))
        try:
            results = self._backend.run(works)
        except Exception as error:
            logger.exception("backend.run failed")
            results = [ServeError(f"the engine failed: {error}", 500)] * len(works)
        done: list[str] = []
        failed_dirs: dict[str, object] = {}
        for work, owner, result in zip(works, owners, results, strict=True):
            if owner is None:
                self._settle_slot(work, result, failed_dirs)
                continue
            if owner.sampler_dir in failed_dirs:
                result = failed_dirs[owner.sampler_dir]
            self._settle(owner, result)
            if owner.request_id is not None:
                done.append(owner.request_id)
        if done:
            self._notify(done)

    def _plan(self, jobs: list[Job]) -> tuple[list[Work], list[Job | None]]:
        """The works to run, with the sampler-slot loads and unloads they need; per work, its job
        (None for those slot works)."""
        needed = {job.sampler_dir for job in jobs if job.sampler_dir is not None}
        works: list[Work] = []
        owners: list[Job | None] = []
        for job in jobs:
            work = job.work
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


def in_model_order(jobs: list[Job]) -> list[Job]:
    """`jobs` in arrival order, except that each key's jobs fill that key's places in `seq` order."""
    by_key: dict[str, list[Job]] = defaultdict(list)
    for job in jobs:
        by_key[job.key].append(job)
    ordered = {key: iter(sorted(group, key=lambda job: job.seq)) for key, group in by_key.items()}
    return [next(ordered[job.key]) for job in jobs]
