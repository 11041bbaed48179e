"""The service's state in SQLite (`<run_dir>/serve.sqlite`): sessions, models, futures, checkpoints
and sampling sessions.

Everything a client may ask about after a restart lives here, so a new store on the same file
lists the same models and resolves the same `tinker://` paths. One connection behind a lock:
the HTTP handlers and the scheduler thread share it, and each call is a short transaction.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

CheckpointKind = Literal["state", "sampler"]
# The `tinker://<model_id>/<segment>/<name>` segment of each kind, as the SDK parses it.
PATH_SEGMENT: dict[str, str] = {"state": "weights", "sampler": "sampler_weights"}
AUTOSAVE = "autosave"  # `<run dir>/checkpoints/<model id>/autosave/<id>/`: the automatic saves

_SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
    session_id TEXT PRIMARY KEY, created REAL NOT NULL, last_heartbeat REAL NOT NULL,
    user_metadata TEXT NOT NULL, finished TEXT);
CREATE TABLE IF NOT EXISTS models (
    model_id TEXT PRIMARY KEY, session_id TEXT NOT NULL, base_model TEXT NOT NULL, rank INTEGER NOT NULL,
    targets TEXT NOT NULL, seed INTEGER, created REAL NOT NULL, state TEXT NOT NULL,
    last_checkpoint TEXT, user_metadata TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS futures (
    request_id TEXT PRIMARY KEY, model_id TEXT, kind TEXT NOT NULL, dedup_key TEXT UNIQUE,
    status TEXT NOT NULL, result BLOB, media_type TEXT, error TEXT, category TEXT,
    created REAL NOT NULL, finished REAL, retrieved REAL);
CREATE INDEX IF NOT EXISTS futures_by_status ON futures (status);
CREATE TABLE IF NOT EXISTS checkpoints (
    tinker_path TEXT PRIMARY KEY, model_id TEXT NOT NULL, name TEXT NOT NULL, kind TEXT NOT NULL,
    directory TEXT NOT NULL, created REAL NOT NULL);
CREATE TABLE IF NOT EXISTS progress (
    model_id TEXT PRIMARY KEY, steps INTEGER NOT NULL, pending INTEGER NOT NULL, saved_dir TEXT,
    saved_step INTEGER NOT NULL, saved_optimizer INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS samplers (
    sampler_id TEXT PRIMARY KEY, session_id TEXT NOT NULL, base_model TEXT NOT NULL, model_path TEXT,
    directory TEXT, created REAL NOT NULL);
"""


@dataclass(frozen=True)
class SessionRecord:
    session_id: str
    created: float
    last_heartbeat: float
    user_metadata: dict
    finished: str | None  # the finish reason, None while open


@dataclass(frozen=True)
class ModelRecord:
    model_id: str
    session_id: str
    base_model: str
    rank: int
    targets: tuple[str, ...]
    seed: int | None
    created: float
    state: Literal["live", "unloaded"]
    last_checkpoint: str | None  # the tinker:// path of its latest save_state
    user_metadata: dict


@dataclass(frozen=True)
class Progress:
    """Where a live model's adapter is, and what a new engine brings it back from: its last whole
    save (`saved_dir`, None: re-created from its seed, as at step 0) at `saved_step`."""

    model_id: str
    steps: int  # optimizer steps taken
    pending: bool  # a gradient accumulated since the last optimizer step (no save holds it)
    saved_dir: str | None
    saved_step: int
    saved_optimizer: bool  # the save holds the Adam state (a weights-only load does not)

    @property
    def unsaved(self) -> bool:
        """Whether a new engine would bring the adapter back to an earlier state."""
        return self.steps != self.saved_step or self.pending


@dataclass(frozen=True)
class FutureRecord:
    request_id: str
    model_id: str | None
    kind: str
    status: Literal["pending", "done", "error", "expired"]  # expired: its result was dropped
    result: bytes | None
    media_type: str | None
    error: str | None
    category: str | None  # "user" or "server" (the SDK's RequestErrorCategory)


@dataclass(frozen=True)
class CheckpointRecord:
    tinker_path: str
    model_id: str
    name: str
    kind: CheckpointKind
    directory: str
    created: float


@dataclass(frozen=True)
class SamplerRecord:
    sampler_id: str
    session_id: str
    base_model: str
    model_path: str | None  # None: the base model
    directory: str | None
    created: float


def tinker_path(model_id: str, kind: CheckpointKind, name: str) -> str:
    return f"tinker://{model_id}/{PATH_SEGMENT[kind]}/{name}"


class Store:
    """The service's SQLite database and checkpoint folders under `run_dir`."""

    def __init__(self, run_dir: str | Path):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.run_dir / "serve.sqlite", check_same_thread=False, isolation_level=None)
        self._db.row_factory = sqlite3.Row
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            # A commit reaches the OS at once (a killed service loses nothing); the write-ahead log
            # is synced at checkpoints, not at every future's commit.
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(_SCHEMA)
            columns = {row["name"] for row in self._db.execute("PRAGMA table_info(futures)")}
            if "retrieved" not in columns:  # a store written before results expired
                self._db.execute("ALTER TABLE futures ADD COLUMN retrieved REAL")

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _run(self, sql: str, args: tuple = ()) -> list[sqlite3.Row]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    # Sessions.

    def create_session(self, user_metadata: dict | None) -> str:
        session_id = uuid.uuid4().hex[:16]
        now = time.time()
        self._run("INSERT INTO sessions VALUES (?, ?, ?, ?, NULL)",
                  (session_id, now, now, json.dumps(user_metadata or {})))
        return session_id

    def session(self, session_id: str) -> SessionRecord | None:
        rows = self._run("SELECT * FROM sessions WHERE session_id = ?", (session_id,))
        if not rows:
            return None
        row = rows[0]
        return SessionRecord(row["session_id"], row["created"], row["last_heartbeat"],
                             json.loads(row["user_metadata"]), row["finished"])

    def heartbeat(self, session_id: str) -> None:
        self._run("UPDATE sessions SET last_heartbeat = ? WHERE session_id = ?", (time.time(), session_id))

    def finish_session(self, session_id: str, reason: str) -> bool:
        """Marks the session finished; the first reason wins. Whether this call finished it."""
        with self._lock:
            return self._db.execute("UPDATE sessions SET finished = ? WHERE session_id = ? AND finished IS NULL",
                                    (reason, session_id)).rowcount == 1

    def silent_sessions(self, since: float) -> list[str]:
        """The open sessions with no heartbeat since `since`."""
        rows = self._run("SELECT session_id FROM sessions WHERE finished IS NULL AND last_heartbeat < ?", (since,))
        return [row["session_id"] for row in rows]

    # Models.

    def add_model(self, model: ModelRecord) -> None:
        self._run("INSERT OR REPLACE INTO models VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                  (model.model_id, model.session_id, model.base_model, model.rank, json.dumps(model.targets),
                   model.seed, model.created, model.state, model.last_checkpoint, json.dumps(model.user_metadata)))

    def model(self, model_id: str) -> ModelRecord | None:
        rows = self._run("SELECT * FROM models WHERE model_id = ?", (model_id,))
        return _model(rows[0]) if rows else None

    def models(self, session_id: str | None = None) -> list[ModelRecord]:
        if session_id is None:
            return [_model(row) for row in self._run("SELECT * FROM models ORDER BY created")]
        return [_model(row) for row in self._run("SELECT * FROM models WHERE session_id = ? ORDER BY created",
                                                 (session_id,))]

    def set_model_state(self, model_id: str, state: Literal["live", "unloaded"]) -> None:
        self._run("UPDATE models SET state = ? WHERE model_id = ?", (state, model_id))

    # Progress: what a new engine restores each live model from.

    def start_progress(self, model_id: str, steps: int, saved_dir: str | None, optimizer: bool) -> None:
        """A model created (at step 0, from its seed) or loaded from `saved_dir` at `steps`."""
        self._run("INSERT OR REPLACE INTO progress VALUES (?, ?, 0, ?, ?, ?)",
                  (model_id, steps, saved_dir, steps, int(optimizer)))

    def progress(self, model_id: str) -> Progress | None:
        rows = self._run("SELECT * FROM progress WHERE model_id = ?", (model_id,))
        if not rows:
            return None
        row = rows[0]
        return Progress(row["model_id"], row["steps"], bool(row["pending"]), row["saved_dir"], row["saved_step"],
                        bool(row["saved_optimizer"]))

    def gradient_pending(self, model_id: str) -> None:
        self._run("UPDATE progress SET pending = 1 WHERE model_id = ?", (model_id,))

    def stepped(self, model_id: str) -> int:
        """One optimizer step taken (the pending gradient used); the model's step count now."""
        with self._lock:
            self._db.execute("UPDATE progress SET steps = steps + 1, pending = 0 WHERE model_id = ?", (model_id,))
            row = self._db.execute("SELECT steps FROM progress WHERE model_id = ?", (model_id,)).fetchone()
        return row["steps"] if row is not None else 0

    def saved(self, model_id: str, directory: str) -> str | None:
        """The model's whole state (optimizer included) saved at `directory`; the directory of the
        save it replaces as the one to restore from."""
        with self._lock:
            row = self._db.execute("SELECT saved_dir FROM progress WHERE model_id = ?", (model_id,)).fetchone()
            self._db.execute("UPDATE progress SET saved_dir = ?, saved_step = steps, saved_optimizer = 1 "
                             "WHERE model_id = ?", (directory, model_id))
        return row["saved_dir"] if row is not None else None

    def restored(self, model_id: str) -> None:
        """A new engine holds the model as saved: its later steps and pending gradient are gone."""
        self._run("UPDATE progress SET steps = saved_step, pending = 0 WHERE model_id = ?", (model_id,))

    # Futures.

    def add_future(self, kind: str, model_id: str | None, dedup_key: str | None) -> tuple[str, bool]:
        """A new pending future, or the one already made for `dedup_key` (a retried submission):
        its request id and whether it is new."""
        with self._lock:
            if dedup_key is not None:
                row = self._db.execute("SELECT request_id FROM futures WHERE dedup_key = ?", (dedup_key,)).fetchone()
                if row is not None:
                    return row["request_id"], False
            request_id = uuid.uuid4().hex
            self._db.execute("INSERT INTO futures (request_id, model_id, kind, dedup_key, status, created) "
                             "VALUES (?, ?, ?, ?, 'pending', ?)",
                             (request_id, model_id, kind, dedup_key, time.time()))
            return request_id, True

    def future_id(self, dedup_key: str) -> str | None:
        """The request id of the future made for `dedup_key`, if any."""
        rows = self._run("SELECT request_id FROM futures WHERE dedup_key = ?", (dedup_key,))
        return rows[0]["request_id"] if rows else None

    def complete_future(self, request_id: str, result: bytes, media_type: str) -> None:
        self._run("UPDATE futures SET status = 'done', result = ?, media_type = ?, finished = ? WHERE request_id = ?",
                  (result, media_type, time.time(), request_id))

    def fail_future(self, request_id: str, error: str, category: str) -> None:
        self._run("UPDATE futures SET status = 'error', error = ?, category = ?, finished = ? WHERE request_id = ?",
                  (error, category, time.time(), request_id))

    def fail_pending_futures(self, error: str) -> None:
        """Fails every pending future: they died with the engine that was to run them."""
        self._run("UPDATE futures SET status = 'error', error = ?, category = 'server', finished = ? "
                  "WHERE status = 'pending'", (error, time.time()))

    def retrieved(self, request_id: str) -> None:
        """The client has the settled future's answer: it is kept `result_ttl_s` from now."""
        self._run("UPDATE futures SET retrieved = ? WHERE request_id = ? AND retrieved IS NULL AND status != 'pending'",
                  (time.time(), request_id))

    def expire_futures(self, before: float, forget_before: float) -> None:
        """Drops the answers of futures settled (or first retrieved) before `before`, keeping a small
        row that says so (and still answers a retried submission), and forgets those rows
        altogether once that was before `forget_before`."""
        with self._lock:
            self._db.execute("UPDATE futures SET status = 'expired', result = NULL, error = NULL, media_type = NULL "
                             "WHERE status IN ('done', 'error') AND COALESCE(retrieved, finished) < ?", (before,))
            self._db.execute("DELETE FROM futures WHERE status = 'expired' AND COALESCE(retrieved, finished) < ?",
                             (forget_before,))

    def future(self, request_id: str) -> FutureRecord | None:
        rows = self._run("SELECT * FROM futures WHERE request_id = ?", (request_id,))
        if not rows:
            return None
        row = rows[0]
        return FutureRecord(row["request_id"], row["model_id"], row["kind"], row["status"], row["result"],
                            row["media_type"], row["error"], row["category"])

    # Checkpoints.

    def checkpoint_dir(self, model_id: str, kind: CheckpointKind, name: str) -> Path:
        return self.run_dir / "checkpoints" / model_id / PATH_SEGMENT[kind] / name

    def autosave_dir(self, model_id: str) -> Path:
        """A new directory for the model's automatic save (the engine writes it)."""
        directory = self.run_dir / "checkpoints" / model_id / AUTOSAVE / uuid.uuid4().hex[:12]
        directory.parent.mkdir(parents=True, exist_ok=True)
        return directory

    def is_autosave(self, directory: str) -> bool:
        return Path(directory).parent.name == AUTOSAVE and Path(directory).parent.parent.parent == (
            self.run_dir / "checkpoints")

    def add_checkpoint(self, model_id: str, kind: CheckpointKind, name: str) -> CheckpointRecord:
        """Records a finished save (replacing one of the same path) and, for a training state, makes
        it the model's latest checkpoint."""
        record = CheckpointRecord(tinker_path(model_id, kind, name), model_id, name, kind,
                                  str(self.checkpoint_dir(model_id, kind, name)), time.time())
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO checkpoints VALUES (?, ?, ?, ?, ?, ?)",
                             (record.tinker_path, model_id, name, kind, record.directory, record.created))
            if kind == "state":
                self._db.execute("UPDATE models SET last_checkpoint = ? WHERE model_id = ?",
                                 (record.tinker_path, model_id))
        return record

    def checkpoint(self, path: str) -> CheckpointRecord | None:
        rows = self._run("SELECT * FROM checkpoints WHERE tinker_path = ?", (path,))
        return _checkpoint(rows[0]) if rows else None

    def checkpoint_at(self, directory: str | None) -> CheckpointRecord | None:
        """The checkpoint whose files are `directory`, if a client can name it."""
        rows = self._run("SELECT * FROM checkpoints WHERE directory = ?", (directory,)) if directory else []
        return _checkpoint(rows[0]) if rows else None

    def checkpoints(self, model_id: str | None = None) -> list[CheckpointRecord]:
        if model_id is None:
            return [_checkpoint(row) for row in self._run("SELECT * FROM checkpoints ORDER BY created")]
        return [_checkpoint(row) for row in self._run("SELECT * FROM checkpoints WHERE model_id = ? ORDER BY created",
                                                      (model_id,))]

    def delete_checkpoint(self, path: str) -> None:
        """Forgets the checkpoint at `path`; a model whose latest save it was now names its previous one."""
        with self._lock:
            self._db.execute("DELETE FROM checkpoints WHERE tinker_path = ?", (path,))
            self._db.execute("UPDATE models SET last_checkpoint = (SELECT tinker_path FROM checkpoints c WHERE "
                             "c.model_id = models.model_id AND c.kind = 'state' ORDER BY c.created DESC LIMIT 1) "
                             "WHERE last_checkpoint = ?", (path,))

    def restore_point_of(self, directory: str) -> str | None:
        """The live model that a new engine would bring back from `directory`, if any."""
        rows = self._run("SELECT progress.model_id FROM progress JOIN models USING (model_id) "
                         "WHERE saved_dir = ? AND models.state = 'live'", (directory,))
        return rows[0]["model_id"] if rows else None

    # Sampling sessions.

    def add_sampler(self, sampler: SamplerRecord) -> None:
        self._run("INSERT OR REPLACE INTO samplers VALUES (?, ?, ?, ?, ?, ?)",
                  (sampler.sampler_id, sampler.session_id, sampler.base_model, sampler.model_path,
                   sampler.directory, sampler.created))

    def sampler(self, sampler_id: str) -> SamplerRecord | None:
        rows = self._run("SELECT * FROM samplers WHERE sampler_id = ?", (sampler_id,))
        return _sampler(rows[0]) if rows else None

    def samplers(self, session_id: str | None = None, model_path: str | None = None,
                 open_sessions: bool = False) -> list[SamplerRecord]:
        """The sampling sessions of `session_id`, of `model_path`, and (`open_sessions`) only those
        whose session has not finished."""
        sql, args = "SELECT samplers.* FROM samplers JOIN sessions USING (session_id) WHERE 1", []
        if session_id is not None:
            sql, args = sql + " AND session_id = ?", [*args, session_id]
        if model_path is not None:
            sql, args = sql + " AND model_path = ?", [*args, model_path]
        if open_sessions:
            sql += " AND sessions.finished IS NULL"
        return [_sampler(row) for row in self._run(sql, tuple(args))]


def _model(row: sqlite3.Row) -> ModelRecord:
    return ModelRecord(row["model_id"], row["session_id"], row["base_model"], row["rank"],
                       tuple(json.loads(row["targets"])), row["seed"], row["created"], row["state"],
                       row["last_checkpoint"], json.loads(row["user_metadata"]))


def _sampler(row: sqlite3.Row) -> SamplerRecord:
    return SamplerRecord(row["sampler_id"], row["session_id"], row["base_model"], row["model_path"], row["directory"],
                         row["created"])


def _checkpoint(row: sqlite3.Row) -> CheckpointRecord:
    return CheckpointRecord(row["tinker_path"], row["model_id"], row["name"], row["kind"], row["directory"],
                            row["created"])
