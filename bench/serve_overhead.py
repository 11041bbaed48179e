"""What `podtrain serve` costs per request, apart from its engine: `bench/serve.py`'s client loop
(`bench/serve_loop.py`, through the `tinker` SDK) against the real front end, scheduler and store
over the NumPy test double of the engine (`tests/serve/fake_backend.py`), whose work is near zero.

    PYTHONPATH=. .venv/bin/python bench/serve_overhead.py [--steps 21] [--profile FILE]

The server runs in its own process, as the service's driver does, and the client loop in this one.
Per adapter count (1, 4, 16 over the same 16 rows x 128 tokens) it prints the median step's seconds
and the CPU seconds per step of the client (the SDK) and of the server: with the engine's own step
time added, the step bounds what the loop can reach on the real service.
`--profile FILE` runs the server under cProfile and writes its statistics to FILE.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KEY = "tml-bench"
BASE = "fake/bench-lm"
VOCAB = 512


def serve(port_file: Path, run_dir: Path, profile: str | None) -> None:
    """The app over the test double on a free loopback port, written to `port_file`; until killed."""
    sys.path.insert(0, str(ROOT / "tests" / "serve"))
    import uvicorn
    from fake_backend import FakeBackend

    from podtrain.orchestrator.serve.api import create_app
    from podtrain.orchestrator.serve.store import Store
    from podtrain.orchestrator.serve.work import BaseInfo

    info = BaseInfo(base_model=BASE, tokenizer_id=BASE, model_type="llama", vocab_size=VOCAB, max_seq_len=256,
                    max_rank=8, max_adapters=64, eos_token_ids=(1,), max_sample_tokens=128)
    app = create_app(FakeBackend(info), Store(run_dir), api_key=KEY, max_request_bytes=64 << 20)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()  # connections made before uvicorn accepts wait in the backlog
    port_file.write_text(str(sock.getsockname()[1]))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    profiler = cProfile.Profile() if profile else None
    if profiler:
        profiler.enable()
    try:
        server.run(sockets=[sock])
    finally:
        if profiler:
            profiler.disable()
            profiler.dump_stats(profile)


def cpu_s(pid: int | None = None) -> float:
    """CPU seconds (user and system, every thread) this process, or process `pid`, has used."""
    if pid is None:
        return time.process_time()
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=21)
    parser.add_argument("--adapters", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--profile", help="write the server's cProfile statistics here")
    parser.add_argument("--serve", nargs=2, metavar=("PORT_FILE", "RUN_DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        serve(Path(args.serve[0]), Path(args.serve[1]), args.profile)
        return
    sys.path.insert(0, str(ROOT / "bench"))
    from serve_loop import run_loop

    with tempfile.TemporaryDirectory() as work:
        port_file = Path(work) / "port"
        command = [sys.executable, __file__, "--serve", str(port_file), str(Path(work) / "run")]
        server = subprocess.Popen(command + (["--profile", args.profile] if args.profile else []))
        try:
            deadline = time.monotonic() + 60
            while not port_file.exists() or not port_file.read_text():
                if server.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"the server did not start (exit {server.poll()})")
                time.sleep(0.05)
            url = f"http://127.0.0.1:{port_file.read_text()}"
            for adapters in args.adapters:
                client, served = cpu_s(), cpu_s(server.pid)
                result = run_loop(url, BASE, adapters=adapters, steps=args.steps, rows=16, api_key=KEY,
                                  vocab_size=VOCAB)
                timed = result["step_s"][1:]
                print(json.dumps({"adapters": adapters, "rows": result["rows"], "median_step_s":
                                  round(statistics.median(timed), 4), "min_step_s": round(min(timed), 4),
                                  "requests_per_step": 2 * adapters,
                                  # CPU over every step, the first included, and the clients' creation
                                  "client_cpu_s_per_step": round((cpu_s() - client) / (args.steps + 1), 4),
                                  "server_cpu_s_per_step": round((cpu_s(server.pid) - served) / (args.steps + 1), 4)}),
                      flush=True)
        finally:
            server.send_signal(signal.SIGINT)  # uvicorn ends on it, so the profile is written
            server.wait(timeout=30)


if __name__ == "__main__":
    main()
