"""`podtrain serve` against SkyRL's Tinker server on the same model and the same client loop.

    PYTHONPATH=. .venv/bin/python bench/serve.py [--skyrl-venv DIR] [--steps N]

Both serve a tiny random Qwen3 (2 layers, hidden 64, vocab 512) with rank-8 adapters;
`bench/serve_loop.py` drives them with the `tinker` SDK: forward_backward + optim_step of 16 rows
x 128 tokens per step, split among 1, 4 or 16 adapters (the same tokens per step), then sampling.
podtrain runs its engine in the service's process (`cluster.kind=none`) and, for 16 adapters,
in a local Ray job's worker (the default). SkyRL runs when its virtualenv can be made
(`bench/skyrl.py`); its sampling needs an SDK before 0.26 (`--sample-python`). Prints one JSON
object: tokens/s, first-step seconds, and podtrain over SkyRL.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.serve_loop import run_loop, sample_loop  # noqa: E402
from bench.skyrl import ensure_skyrl_venv, free_port, make_qwen3_dir, sample_in, skyrl_server  # noqa: E402

RANK, ROWS, TOKENS = 8, 16, 128
KEY = "tml-bench"


@contextlib.contextmanager
def podtrain_server(model_dir: Path, run_dir: Path, *extra: str) -> Iterator[tuple[str, str]]:
    """`podtrain serve -c model_dir` until the block ends; yields (URL, base model name)."""
    command = [sys.executable, "-m", "podtrain.launch.cli", "serve", "-c", str(model_dir), "serve.port=0",
               "serve.max_adapters=18", f"serve.max_rank={RANK}", "serve.max_seq_len=256", f"serve.max_rows={ROWS}",
               f"run.dir={run_dir.parent}", f"run.name={run_dir.name}", *extra]
    log_path = run_dir.parent / f"{run_dir.name}.log"
    log = open(log_path, "w")  # noqa: SIM115 (closed below)
    server = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                              env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    try:
        deadline = time.monotonic() + 600
        while not (run_dir / "serve.json").exists():
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"podtrain serve did not start:\n{log_path.read_text()}")
            time.sleep(0.2)
        yield json.loads((run_dir / "serve.json").read_text())["url"], model_dir.name
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=120)
        log.close()


def measure(url: str, base_model: str, adapters: int, steps: int) -> dict:
    return run_loop(url, base_model, adapters=adapters, steps=steps, rows=ROWS, tokens=TOKENS, rank=RANK,
                    api_key=KEY)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skyrl-venv", type=Path, default=Path.home() / ".cache" / "podtrain" / "skyrl-venv")
    parser.add_argument("--no-skyrl", action="store_true")
    parser.add_argument("--sample-python", type=Path, default=None,
                        help="a Python whose tinker SDK SkyRL's sampling answers (before 0.26)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--serve", nargs="*", default=[], help="more key=value overrides for podtrain serve")
    args = parser.parse_args(argv)
    results: dict = {"podtrain": {}, "skyrl": {}}
    with tempfile.TemporaryDirectory(prefix="serve-bench-") as tmp:
        model_dir = make_qwen3_dir(Path(tmp) / "qwen3-tiny")
        runs = Path(tmp) / "runs"
        runs.mkdir()
        with podtrain_server(model_dir, runs / "engine-in-process", "cluster.kind=none", *args.serve) as (url, name):
            for adapters in (1, 4, 16):
                results["podtrain"][f"train_{adapters}"] = measure(url, name, adapters, args.steps)
                print(json.dumps({f"podtrain train_{adapters}": results["podtrain"][f"train_{adapters}"]}),
                      file=sys.stderr, flush=True)
            results["podtrain"]["sample"] = sample_loop(url, name, prompts=4, max_tokens=64, rank=RANK, api_key=KEY)
        with podtrain_server(model_dir, runs / "engine-in-ray-worker", *args.serve) as (url, name):
            results["podtrain"]["train_16_local_ray"] = measure(url, name, 16, args.steps)
        if not args.no_skyrl:
            venv = ensure_skyrl_venv(args.skyrl_venv)
            for adapters in (1, 4, 16):
                with skyrl_server(venv, model_dir, free_port(), max_lora_adapters=adapters + 1,
                                  max_lora_rank=RANK) as (url, name):
                    results["skyrl"][f"train_{adapters}"] = measure(url, name, adapters, args.steps)
                print(json.dumps({f"skyrl train_{adapters}": results["skyrl"][f"train_{adapters}"]}),
                      file=sys.stderr, flush=True)
            if args.sample_python is not None:
                with skyrl_server(venv, model_dir, free_port(), max_lora_adapters=2, max_lora_rank=RANK) as server:
                    results["skyrl"]["sample"] = sample_in(args.sample_python, *server, 4, 64, RANK)
    ours, theirs = results["podtrain"], results["skyrl"]
    results["ratios"] = {
        "podtrain_16_over_1": ours["train_16"]["tokens_per_s"] / ours["train_1"]["tokens_per_s"],
        **{f"podtrain_over_skyrl_{n}": ours[f"train_{n}"]["tokens_per_s"] / theirs[f"train_{n}"]["tokens_per_s"]
           for n in (1, 4, 16) if f"train_{n}" in theirs},
    }
    json.dump(results, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
