"""Remote experiment trackers, Weights & Biases and MLflow, each fed from its own thread.

Process 0's `MetricsWriter` hands every step's record to the trackers of `metrics.trackers`. A
remote tracker starts and logs on a background thread, so a slow or unreachable server never
stalls a step; one that fails to start or to log warns once and is dropped, and the run goes on.
Each keeps its run id in `<run dir>/trackers.json`, so a restarted or resumed run logs into the
same tracker run (steps that an attempt redoes after a failure are logged again; W&B charts use
the `step` metric as their x-axis, MLflow keeps each value with its step). What a tracker had not
yet sent when its process was killed (kill -9) is lost to it; `metrics.jsonl` keeps every step.
"""

from __future__ import annotations

import collections
import json
import logging
import queue
import secrets
import string
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from podtrain.orchestrator.common.files import write_atomic
from podtrain.orchestrator.config.trackers import MlflowConfig, WandbConfig

logger = logging.getLogger(__name__)
_IDS = "trackers.json"
_CLOSE_TIMEOUT_S = 60.0  # what a run's end waits for a tracker to send what it holds
_WANDB_FLUSH_S = 1.0  # W&B's run file is written this often: a kill -9 loses at most this much of it
_SAVE_LOCK = threading.Lock()  # the trackers' threads share trackers.json


def scalars(record: dict) -> dict[str, float]:
    """The numbers of a step's record (not lists such as expert loads, nor the sample text)."""
    return {k: v for k, v in record.items() if isinstance(v, int | float) and not isinstance(v, bool)}


def _run_ids(run_dir: Path) -> dict:
    path = run_dir / _IDS
    try:
        ids = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return ids if isinstance(ids, dict) else {}


def _update_ids(run_dir: Path, change: Callable[[dict], None]) -> None:
    with _SAVE_LOCK:
        ids = _run_ids(run_dir)
        change(ids)
        write_atomic(run_dir / _IDS, json.dumps(ids, indent=2) + "\n")


def _save_run_id(run_dir: Path, name: str, run_id: str) -> None:
    _update_ids(run_dir, lambda ids: ids.update({name: run_id}))


def _sent(run_dir: Path, name: str) -> int:
    sent = _run_ids(run_dir).get("sent")
    step = sent.get(name, 0) if isinstance(sent, dict) else 0
    return step if isinstance(step, int) else 0


def _save_sent(run_dir: Path, name: str, step: int) -> None:
    def change(ids: dict) -> None:
        sent = ids.get("sent") if isinstance(ids.get("sent"), dict) else {}
        ids["sent"] = sent | {name: step}
    _update_ids(run_dir, change)


class _SentMark:
    """The last step through which a tracker holds every record, kept in trackers.json. Steps are
    logged in order and an attempt first sends what the mark lacks, so each step up to it is held."""

    def __init__(self, run_dir: Path, name: str):
        self.run_dir, self.name = run_dir, name
        self.step = _sent(run_dir, name)

    def advance(self, step: int) -> None:
        if step > self.step:
            self.step = step
            _save_sent(self.run_dir, self.name, step)


class _Wandb:
    """A W&B run with a fixed id (resumed when it exists) whose charts are drawn against `step`."""

    def __init__(self, settings: WandbConfig, run_dir: Path, run_config: dict):
        import wandb

        run_id = _run_ids(run_dir).get("wandb") or "".join(secrets.choice(string.ascii_lowercase + string.digits)
                                                           for _ in range(8))
        _save_run_id(run_dir, "wandb", run_id)
        self.run = wandb.init(
            project=settings.project, entity=settings.entity, name=settings.name or run_dir.name,
            tags=list(settings.tags), config=run_config, id=run_id, resume="allow", dir=str(run_dir),
            mode=settings.mode,
            settings=wandb.Settings(init_timeout=settings.init_timeout_s, silent=True, console="off",
                                    x_disable_stats=True, save_code=False,
                                    x_transaction_log_flush_interval=_WANDB_FLUSH_S),
        )
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")
        self.sent = _SentMark(run_dir, "wandb")
        self._unflushed: collections.deque[tuple[float, int]] = collections.deque()

    def log(self, record: dict) -> None:
        self.run.log(scalars(record))
        # W&B writes its run file on its own thread: a step counts as held once that has surely run
        now = time.monotonic()
        self._unflushed.append((now, int(record["step"])))
        while self._unflushed and now - self._unflushed[0][0] > 2 * _WANDB_FLUSH_S:
            self.sent.advance(self._unflushed.popleft()[1])

    def close(self) -> None:
        self.run.finish()
        if self._unflushed:
            self.sent.advance(max(step for _, step in self._unflushed))


class _Mlflow:
    """An MLflow run, created once (the config as parameters and as `config.json`), then resumed."""

    def __init__(self, settings: MlflowConfig, run_dir: Path, run_config: dict):
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=settings.tracking_uri)
        self.sent = _SentMark(run_dir, "mlflow")
        self.run_id = _run_ids(run_dir).get("mlflow")
        if self.run_id is not None:
            self.client.update_run(self.run_id, status="RUNNING")
            return
        experiment = self.client.get_experiment_by_name(settings.experiment)
        experiment_id = (experiment.experiment_id if experiment is not None
                         else self.client.create_experiment(settings.experiment))
        self.run_id = self.client.create_run(experiment_id, run_name=settings.run_name or run_dir.name).info.run_id
        _save_run_id(run_dir, "mlflow", self.run_id)
        params = [Param(k, str(v)[:6000]) for k, v in _flatten(run_config).items()]
        for start in range(0, len(params), 100):  # MLflow takes at most 100 parameters a batch
            self.client.log_batch(self.run_id, params=params[start:start + 100])
        self.client.log_text(self.run_id, json.dumps(run_config, indent=2), "config.json")

    def log(self, record: dict) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), now, int(record["step"]))
                                                    for k, v in scalars(record).items() if k != "step"])
        self.sent.advance(int(record["step"]))

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def _flatten(tree: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            flat |= _flatten(value, f"{prefix}{key}.")
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def earlier_records(path: Path, through: int):
    """The records of `path` (metrics.jsonl) up to step `through`, read a line at a time: the
    file's end, which this run appends to meanwhile, is never reached for them."""
    if not path.is_file():
        return
    with path.open() as lines:
        for line in lines:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if not isinstance(record, dict) or not isinstance(record.get("step"), int):
                continue
            if record["step"] > through:
                return
            yield record


class BackgroundTracker:
    """Starts a tracker and logs records to it on a daemon thread; its failures warn once and end it.
    Before this run's records it sends those of `backlog` after the tracker's sent mark."""

    def __init__(self, name: str, start: Callable[[], object], backlog: Callable[[], Iterable[dict]] = tuple):
        self.name = name
        self._queue: queue.Queue = queue.Queue()
        self._failed = threading.Event()
        self._thread = threading.Thread(target=self._work, args=(start, backlog), name=f"tracker-{name}",
                                        daemon=True)
        self._thread.start()

    def log(self, record: dict) -> None:
        if not self._failed.is_set():
            self._queue.put(dict(record))

    def close(self, timeout_s: float = _CLOSE_TIMEOUT_S) -> None:
        self._queue.put(None)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.warning("metrics.trackers: %s did not finish sending within %.0f s; the run ends without it",
                           self.name, timeout_s)

    def _work(self, start: Callable[[], object], backlog: Callable[[], Iterable[dict]]) -> None:
        try:
            tracker = start()
        except Exception as e:  # a tracker is never worth a run
            self._fail("could not start", e)
            return
        try:
            missed = 0
            for record in backlog():
                if record["step"] > tracker.sent.step:
                    tracker.log(record)
                    missed += 1
            if missed:
                logger.info("metrics.trackers: %s got %d steps an earlier attempt had not sent", self.name, missed)
            while (record := self._queue.get()) is not None:
                tracker.log(record)
        except Exception as e:
            self._fail("failed to log", e)
        finally:
            try:
                tracker.close()
            except Exception as e:
                logger.warning("metrics.trackers: %s failed to close: %s", self.name, _reason(e))

    def _fail(self, what: str, error: Exception) -> None:
        self._failed.set()
        logger.warning("metrics.trackers: %s %s (%s); the run goes on without it", self.name, what, _reason(error))


def _reason(error: Exception) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:300]}" if text else type(error).__name__


def remote_trackers(names: list[str], wandb: WandbConfig, mlflow: MlflowConfig, run_dir: Path, run_config: dict,
                    *, start_step: int = 0) -> list[BackgroundTracker]:
    """The W&B and MLflow trackers among `names`, each starting on its own thread. With `jsonl`
    among them, each first sends the records through `start_step` that it does not yet hold."""
    makers = {"wandb": lambda: _Wandb(wandb, run_dir, run_config),
              "mlflow": lambda: _Mlflow(mlflow, run_dir, run_config)}
    backlog = ((lambda: earlier_records(run_dir / "metrics.jsonl", start_step)) if "jsonl" in names else tuple)
    return [BackgroundTracker(name, makers[name], backlog) for name in names if name in makers]
