"""`podtrain serve` against SkyRL's Tinker server on the same model and the same client loop.

    PYTHONPATH=. .venv/bin/python bench/serve.py [--models tiny mid] [--reps 3] [--warmup 3] [--steps 20]

Both serve a random Qwen3 (`bench/skyrl.py MODEL_SIZES`: tiny, 2 layers of hidden 64; mid, 8 of
hidden 512; vocab 512) with rank-8 adapters; `bench/serve_loop.py` drives them with the `tinker`
SDK: forward_backward + optim_step of 16 rows x 128 tokens per step, split among 1, 4 or 16
adapters (the same tokens per step). Every adapter count gets a fresh server of each kind, sized
to it, the same warm-up steps, then the timed steps; the repetitions alternate which server goes
first. podtrain also runs 16 live adapters on 4 device slots (paging). podtrain runs its engine
in the service's process (`cluster.kind=none`); `--ray` adds 16 adapters with the engine in a local
Ray job's worker. SkyRL runs when its virtualenv can be made (`bench/skyrl.py`); sampling (tiny
model) needs an SDK before 0.26 for SkyRL (`--sample-python`). Prints one JSON object: every
run's step times, medians and spread, and the ratios of the medians of the repetitions.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.serve_loop import run_loop, sample_loop  # noqa: E402
from bench.skyrl import (  # noqa: E402
    MODEL_SIZES,
    ensure_skyrl_venv,
    free_port,
    make_qwen3_dir,
    sample_in,
    skyrl_server,
)

RANK, ROWS, TOKENS = 8, 16, 128
KEY = "tml-bench"
PAGED = 16  # live adapters on 4 device slots


@contextlib.contextmanager
def podtrain_server(model_dir: Path, run_dir: Path, *extra: str) -> Iterator[tuple[str, str]]:
    """`podtrain serve -c model_dir` until the block ends; yields (URL, base model name)."""
    command = [sys.executable, "-m", "podtrain.launch.cli", "serve", "-c", str(model_dir), "serve.port=0",
               f"serve.max_rank={RANK}", "serve.max_seq_len=256", f"serve.max_rows={ROWS}",
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


def podtrain_runs(ray: bool) -> dict[str, tuple[int, list[str]]]:
    """name -> (adapters, overrides) of each podtrain run: one device slot per adapter, paging, Ray."""
    runs = {f"train_{n}": (n, ["cluster.kind=none", f"serve.max_adapters={n}"]) for n in (1, 4, 16)}
    runs[f"paged_{PAGED}_on_4"] = (PAGED, ["cluster.kind=none", "serve.max_adapters=4",
                                           f"serve.max_live_adapters={PAGED}"])
    if ray:
        runs["train_16_local_ray"] = (16, ["serve.max_adapters=16"])
    return runs


def summary(runs: list[dict]) -> dict:
    """The repetitions of one run: each one's tokens/s at its median step, their median and range."""
    rates = [run["tokens_per_s"] for run in runs]
    return {"tokens_per_s": statistics.median(rates), "tokens_per_s_reps": rates,
            "median_step_s_reps": [run["median_s"] for run in runs],
            "first_step_s_reps": [run["first_step_s"] for run in runs]}


def bench_model(size: str, tmp: Path, args: argparse.Namespace, venv: Path | None) -> dict:
    """Every run on model `size`, `args.reps` times, the two servers taking turns to go first."""
    model_dir = make_qwen3_dir(tmp / f"qwen3-{size}", size)
    runs = tmp / f"runs-{size}"
    runs.mkdir()
    raw: dict = {"podtrain": {}, "skyrl": {}}

    def record(server: str, name: str, rep: int, url_name: tuple[str, str], adapters: int) -> None:
        result = run_loop(*url_name, adapters=adapters, steps=args.steps, warmup=args.warmup, rows=ROWS,
                          tokens=TOKENS, rank=RANK, api_key=KEY)
        raw[server].setdefault(name, []).append(result)
        print(json.dumps({f"{size} {server} {name} rep {rep}": result}), file=sys.stderr, flush=True)

    def podtrain(rep: int) -> None:
        for name, (adapters, overrides) in podtrain_runs(args.ray).items():
            with podtrain_server(model_dir, runs / f"{name}-{rep}", *overrides, *args.serve) as server:
                record("podtrain", name, rep, server, adapters)

    def skyrl(rep: int) -> None:
        for adapters in (1, 4, 16):
            # Slot 0 is SkyRL's base model, so `adapters` clients need one slot more.
            with skyrl_server(venv, model_dir, free_port(), max_lora_adapters=adapters + 1,
                              max_lora_rank=RANK) as server:
                record("skyrl", f"train_{adapters}", rep, server, adapters)

    for rep in range(args.reps):
        for run in [podtrain] if venv is None else [podtrain, skyrl] if rep % 2 == 0 else [skyrl, podtrain]:
            run(rep)
    if size == "tiny":
        with podtrain_server(model_dir, runs / "sample", "cluster.kind=none", "serve.max_adapters=2",
                             *args.serve) as (url, name):
            raw["podtrain"]["sample"] = sample_loop(url, name, prompts=4, max_tokens=64, rank=RANK, api_key=KEY)
        if venv is not None and args.sample_python is not None:
            with skyrl_server(venv, model_dir, free_port(), max_lora_adapters=2, max_lora_rank=RANK) as server:
                raw["skyrl"]["sample"] = sample_in(args.sample_python, *server, 4, 64, RANK)
    ours = {name: summary(reps) for name, reps in raw["podtrain"].items() if name != "sample"}
    theirs = {name: summary(reps) for name, reps in raw["skyrl"].items() if name != "sample"}
    rate = {name: run["tokens_per_s"] for name, run in ours.items()}
    ratios = {"podtrain_16_over_1": rate["train_16"] / rate["train_1"],
              f"podtrain_paged_{PAGED}_on_4_over_1": rate[f"paged_{PAGED}_on_4"] / rate["train_1"]}
    ratios |= {f"podtrain_over_skyrl_{n}": rate[f"train_{n}"] / theirs[f"train_{n}"]["tokens_per_s"]
               for n in (1, 4, 16) if f"train_{n}" in theirs}
    print(json.dumps({size: {"podtrain": ours, "skyrl": theirs, "ratios": ratios}}), file=sys.stderr, flush=True)
    return {"podtrain": ours, "skyrl": theirs, "ratios": ratios, "runs": raw}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skyrl-venv", type=Path, default=Path.home() / ".cache" / "podtrain" / "skyrl-venv")
    parser.add_argument("--no-skyrl", action="store_true")
    parser.add_argument("--sample-python", type=Path, default=None,
                        help="a Python whose tinker SDK SkyRL's sampling answers (before 0.26)")
    parser.add_argument("--models", nargs="+", default=["tiny", "mid"], choices=sorted(MODEL_SIZES))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--ray", action="store_true", help="also 16 adapters with the engine in a Ray worker")
    parser.add_argument("--serve", nargs="*", default=[], help="more key=value overrides for podtrain serve")
    args = parser.parse_args(argv)
    venv = None if args.no_skyrl else ensure_skyrl_venv(args.skyrl_venv)
    results: dict = {"args": {key: str(value) for key, value in vars(args).items()}}
    with tempfile.TemporaryDirectory(prefix="serve-bench-") as tmp:
        for size in args.models:
            results[size] = bench_model(size, Path(tmp), args, venv)
    json.dump(results, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
