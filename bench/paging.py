"""What bringing a paged adapter into a device slot costs, from host memory and from disk, and what
writing one out costs, in the serve engine on this machine's devices.

    .venv/bin/python bench/paging.py [-c PRESET] [--repeat N] [key=value ...]

One device slot, two live adapters: each request for the adapter without the slot pages the other
out and it in. With `serve.host_adapters=0` every page goes through the disk.
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
    parser.add_argument("overrides", nargs="*", default=["model.hidden_size=512", "model.num_layers=8",
                                                          "model.intermediate_size=1536", "serve.max_rank=32"])
    args = parser.parse_args()
    start_jax()
    import jax

    from podtrain.orchestrator.config.compose import load_config
    from podtrain.orchestrator.serve.checks import serve_targets
    from podtrain.orchestrator.serve.engine import Engine
    from podtrain.orchestrator.serve.work import Create

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


if __name__ == "__main__":
    main()
