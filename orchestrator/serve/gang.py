"""The engine spread over the gang: the driver's `GangBackend` sends each engine step to every
host's worker, which all run it in lockstep (every JAX process must run the same program), and
takes the results from process 0.

The channel is `multiprocessing.connection` over TCP: the driver listens, each worker connects
with the job's random key (HMAC challenge) and says which rank it is; a step is one pickled list
of work items, and every rank answers it (process 0 with the results, the others with their
count), so the driver knows the gang finished the step. A worker that waits for work writes its
heartbeat every few seconds, so the driver's hang detection sees an idle service as alive and a
stuck step as hung.

Each gang that has joined whole is a new engine (`generation`): its slots are empty until the
front end's scheduler restores the adapters. While the driver restarts a lost gang, steps wait for
the new one (up to `ready_timeout_s`). A worker given SIGTERM (a preemption notice) says so in its
heartbeat and runs on until the driver has saved the adapters with unsaved steps and `release`s
the gang.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import signal
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Client, Connection, Listener, wait
from pathlib import Path

from podtrain.orchestrator.common import protocol as p
from podtrain.orchestrator.serve.checks import check_work
from podtrain.orchestrator.serve.watch import TRACED_EVENT
from podtrain.orchestrator.serve.work import BaseInfo, EngineLost, EngineRestarted, ServeError, Work

log = logging.getLogger(__name__)
IDLE_BEAT_S = 5.0
STEP_MARGIN_S = 60.0
NOTICE_S = 0.5  # how soon an idle worker's heartbeat shows a preemption notice


class GangBackend:
    """The Backend the driver's front end uses: checks locally, runs steps on the gang."""

    def __init__(self, info: BaseInfo, targets: tuple[str, ...], *, host: str = "127.0.0.1",
                 ready_timeout_s: float = 1800.0, step_timeout_s: float = 600.0):
        self._info, self._targets = info, tuple(targets)
        self.num_processes = 0  # as the workers say when they join
        self.authkey = secrets.token_bytes(32)
        self._listener = Listener((host, 0), authkey=self.authkey)
        self.address = self._listener.address
        self._conns: dict[int, Connection] = {}
        self._changed = threading.Condition()
        self._step_lock = threading.Lock()
        self.ready_timeout_s = ready_timeout_s
        # A worker's answer to a step: the driver finds a stuck worker by its heartbeat first (and
        # kills the gang, which closes the channel); this bounds the wait where nothing else does.
        self.step_timeout_s = step_timeout_s + STEP_MARGIN_S
        self.failure: str | None = None
        self._generation = 0  # gangs that have joined whole
        self._stopped = False
        # What the driver runs before it stops the workers on a stop request (the service's save of
        # its unsaved adapters), given the seconds it may take.
        self.before_stop: Callable[[float], None] | None = None
        threading.Thread(target=self._accept, name="serve-gang-accept", daemon=True).start()

    def env(self) -> dict[str, str]:
        """What each worker needs to join (set in its environment by the driver, after it joined
        Ray): a channel bound to every interface is reached at this Ray node's address."""
        host, port = self.address
        if host == "0.0.0.0":
            import ray

            host = ray.util.get_node_ip_address()
        return {p.ENV_ROLE: "serve", p.ENV_SERVE_ADDRESS: f"{host}:{port}", p.ENV_SERVE_AUTHKEY: self.authkey.hex()}

    def _accept(self) -> None:
        while True:
            try:
                conn = self._listener.accept()
                rank, world = conn.recv()
            except (OSError, EOFError) as error:
                if self._listener is None:
                    return
                log.warning("a worker could not join the serve channel: %s", error)
                continue
            with self._changed:
                old = self._conns.pop(rank, None)
                if old is not None:
                    old.close()
                self._conns[rank] = conn
                self.num_processes = world
                if len(self._conns) == world:
                    self._generation += 1
                    self.failure = None
                self._changed.notify_all()

    def info(self) -> BaseInfo:
        return self._info

    def check(self, work: Work) -> None:
        check_work(self._info, self._targets, work)

    def generation(self) -> int:
        with self._changed:
            return self._generation

    def run(self, works: list[Work], generation: int | None = None) -> list[object]:
        """Sends `works` to every rank and returns process 0's results. EngineLost when a worker
        is lost during the step or does not answer within `step_timeout_s`; ServeError 503 when no
        whole gang joins within `ready_timeout_s`."""
        with self._step_lock:
            conns, current = self._ready()
            if generation is not None and generation != current:
                raise EngineRestarted()
            try:
                for rank in range(self.num_processes):
                    conns[rank].send(works)
                answers = self._answers(conns)
            except (OSError, EOFError, TimeoutError) as error:
                self._drop(conns)
                with self._changed:
                    why = self.failure or f"a worker's channel closed: {str(error) or type(error).__name__}"
                raise EngineLost(f"the engine's workers were lost during this step ({why})") from None
        return answers[0]

    def _answers(self, conns: dict[int, Connection]) -> list[object]:
        """Every rank's answer to the step just sent; TimeoutError naming the ranks that gave none
        within `step_timeout_s`."""
        deadline = time.monotonic() + self.step_timeout_s
        answers: dict[int, object] = {}
        while len(answers) < self.num_processes:
            waiting = [rank for rank in range(self.num_processes) if rank not in answers]
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"ranks {waiting} did not answer the engine step within {self.step_timeout_s:g}s")
            ready = wait([conns[rank] for rank in waiting], timeout=left)
            for rank in waiting:
                if conns[rank] in ready:
                    answers[rank] = conns[rank].recv()
        return [answers[rank] for rank in range(self.num_processes)]

    def _ready(self) -> tuple[dict[int, Connection], int]:
        deadline = time.monotonic() + self.ready_timeout_s
        with self._changed:
            while not self._conns or len(self._conns) < self.num_processes:
                left = deadline - time.monotonic()
                if self._stopped:
                    raise ServeError("the service is stopping", status=503)
                if left <= 0:
                    why = self.failure or f"the workers did not all join within {self.ready_timeout_s:g}s"
                    raise ServeError(f"the engine is not running ({why}); retry later", status=503)
                self._changed.wait(min(left, 1.0))
            return dict(self._conns), self._generation

    def _drop(self, conns: dict[int, Connection]) -> None:
        with self._changed:
            for rank, conn in conns.items():
                if self._conns.get(rank) is conn:
                    del self._conns[rank]
                conn.close()

    def lost(self, why: str) -> None:
        """The gang ended (the driver saw it, `why`): steps wait for the next one."""
        with self._changed:
            for conn in self._conns.values():
                conn.close()
            self._conns.clear()
            self.failure = why
            self._changed.notify_all()

    def release(self, why: str, timeout_s: float) -> None:
        """Tells the gang's workers to exit (after a preemption notice, once the driver saved what it
        must) when the step in flight, if any, is done (waiting up to `timeout_s`); later steps wait
        for the next gang."""
        idle = self._step_lock.acquire(timeout=timeout_s)
        try:
            with self._changed:
                conns, self._conns = self._conns, {}
                self.failure = why
            for conn in conns.values():
                with contextlib.suppress(OSError):
                    conn.send(None)
                conn.close()
        finally:
            if idle:
                self._step_lock.release()

    def stop(self) -> None:
        """Tells every worker to exit (they answer nothing more); a step waiting for a gang ends."""
        with self._changed:
            self._stopped = True
            self._changed.notify_all()
            for conn in self._conns.values():
                with contextlib.suppress(OSError):
                    conn.send(None)


def serve_steps(engine, env, heartbeat: p.Heartbeat, grace_s: float = 120.0) -> int:
    """The worker's loop: join the driver's channel, then run each step it sends until it sends
    None (exit 0). SIGTERM (a preemption notice, or a stop the driver passes on) does not end it at
    once: its heartbeat says `preempting` and it keeps running steps, so that the driver can save
    the adapters that have unsaved steps, until the driver's None or `grace_s` (exit
    `EXIT_PREEMPTED` either way)."""
    noticed: list[float] = []
    signal.signal(signal.SIGTERM, lambda *_: noticed.append(time.monotonic()))
    host, port = env[p.ENV_SERVE_ADDRESS].rsplit(":", 1)
    rank, world = int(env.get(p.ENV_PROCESS_ID, "0")), int(env.get(p.ENV_NUM_PROCESSES, "1"))
    conn = Client((host, int(port)), authkey=bytes.fromhex(env[p.ENV_SERVE_AUTHKEY]))
    conn.send((rank, world))
    heartbeat.phase("serve")
    compiles_in_steps(heartbeat)
    told, last_beat = False, time.monotonic()
    while True:
        if noticed and not told:  # the handler only takes note: the heartbeat is written here
            told = True
            heartbeat.noticed("preempting")
        if noticed and time.monotonic() > noticed[0] + grace_s:
            return p.EXIT_PREEMPTED
        if not conn.poll(NOTICE_S):
            if time.monotonic() - last_beat > IDLE_BEAT_S:
                heartbeat.beat()
                last_beat = time.monotonic()
            continue
        try:
            works = conn.recv()
        except EOFError:
            return p.EXIT_PREEMPTED if noticed else p.EXIT_OK  # the driver is gone
        if works is None:
            return p.EXIT_PREEMPTED if noticed else p.EXIT_OK
        results = engine.run(works)
        heartbeat.step += 1
        heartbeat.phase("serve")
        conn.send(results if rank == 0 else len(results))


def compiles_in_steps(heartbeat: p.Heartbeat) -> None:
    """A step that compiles (a program's first shape) says so in the heartbeat: phase `compile`
    from its first trace to the step's end, bounded by `cluster.compile_timeout_s` instead of the
    step's `hang_timeout_s`. Only this thread's traces count (not the compiles ahead)."""
    import jax

    thread = threading.get_ident()

    def traced(event: str, _seconds: float, **_) -> None:
        if event == TRACED_EVENT and threading.get_ident() == thread and heartbeat.current == "serve":
            heartbeat.phase("compile")

    jax.monitoring.register_event_duration_secs_listener(traced)


def worker_main(config, run_dir: Path, env, heartbeat: p.Heartbeat) -> int:
    """A serve worker: build the engine on this process's devices, then run steps."""
    from podtrain.orchestrator.serve.engine import Engine

    heartbeat.phase("restore")
    engine = Engine(config, page_dir=run_dir / "pages")
    return serve_steps(engine, env, heartbeat, grace_s=config.cluster.stop_grace_s)
