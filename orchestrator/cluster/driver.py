"""The driver: reserve the gang, run an attempt, classify how it ended, restart within the budgets.

`run_job(config, run_dir)` is what `podtrain train` runs for the `local`, `tpu` and `gpu` cluster
kinds (the same code for all three; only the reservation and the environment differ). Each
attempt reserves the whole gang again, starts one fresh worker process per host through its host
actor, and watches them:

- every process's output goes to `<run_dir>/logs/attempt-<n>/rank<r>.log`; rank 0's lines and
  every rank's tracebacks are printed here with a `[rank r]` prefix. Attempt numbers continue
  after the run directory's existing `attempt-<n>` folders, so running a run name again (to
  resume it) neither overwrites nor re-reads an earlier job's files;
- every worker's heartbeat names the phase it is in (`protocol.PHASES`: start, distributed,
  restore, compile, step, save, commit, serve); a rank that stays in one past its timeout
  (`protocol.PHASE_TIMEOUTS`: `cluster.init_timeout_s` for `jax.distributed`, and so on) is a hang
  of that phase: every rank's Python stacks go to `<run_dir>/stacks/attempt-<n>/`, the report
  names the phase, the ranks waiting in it and the ones that have not arrived (rank, host, Ray
  node, pid, where each is), and blames one (`blame`), then the gang is killed. A rank that aborts
  while a peer is stopped, or fails because JAX's coordination service lost a peer's heartbeats
  (`cluster.heartbeat_timeout_s`, often shorter than the phase's own timeout), gave up waiting
  for it: that is the peer's hang, and the running ranks' stacks are dumped;
- the first process to end decides the class, and the class the budget (`Budgets`):
  - `preempted` (exit 75, after a checkpoint) and `node_lost` (a host actor or its node died or
    stopped answering, also while the gang starts) draw on `cluster.max_preemptions`;
  - `crash` (a signal or abort), `exception` (exit 1 with a traceback) and `hang` draw on
    `cluster.max_failures`;
  - `reservation` (the gang was not ready within `cluster.reserve_timeout_s`) draws on
    `cluster.max_preemptions` while it follows a preemption or a lost node (waiting for capacity
    to come back is part of that preemption), else on `cluster.max_failures`;
  - `config` (exit 2: a mistake in the config or the data it names) fails the job at once, and so
    does the same traceback twice in a row; `port` (the coordinator port could not be bound) is
    retried on another port, at most `MAX_PORT_RETRIES` times in a row.
- SIGTERM or SIGINT to the driver (`ray job stop`, Ctrl-C) is passed on to every worker, which
  checkpoints and exits within `cluster.stop_grace_s`; then the gang is killed and the job ends
  as stopped.

Any failure kills every process of the gang (and removes TPU lock files) before the next attempt.
`checkpoint.resume` decides where the job starts; once the job has committed a checkpoint of its
own, every later attempt restores the latest one (`resume=auto`, see `worker_config`). The outcome
is printed and written to `<run_dir>/job.json` (`attempts` counts this job's attempts).
"""

from __future__ import annotations

import dataclasses
import json
import re
import signal
import sys
import time
from pathlib import Path

from podtrain.orchestrator.checkpoint.resume import committed_steps, resume_step
from podtrain.orchestrator.checkpoint.rundir import RunLock, checkpoint_directory
from podtrain.orchestrator.cluster import leftovers
from podtrain.orchestrator.cluster.elastic import Elastic
from podtrain.orchestrator.cluster.hangs import classify, describe_rank, hang_outcome, overdue
from podtrain.orchestrator.cluster.logs import LogFilter
from podtrain.orchestrator.cluster.outcomes import (
    BLAMED_CLASSES,
    FAILURE_CLASSES,
    PREEMPTION_CLASSES,
    Attempt,
    Budgets,
    Ending,
    JobResult,
    JobStatus,
    Outcome,
    Quarantine,
)
from podtrain.orchestrator.cluster.reserve import (
    Gang,
    ReservationError,
    connect,
    gang_devices,
    megascale_env,
    reserve,
)
from podtrain.orchestrator.common import protocol as p
from podtrain.orchestrator.common.errors import ConfigError
from podtrain.orchestrator.config.compose import to_yaml
from podtrain.orchestrator.config.schema import Config
from podtrain.orchestrator.config.validate import validate
from podtrain.orchestrator.plan.launch_check import check_before_launch
from podtrain.orchestrator.train.goodput import driver_line, failure_line
from podtrain.orchestrator.train.preflight import check_inputs

MAX_PORT_RETRIES = 5
MEGASCALE_PORT = 8081  # the multi-slice coordinator's port on slice 0's first host (libtpu's default)
POLL_S = 0.5


def _host_errors() -> tuple[type[Exception], ...]:
    """Ray's errors for a host actor (or its node) that died or stopped answering."""
    import ray

    return ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError, ray.exceptions.NodeDiedError


def _lost(rank: int | None, error: Exception, last_answer: float) -> Outcome:
    first_line = str(error).splitlines()[0] if str(error) else ""
    return Outcome(Ending.NODE_LOST, rank, f"host actor lost: {type(error).__name__}: {first_line}",
                   fault_at=last_answer)


def next_attempt(run_dir: Path) -> int:
    """The number after the run directory's last `logs/attempt-<n>` folder (1 for a new run)."""
    numbers = [int(d.name.removeprefix("attempt-")) for d in (Path(run_dir) / "logs").glob("attempt-*")
               if d.name.removeprefix("attempt-").isdigit()]
    return max(numbers, default=0) + 1


def worker_config(config: Config, *, own_checkpoint: bool) -> Config:
    """The config the workers of an attempt train with: no cluster of their own (`kind=none`), and
    `checkpoint.resume=auto` once the job has committed a checkpoint of its own (`own_checkpoint`).

    The user's `resume` says where the job starts; a restart must continue from the job's latest
    step instead: `none` would refuse the job's own checkpoints, a step number would drop the steps
    trained since.
    """
    cluster = dataclasses.replace(config.cluster, kind="none", elastic=False)
    if not own_checkpoint:
        return dataclasses.replace(config, cluster=cluster)
    checkpoint = dataclasses.replace(config.checkpoint, resume="auto")
    return dataclasses.replace(config, cluster=cluster, checkpoint=checkpoint)


def _normalise(tb: str) -> str:
    return re.sub(r"0x[0-9a-fA-F]+", "0x?", tb).strip()


def _last_checkpoint(config: Config, run_dir: Path) -> int | None:
    """The newest committed step in `checkpoint.dir` (a step folder named by its number), or None."""
    return max(committed_steps(checkpoint_directory(config.checkpoint.dir, run_dir)), default=None)


class Driver:
    """Runs one job: attempts until success, a stop, or a spent budget."""

    def __init__(self, config: Config, run_dir: Path, out=None, *, service=None):
        """`service`: for `podtrain serve`, the driver's `GangBackend`: its environment goes to every
        worker, and it hears when an attempt's gang is lost."""
        self.config, self.cluster = config, config.cluster
        self.service = service
        self.run_dir = Path(run_dir).absolute()
        self.out = out or sys.stdout
        self.stop_requested = False
        self.last_step: int | None = None
        self.attempts = 0
        self.history: list[Attempt] = []
        self.quarantine = Quarantine(self.cluster.quarantine_window_s, self.cluster.quarantine_s)
        self.elastic = Elastic.of(self.cluster, service=service is not None)
        self._infos: list[dict] = []  # the current attempt's hosts
        self._last_answer = time.time()  # when every host actor last answered a poll
        self.logs = LogFilter(self.out)

    def say(self, message: str) -> None:
        print(f"podtrain: {message}", file=self.out, flush=True)

    def _on_signal(self, signum, frame) -> None:
        if not self.stop_requested:
            self.say(f"received {signal.Signals(signum).name}: asking every worker to checkpoint and stop "
                     f"(grace {self.cluster.stop_grace_s:g}s)")
        self.stop_requested = True

    def run(self) -> JobResult:
        """Runs the attempts; writes job.json and says how the job ended.

        Raises:
            ConfigError: a worker found a mistake in the input (nothing trained: job.json is not written).
        """
        self.say(f"run directory {self.run_dir}")
        ended = leftovers.end_leftovers(self.run_dir)
        if ended:
            self.say(ended)
        self.quarantine.spares = not connect(self.config)
        leftovers.record(self.run_dir)
        # After connecting: ray.init installs its own SIGTERM handler, which would end the driver at once.
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            result = self._attempts()
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            leftovers.clear(self.run_dir)
        if isinstance(result, ConfigError):
            if self.last_step is not None:  # earlier attempts trained: their outcome is the job's record
                self._write_job(JobResult(JobStatus.FAILED, str(result), self.attempts, {}, self.last_step,
                                          _last_checkpoint(self.config, self.run_dir), str(self.run_dir)))
            raise result
        self._write_job(result)
        first = self.history[0].attempt if self.history else 1
        last = first + result.attempts - 1
        # A run directory's attempts are numbered across its jobs (a resumed run, a restarted service).
        numbered = "" if first == 1 else f" (attempt{'s' if last > first else ''} {first}" + (
            f"-{last}" if last > first else "") + " of this run directory)"
        self.say(f"job {result.status}: {result.reason}; last step {result.last_step}, last checkpoint "
                 f"{result.last_checkpoint}, attempts {result.attempts}{numbered}, restarts {result.restarts}")
        return result

    def _write_job(self, result: JobResult) -> None:
        result.history = [a.record() for a in self.history]
        result.quarantined = self.quarantine.record()
        (self.run_dir / "job.json").write_text(json.dumps(dataclasses.asdict(result), indent=1) + "\n")

    def _attempts(self) -> JobResult | ConfigError:
        restarts = {kind: 0 for kind in (*PREEMPTION_CLASSES, *FAILURE_CLASSES, Ending.PORT, Ending.RESIZED)}
        budgets = Budgets(self.cluster.max_failures, self.cluster.max_preemptions)
        port_retries, previous_tb, attempts = 0, None, 0
        self.run_dir.mkdir(parents=True, exist_ok=True)
        first_attempt, checkpoint_at_start = next_attempt(self.run_dir), _last_checkpoint(self.config, self.run_dir)

        def result(status, reason):
            return JobResult(status, reason, attempts, {str(k): v for k, v in restarts.items() if v}, self.last_step,
                             _last_checkpoint(self.config, self.run_dir), str(self.run_dir))

        while True:
            attempt, attempts = first_attempt + attempts, attempts + 1
            self.attempts = attempts
            own_checkpoint = _last_checkpoint(self.config, self.run_dir) != checkpoint_at_start
            config = worker_config(self.config, own_checkpoint=own_checkpoint)
            self.history.append(Attempt(attempt, time.time(), self._resumes_from(config)))
            outcome = self._one_attempt(attempt, port_retries, config)
            self.history[-1].end(outcome, time.time())
            if outcome.kind not in (Ending.DONE, Ending.STOPPED, Ending.CONFIG, Ending.RESIZED) and not self.service:
                failure_line(self.run_dir, attempt, self.history[-1].record())
            if self.service is not None:
                self.service.lost(f"attempt {attempt} ended: {outcome.kind}: {outcome.detail}")
            if outcome.kind == Ending.DONE:
                done = "served until told to stop" if self.service else f"trained to step {self.config.train.steps}"
                return result(JobStatus.SUCCEEDED, done)
            if outcome.kind == Ending.STOPPED or self.stop_requested:
                return result(JobStatus.STOPPED, "stopped on request after checkpointing")
            if outcome.kind == Ending.CONFIG:
                return ConfigError(outcome.detail)
            self.say(f"attempt {attempt} ended: {outcome.kind} (rank {outcome.rank}): {outcome.detail}")
            self._blame(outcome)
            restarts[outcome.kind] += 1
            self.elastic.lost = outcome.kind in PREEMPTION_CLASSES
            if outcome.kind == Ending.RESIZED:
                continue
            if outcome.kind == Ending.PORT:
                port_retries += 1
                if port_retries > MAX_PORT_RETRIES:
                    return result(JobStatus.FAILED, f"no coordinator port could be bound in {port_retries} tries")
                continue
            port_retries = 0
            spent = budgets.charge(outcome.kind)
            tb = _normalise(outcome.traceback) if outcome.traceback else None
            # A service runs again, alone, the request that was in flight and fails it if it brings the
            # workers down again (`serve.scheduler`): its second traceback is that request's, not the job's.
            if tb is not None and tb == previous_tb and self.service is None:
                self.say(f"the same exception twice in a row; not retrying it:\n{outcome.traceback}")
                return result(JobStatus.FAILED, f"the same exception twice in a row on rank {outcome.rank}: "
                                        f"{outcome.detail}")
            previous_tb = tb
            if spent:
                return result(JobStatus.FAILED, f"{spent}; last: {outcome.kind}: {outcome.detail}")
            last = _last_checkpoint(self.config, self.run_dir)
            origin = ("each adapter's last save" if self.service is not None else
                      "the start (no checkpoint yet)" if last is None else f"the last committed checkpoint ({last})")
            self.say(f"restarting from {origin}; failures {budgets.failures}/"
                     f"{self.cluster.max_failures}, preemptions {budgets.preemptions}/{self.cluster.max_preemptions}")
            self._write_job(result(JobStatus.RUNNING, f"restarting after attempt {attempt}: {outcome.kind}"))

    def _one_attempt(self, attempt: int, port_retries: int, config: Config) -> Outcome:
        """Reserves the gang, runs `config` on it and watches it; how it ended (never raises for a lost host)."""
        started = self._attempt_started = time.time()
        self._infos = []
        try:
            gang, config = self._reserve(attempt, config)
        except ReservationError as error:
            return Outcome(Ending.RESERVATION, None, str(error), fault_at=started)
        except ConfigError as error:
            return Outcome(Ending.CONFIG, None, str(error))
        except _host_errors() as error:  # a host actor died before it answered
            return _lost(None, error, started)
        self._infos, self.history[-1].slices = gang.infos, self.elastic.slices
        try:
            self.say(f"attempt {attempt}: reserved {len(gang.actors)} hosts in {time.time() - started:.1f}s "
                     f"({', '.join(sorted({i['ip'] for i in gang.infos}))})")
            return self._watch(gang, attempt, port_retries, config)
        except _host_errors() as error:  # a host actor died while its worker started
            return _lost(None, error, self._last_answer)
        finally:
            gang.release()

    def _reserve(self, attempt: int, config: Config) -> tuple[Gang, Config]:
        """The attempt's gang, without the quarantined hosts unless no spare comes in time, on the
        slices `Elastic` chooses; and `config` on those slices."""
        exclude = self.quarantine.excluded(time.time())
        if exclude:
            hosts = ", ".join(self.quarantine.hosts.get(node, node[:8]) for node in sorted(exclude))
            self.say(f"attempt {attempt}: reserving without the quarantined hosts ({hosts}); waiting for capacity up "
                     f"to cluster.reserve_timeout_s={self.cluster.reserve_timeout_s:g}s")

        def without_quarantined(cluster, name):
            try:
                return reserve(cluster, name, exclude=exclude)
            except ReservationError:
                if not exclude:
                    raise
                self.say(f"attempt {attempt}: no spare host came within cluster.reserve_timeout_s="
                         f"{self.cluster.reserve_timeout_s:g}s; reserving on the quarantined hosts again")
                self.quarantine.lift()
                return reserve(cluster, f"{name}-again")

        return self.elastic.reserve(config, f"podtrain-{self.run_dir.name}-{attempt}", without_quarantined, self.say)

    def _start(self, gang: Gang, attempt: int, port_retries: int, config: Config) -> None:
        import ray

        preferred = self.cluster.coordinator_port if port_retries == 0 else 0
        port = ray.get(gang.actors[0].pick_port.remote(preferred), timeout=60)
        coordinator_ip = gang.infos[0]["ip"]
        if preferred and port != preferred:
            self.say(f"coordinator port {preferred} is in use on {coordinator_ip}; using {port}")
        config_yaml = to_yaml(config)
        attempt_dir = self.run_dir / "logs" / f"attempt-{attempt}"
        starts = []
        for rank, actor in enumerate(gang.actors):
            env = {
                **gang.host_env[rank],
                **megascale_env(dataclasses.replace(self.cluster, num_slices=len(set(gang.slices))), coordinator_ip,
                                gang.slices[rank], MEGASCALE_PORT),
                p.ENV_RUN_DIR: str(self.run_dir),
                p.ENV_COORDINATOR: f"{coordinator_ip}:{port}",
                p.ENV_NUM_PROCESSES: str(len(gang.actors)),
                p.ENV_PROCESS_ID: str(rank),
                p.ENV_INIT_TIMEOUT: str(self.cluster.init_timeout_s),
                p.ENV_HEARTBEAT_TIMEOUT: str(self.cluster.heartbeat_timeout_s),
                p.ENV_ATTEMPT: str(attempt),
                **(self.service.env() if self.service is not None else {}),
            }
            starts.append(actor.start.remote(env, config_yaml, str(attempt_dir), rank))
        pids = ray.get(starts, timeout=60)
        leftovers.record(self.run_dir)  # the host actors and their workers too
        if self.service is None:
            driver_line(self.run_dir, attempt, self._attempt_started, time.time())
        self.say(f"attempt {attempt}: started {len(pids)} worker processes, coordinator {coordinator_ip}:{port}, "
                 f"logs in {attempt_dir}")

    def _poll(self, gang: Gang) -> tuple[list[dict | None], Outcome | None]:
        import ray

        refs = [actor.poll.remote() for actor in gang.actors]
        polls: list[dict | None] = []
        lost = None
        for rank, ref in enumerate(refs):
            try:
                polls.append(ray.get(ref, timeout=60))
            except _host_errors() as error:
                polls.append(None)
                lost = lost or _lost(rank, error, self._last_answer)
        if lost is None:
            self._last_answer = time.time()
        return polls, lost

    def _watch(self, gang: Gang, attempt: int, port_retries: int, config: Config) -> Outcome:
        self._start(gang, attempt, port_retries, config)
        stop_deadline = None
        while True:
            polls, lost = self._poll(gang)
            for rank, poll in enumerate(polls):
                if poll is not None:
                    self.logs.feed(rank, poll["lines"])
                    if poll["heartbeat"] is not None:
                        self._progress(poll)
            if lost is not None:
                return lost
            codes = [poll["returncode"] for poll in polls]
            if all(code == p.EXIT_OK for code in codes):
                return Outcome(Ending.DONE)
            ended = [(rank, code) for rank, code in enumerate(codes) if code not in (None, p.EXIT_OK)]
            if ended:
                outcome = classify(ended, polls)
                if outcome.kind == Ending.HANG:  # a peer gave up waiting for a rank still there: where is it?
                    self._dump_stacks(gang, attempt)
                if outcome.fault_at is None:  # an exit: when a poll first found it
                    outcome.fault_at = min((polls[r].get("ended_at") or time.time() for r, _ in ended))
                if self.stop_requested and outcome.kind == Ending.PREEMPTED:
                    return Outcome(Ending.STOPPED, outcome.rank, "checkpointed and exited on request")
                if self.elastic.growing and outcome.kind == Ending.PREEMPTED:
                    return Outcome(Ending.RESIZED, None, f"saved to grow to {self.cluster.num_slices} slices")
                return outcome
            noticed = [rank for rank, poll in enumerate(polls) if poll.get("notice") == "preempting"]
            grow = (stop_deadline is None and self.elastic.enabled
                    and self.elastic.should_grow(self.history[-1].first_step_at is not None))
            if grow:
                self.say(f"slices free again: the gang saves at the step it agrees on and restarts on all "
                         f"{self.cluster.num_slices}")
            if (self.stop_requested or noticed or grow) and stop_deadline is None:
                self._wind_down(gang, noticed)
                stop_deadline = time.monotonic() + self.cluster.stop_grace_s
            if stop_deadline is not None and time.monotonic() > stop_deadline:
                kind = Ending.STOPPED if self.stop_requested else Ending.PREEMPTED
                left = ", ".join(describe_rank(r, poll, gang.infos[r]) for r, poll in enumerate(polls)
                                 if poll["returncode"] is None)
                return Outcome(kind, None, f"workers did not exit within cluster.stop_grace_s="
                                           f"{self.cluster.stop_grace_s:g}s: {left}; killed")
            late = overdue(polls, self.cluster) if stop_deadline is None else None
            if late is not None:
                stacks = self._dump_stacks(gang, attempt)
                return hang_outcome(polls, stacks, late, gang.infos, self.cluster)
            time.sleep(POLL_S)

    def _blame(self, outcome: Outcome) -> None:
        """Counts a failure against the host of the rank it names (`Quarantine`)."""
        if outcome.kind not in BLAMED_CLASSES or outcome.rank is None or outcome.rank >= len(self._infos):
            return
        info = self._infos[outcome.rank]
        host = " ".join(x for x in (info.get("hostname"), info.get("ip")) if x)
        line = self.quarantine.blame(info.get("node_id") or "", host, f"{outcome.kind} (rank {outcome.rank}): "
                                     f"{outcome.detail.splitlines()[0] if outcome.detail else ''}", time.time())
        if line:
            self.say(line)

    def _resumes_from(self, config: Config) -> int | None:
        """The step an attempt of `config` resumes from (None: a fresh start, or a service)."""
        if self.service is not None:
            return None
        directory = checkpoint_directory(config.checkpoint.dir, self.run_dir)
        try:
            return resume_step(config.checkpoint.resume, directory, committed_steps(directory))
        except ConfigError:
            return None  # the workers say so

    def _progress(self, poll: dict) -> None:
        """A rank's heartbeat: the job's last step; the attempt's start step, its first step (which
        completes the previous attempt's recovery) and its last step."""
        current = self.history[-1] if self.history else None
        step = poll["heartbeat"][0]
        self.last_step = max(self.last_step or 0, step)
        if current is None:
            return
        current.last_step = max(current.last_step or 0, step)
        if poll["phase"] in ("step", "save", "commit", "serve") and current.first_step_at is None:
            current.first_step_at = time.time()
            earlier = self.history[-2] if len(self.history) > 1 else None
            if earlier is not None and earlier.detected_at is not None and earlier.restart_s is None:
                earlier.recovered_by(current)
                if self.service is None:
                    failure_line(self.run_dir, earlier.attempt, earlier.record())

    def _wind_down(self, gang: Gang, noticed: list[int]) -> None:
        """On a stop request, or a serve worker's preemption notice (`noticed` ranks): a service first
        saves its adapters' unsaved steps on the gang, then every worker is told to exit (SIGTERM,
        after which a training worker checkpoints; the service's `release` for serve workers)."""
        import ray

        why = ("a stop was requested" if self.stop_requested else
               f"rank {noticed[0]} received a preemption notice" if noticed else "slices are free again")
        if self.service is not None:
            self.say(f"{why}: saving the adapters with unsaved steps before the workers stop")
            if self.service.before_stop is not None:
                self.service.before_stop(self.cluster.stop_grace_s)
        if self.stop_requested or self.service is None:
            ray.get([actor.send_signal.remote(signal.SIGTERM) for actor in gang.actors])
        if self.service is not None:
            self.service.release(why, self.cluster.stop_grace_s)

    def _dump_stacks(self, gang: Gang, attempt: int) -> list[str]:
        """Every rank's Python stacks (written to `stacks/attempt-<n>/`); "" for a rank whose dump failed."""
        import ray

        directory = self.run_dir / "stacks" / f"attempt-{attempt}"
        refs = [actor.dump_stacks.remote(str(directory / f"rank{rank}.txt")) for rank, actor in enumerate(gang.actors)]
        try:
            stacks = ray.get(refs, timeout=90)
        except Exception as error:
            self.say(f"dumping stacks failed: {error}")
            stacks = [""] * len(refs)
        self.say(f"hang: Python stacks of the running ranks written to {directory}")
        return stacks


def run_job(config: Config, run_dir: Path, out=None) -> JobResult:
    """Runs `config` on its cluster until it succeeds, is stopped, or spends a budget.

    Before anything starts (Ray included) and anything is written, the inputs are checked
    (`preflight`; the data too for `local` hosts, which share this machine's files, while the hosts
    of a pod slice or GPU nodes check it themselves), the step is compiled for a TPU or GPU target
    to check that it fits (`launch_check`), and the run directory is locked for this job.

    Raises:
        ConfigError: a mistake in the input (the mesh does not fit the gang's devices, a data path,
            a checkpoint...), found here or by the workers; or the run directory is in use.
    """
    devices = gang_devices(config.cluster)
    if devices is not None:
        try:
            validate(config, devices)
        except ConfigError as e:
            raise ConfigError(f"{e} (in the gang of cluster.kind={config.cluster.kind}, before starting it)") from None
    check_inputs(config, run_dir, data=config.cluster.kind == "local")
    check_before_launch(config)
    with RunLock(run_dir, f"podtrain train cluster={config.cluster.kind}"):
        return Driver(config, run_dir, out).run()
