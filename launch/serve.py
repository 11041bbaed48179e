"""`podtrain serve -c <preset | YAML | HF dir> [key=value ...]`: the Tinker-API training service.

The HTTP front end (sessions, futures, checkpoints in `<run dir>/serve.sqlite`) runs in this
process. The engine runs on the configured cluster like a training job (`cluster.kind=local`, the
default, starts an embedded Ray and one worker process per host; `tpu` and `gpu` as for training),
every worker running each engine step in lockstep; with `cluster.kind=none` it runs in this
process. `-c` may name an HF directory: its config.json is the model, its weights the base, its
directory name the base model's name and its tokenizer what clients load. The listening address
goes to `<run dir>/serve.json`.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import logging
import os
import sys
import threading
import time
from pathlib import Path

from podtrain.models.hf_read import is_hf_directory, read_json_object
from podtrain.orchestrator.checkpoint.rundir import RunLock, resolve_run_dir
from podtrain.orchestrator.common.errors import ConfigError
from podtrain.orchestrator.common.files import write_atomic
from podtrain.orchestrator.config.compose import load_config, resolve_preset
from podtrain.orchestrator.config.schema import Config
from podtrain.orchestrator.config.validate import validate

log = logging.getLogger(__name__)

API_KEY_ENV = "PODTRAIN_SERVE_API_KEY"


def serve_config(source: str, overrides: list[str]) -> tuple[Config, str]:
    """(the service's config, its run name) from `-c` and the overrides, validated as a service's
    (`serve.*` sets its lengths and seed; the `train` section is not read). The base is frozen, so
    it is stored in the compute dtype (`model.dtype`) unless `model.param_dtype` is given; the
    adapters and their Adam states are float32 either way."""
    config, name = _compose(source, overrides)
    if not any(o.split("=", 1)[0].strip() == "model.param_dtype" for o in overrides):
        config = dataclasses.replace(config, model=dataclasses.replace(config.model, param_dtype=config.model.dtype))
    validate(config, serving=True)
    return config, name


def _compose(source: str, overrides: list[str]) -> tuple[Config, str]:
    if not is_hf_directory(source):
        config = load_config(source, overrides, serving=True)
        name = resolve_preset(source).stem
        serve = config.serve
        if not serve.base_model:
            serve = dataclasses.replace(serve, base_model=name)
        if serve.tokenizer is None and serve.base is not None:
            serve = dataclasses.replace(serve, tokenizer=serve.base)
        return dataclasses.replace(config, serve=serve), name
    from podtrain.models.hf_config import config_from_hf

    directory = Path(source).expanduser().absolute()
    try:
        model = config_from_hf(read_json_object(directory / "config.json"), source=str(directory / "config.json"))
    except ValueError as e:
        raise ConfigError(str(e)) from None
    fixed = [o.split("=", 1)[0] for o in overrides if o.startswith("model.")]
    if fixed:
        raise ConfigError(f"{fixed[0]}: {directory / 'config.json'} describes the model of -c {source}; it cannot "
                          "be overridden")
    config = load_config(None, overrides, serving=True)
    serve = config.serve
    serve = dataclasses.replace(serve, base=str(directory), base_model=serve.base_model or directory.name,
                                tokenizer=serve.tokenizer or str(directory))
    return dataclasses.replace(config, model=model, serve=serve), directory.name


def api_key(config: Config) -> str | None:
    """The key clients must send: `serve.api_key`, else $PODTRAIN_SERVE_API_KEY, else none, which
    only a loopback address may go without."""
    key = config.serve.api_key or os.environ.get(API_KEY_ENV, "")
    host = config.serve.host
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if not key and not loopback:
        raise ConfigError(f"serve.host: {host} is not a loopback address, so the service needs an API key: set "
                          f"serve.api_key or ${API_KEY_ENV}")
    return key or None


def run_command(args) -> int:
    from podtrain.launch.train import log_podtrain_messages

    log_podtrain_messages()
    config, name = serve_config(args.config, args.overrides)
    if config.cluster.elastic:
        raise ConfigError("cluster.elastic: a service's engine runs on a fixed gang; expected false, found true")
    key = api_key(config)
    run_dir = resolve_run_dir(config, name)
    with RunLock(run_dir, f"podtrain serve cluster={config.cluster.kind}"):
        return _serve(config, run_dir, key)


def _serve(config: Config, run_dir: Path, key: str | None) -> int:
    import uvicorn

    from podtrain.orchestrator.serve.api import create_app
    from podtrain.orchestrator.serve.base_info import service_tokenizer
    from podtrain.orchestrator.serve.store import Store

    run_dir.mkdir(parents=True, exist_ok=True)
    tokenizer, eos = service_tokenizer(config)
    c = config.cluster
    if c.kind == "none":
        from podtrain.orchestrator.serve.engine import Engine
        from podtrain.orchestrator.serve.watch import WatchedEngine

        engine = Engine(config, eos_token_ids=eos, page_dir=run_dir / "pages")
        backend, gang = WatchedEngine(engine, c.hang_timeout_s, c.compile_timeout_s), None
    else:
        from podtrain.orchestrator.serve.base_info import serve_info
        from podtrain.orchestrator.serve.gang import GangBackend

        info, targets = serve_info(config, eos)
        # Workers on other machines reach the channel on any interface; it admits only holders of
        # the job's key. Local hosts share this machine's loopback.
        host = "127.0.0.1" if c.kind == "local" else "0.0.0.0"
        # Steps wait for a gang while it starts, joins and builds its engine: each phase's bound.
        # A step that compiles is bounded by compile_timeout_s (the workers' heartbeats say which).
        backend = gang = GangBackend(info, targets, host=host,
                                     step_timeout_s=max(c.hang_timeout_s, c.compile_timeout_s),
                                     ready_timeout_s=c.start_timeout_s + c.init_timeout_s + c.restore_timeout_s)
    store = Store(run_dir)
    app = create_app(backend, store, api_key=key, max_request_bytes=config.serve.max_request_bytes,
                     decode=tokenizer.decode if tokenizer else None, encode=tokenizer.encode if tokenizer else None,
                     autosave_every=config.serve.autosave_every, session_timeout_s=config.serve.session_timeout_s,
                     result_ttl_s=config.serve.result_ttl_s)
    server = uvicorn.Server(uvicorn.Config(app, host=config.serve.host, port=config.serve.port, log_level="warning",
                                           timeout_keep_alive=60))
    thread = threading.Thread(target=server.run, name="serve-http", daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise ConfigError(f"serve.port: could not listen on {config.serve.host}:{config.serve.port}")
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    url = f"http://{config.serve.host}:{port}"
    announce(run_dir, url)
    print(f"podtrain: serving {config.serve.base_model} at {url} (run directory {run_dir})", flush=True)
    save = _saver(app.state.service.scheduler)
    try:
        if gang is None:
            return _serve_in_process(backend, store, save, c.stop_grace_s)
        gang.before_stop = save
        from podtrain.orchestrator.cluster.driver import Driver
        from podtrain.orchestrator.cluster.outcomes import JobStatus

        result = Driver(config, run_dir, service=gang).run()
        # A service ends when it is told to stop: that is its success.
        return 0 if result.status == JobStatus.STOPPED else result.exit_code
    finally:
        if gang is not None:
            gang.stop()
        server.should_exit = True
        thread.join(timeout=10)


def announce(run_dir: Path, url: str) -> None:
    """Where clients reach the service: `<run dir>/serve.json`, which scripts poll for, so it is
    written whole or not at all."""
    write_atomic(run_dir / "serve.json", json.dumps({"url": url, "pid": os.getpid()}) + "\n")


def _saver(scheduler):
    """Before the service stops: every adapter with steps since its last save saved, so that the
    next start brings it back as it is."""
    def save(timeout_s: float) -> None:
        saved, left = scheduler.save_unsaved(timeout_s)
        print(f"podtrain: saved {saved} adapters before the workers stop" + (f"; not saved within {timeout_s:g}s: "
                                                                     f"{', '.join(left)}" if left else ""), flush=True)
    return save


def _serve_in_process(watch, store, save, stop_grace_s: float, stop: threading.Event | None = None) -> int:
    """Serves until SIGTERM or Ctrl-C (`stop`), then saves the adapters with unsaved steps (exit 0);
    or until an engine step runs past its bound: nothing can end a step in this process, so the
    service says what hangs and where, fails the requests waiting (clients are told, not left
    polling) and exits 1 without saving (a supervisor's restart brings the adapters back from
    their last saves)."""
    import signal

    if stop is None:
        stop = threading.Event()
        for s in (signal.SIGTERM, signal.SIGINT):
            signal.signal(s, lambda *_: stop.set())
    while not stop.wait(1.0):
        hung = watch.overdue()
        if hung:
            log.error("%s:\n%s", hung, watch.stack())
            store.fail_pending_futures(f"{hung}; the service stops (cluster.kind=none cannot restart its engine)")
            print(f"podtrain: error: {hung}; the service stops without saving: its adapters come back from their "
                  "last saves when it starts again (cluster.kind=local restarts a hung engine by itself)",
                  file=sys.stderr, flush=True)
            return 1
    save(stop_grace_s)
    return 0
