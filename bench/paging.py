"""What bringing a paged adapter into a device slot costs, from host memory and from disk, and what
writing one out costs, in the serve engine on this machine's devices.

    .venv/bin/python bench/paging.py [-c PRESET] [--repeat N] [key=value ...]

One device slot, two live adapters: each request for the adapter without the slot pages the other
out and it in. With `serve.host_adapters=0` every page goes through the disk.

    .venv/bin/python bench/paging.py --live 4096 [key=value ...]

Keeps that many adapters alive (attention targets, rank 8) on 4 device slots with 16 host pages
and the rest on disk, then trains 64 of them drawn at random one step each: the time of each phase,
the process's peak RSS and the pages' bytes on disk.
"""

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from podtrain.orchestrator.common.platforms import start_jax


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-c", dest="preset", default="llama3-tiny")
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--live", type=int, default=0)
    parser.add_argument("overrides", nargs="*", default=["model.hidden_size=512", "model.num_layers=8",
                                                          "model.intermediate_size=1536", "serve.max_rank=32"])
    args = parser.parse_args()
    start_jax()
    import jax

    from podtrain.orchestrator.config.compose import load_config
    from podtrain.orchestrator.serve.checks import serve_targets
    from podtrain.orchestrator.serve.engine import Engine
    from podtrain.orchestrator.serve.work import Create

    if args.live:
        return keep_alive(args)
    for tier, host in (("host memory", "null"), ("disk", "0")):
        config = load_config(args.preset, [f"serve.base_model={args.preset}", "serve.max_adapters=1",
                                           "serve.max_live_adapters=2", f"serve.host_adapters={host}",
                                           "serve.compile_ahead=false", *args.overrides])
        engine = Engine(config, page_dir=Path(tempfile.mkdtemp()) / "pages")
        targets = serve_targets(config.model.model_type)
        engine.run([Create("a", 32, targets, seed=1), Create("b", 32, targets, seed=2)])
        times = []
        for i in range(args.repeat + 1):
            start = time.perf_counter()
            engine._resident({"ab"[i % 2]})
            engine.pager.settle()
            jax.block_until_ready((engine.adapters, engine.grads, engine.adam))
            times.append(time.perf_counter() - start)
        page = next(iter(engine.pager.host.values()), None)
        size = page.nbytes() if page is not None else sum(
            p.stat().st_size for p in engine.pager.directory.glob("*/*.safetensors"))
        times = times[1:]  # the first compiles the take and put programs
        print(f"{args.preset} {' '.join(args.overrides)}: one adapter of {size / 2**20:.1f} MiB (weights and "
              f"moments) paged out to and in from {tier}: median {statistics.median(times) * 1e3:.1f} ms "
              f"(min {min(times) * 1e3:.1f}, max {max(times) * 1e3:.1f}) over {len(times)}; "
              f"{engine.paging()}", flush=True)


def keep_alive(args) -> None:
    import resource

    import numpy as np

    from podtrain.orchestrator.config.compose import load_config
    from podtrain.orchestrator.serve.engine import Engine
    from podtrain.orchestrator.serve.work import ADAM_KEYS, Create, Datum, ForwardBackward, OptimStep

    overrides = [o for o in args.overrides if not o.startswith("serve.max_rank=")]
    config = load_config(args.preset, [f"serve.base_model={args.preset}", "serve.max_adapters=4", "serve.max_rank=8",
                                       f"serve.max_live_adapters={args.live}", "serve.host_adapters=16",
                                       "serve.max_seq_len=64", "serve.compile_ahead=false", *overrides])
    pages = Path(tempfile.mkdtemp()) / "pages"
    engine = Engine(config, page_dir=pages)
    targets = ("q_proj", "k_proj", "v_proj", "o_proj")
    start = time.perf_counter()
    for i in range(args.live):
        engine.run([Create(f"m{i}", 8, targets, seed=i)])
    created = time.perf_counter() - start
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, config.model.vocab_size, 33)
    datum = Datum(tokens[:-1].astype(np.int64), {"target_tokens": tokens[1:].astype(np.int64),
                                                  "weights": np.ones(32, np.float32)})
    adam = dict.fromkeys(ADAM_KEYS, 0.0) | {"learning_rate": 1e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8}
    chosen = rng.choice(args.live, min(64, args.live), replace=False)
    start = time.perf_counter()
    for i in chosen:
        out = engine.run([ForwardBackward(f"m{i}", (datum,), "cross_entropy"), OptimStep(f"m{i}", adam)])
        assert not any(isinstance(r, Exception) for r in out), out
    trained = time.perf_counter() - start
    disk = sum(p.stat().st_size for p in pages.glob("*/*.safetensors"))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"{args.live} adapters alive ({engine.paging()}): created in {created:.1f} s "
          f"({created / args.live * 1e3:.1f} ms each); {len(chosen)} of them trained a step each in {trained:.1f} s "
          f"({trained / len(chosen) * 1e3:.0f} ms each); peak RSS {rss:.2f} GiB; pages on disk {disk / 2**20:.0f} MiB",
          flush=True)


if __name__ == "__main__":
    main()
