"""What ends in the service: sessions, and the answers of settled requests.

A session ends when its client closes it (`ServiceClient.close`) or sends no heartbeat (the SDK
sends one every 10 s) for `serve.session_timeout_s`. Its live adapters with steps no checkpoint
holds are saved first, as the training checkpoint `session-end-step-<n>` that
`create_training_client_from_state` loads; then their slots are freed, and so are those of the
sampler snapshots only its sampling sessions used. Its later requests get a 410 naming the end.

A settled request's answer is kept `serve.result_ttl_s` after the client first retrieved it (or
after it settled, if never retrieved); then only a small row saying so remains (a retrieve is a
410, a retried submission still finds its request), itself forgotten `tombstone_s` later (at least
10 minutes, the SDK's retries of a submission long over), so the store stays bounded over a long
run.
"""

from __future__ import annotations

import logging
import math
import threading
import time

from podtrain.orchestrator.serve.scheduler import Job, Scheduler
from podtrain.orchestrator.serve.store import ModelRecord, Store
from podtrain.orchestrator.serve.work import Save, Unload

logger = logging.getLogger(__name__)
SESSION_END_SAVE = "session-end-step-{steps}"  # the name of a session's last save of an adapter


class Lifetimes:
    """Ends silent sessions and expires answers, from a thread that looks every `period_s`."""

    def __init__(self, store: Store, scheduler: Scheduler, session_timeout_s: float, result_ttl_s: float,
                 tombstone_s: float | None = None):
        self._store = store
        self._scheduler = scheduler
        self.session_timeout_s = session_timeout_s  # 0: sessions end only when closed
        self.result_ttl_s = result_ttl_s
        self.tombstone_s = max(result_ttl_s, 600.0) if tombstone_s is None else tombstone_s
        # Silence is counted from this service's start at the earliest: a restart after a long stop
        # gives every client a whole timeout to heartbeat again.
        self._started = time.time()
        spans = [s for s in (session_timeout_s, result_ttl_s) if s > 0]
        self.period_s = min(max(min(spans, default=10.0) / 4, 0.05), 10.0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="serve-lifetimes", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(self.period_s + 5.0)

    def _loop(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self.sweep(time.time())
            except Exception:  # a failed sweep is tried again at the next one
                logger.exception("ending silent sessions or expiring results failed")

    def sweep(self, now: float) -> None:
        """Ends the sessions silent for the timeout at `now`, and expires the answers due."""
        timeout = self.session_timeout_s
        if timeout > 0 and now - self._started > timeout:
            for session_id in self._store.silent_sessions(now - timeout):
                self.end_session(session_id, f"no heartbeat for {timeout:g}s (serve.session_timeout_s)")
        self._store.expire_futures(now - self.result_ttl_s, now - self.result_ttl_s - self.tombstone_s)

    def end_session(self, session_id: str, reason: str) -> bool:
        """Ends the session (the first reason wins): saves and unloads its live adapters and frees
        its sampler snapshots. Whether this call ended it."""
        if not self._store.finish_session(session_id, reason):
            return False
        saved = 0
        for model in self._store.models(session_id):
            if model.state == "live":
                self._store.set_model_state(model.model_id, "unloaded")  # its new requests are refused now
                saved += self._retire(model)
        still_used = {s.directory for s in self._store.samplers(open_sessions=True)}
        for directory in {s.directory for s in self._store.samplers(session_id)} - still_used - {None}:
            self._scheduler.forget_sampler_weights(directory)
        logger.info("session %s ended (%s); %d adapters saved", session_id, reason, saved)
        return True

    def _retire(self, model: ModelRecord) -> int:
        """Queues the model's last save (if it has steps no checkpoint holds) and its unload, after
        its requests already queued; how many saves that is."""
        saving = self._unsaved_steps(model)
        if saving is not None:
            name = SESSION_END_SAVE.format(steps=saving)
            directory = self._store.checkpoint_dir(model.model_id, "state", name)
            directory.parent.mkdir(parents=True, exist_ok=True)

            def saved(_: object) -> tuple[bytes, str]:
                self._store.add_checkpoint(model.model_id, "state", name)
                return b"", ""

            self._scheduler.submit(Job(None, model.model_id, math.inf, Save(model.model_id, str(directory), True),
                                       saved))
        self._scheduler.submit(Job(None, model.model_id, math.inf, Unload(model_id=model.model_id),
                                   lambda _: (b"", "")))
        return int(saving is not None)

    def _unsaved_steps(self, model: ModelRecord) -> int | None:
        """The model's step count if no checkpoint a client can name holds its state, else None."""
        progress = self._store.progress(model.model_id)
        if progress is None or (progress.steps == 0 and progress.saved_dir is None):
            return None  # nothing trained: its creation makes it again
        if progress.steps == progress.saved_step and self._store.checkpoint_at(progress.saved_dir) is not None:
            return None
        return progress.steps
