"""Greedy decoding with the CPU's cores as tensor-parallel devices, against one CPU device.

    PYTHONPATH=. .venv/bin/python bench/generate_tp.py [--tp 2] [--repeats 15]

One XLA:CPU device runs a decode step's matmuls (a few rows against each weight) on one core at
a time. Split into `--tp` CPU devices (`--xla_force_host_platform_device_count`, set here before
JAX starts) with the model sharded over `tp`, each device reads only its share of the weights
and of the kv heads' cache, on its own core, at the price of two all-reduces per layer. This is
what a CPU user gets from `XLA_FLAGS=--xla_force_host_platform_device_count=N` and `mesh.tp=N`.

The model, prompts and timing are `bench/generate.py`'s (batch 4, max_len 128, 64-token prompts,
64 new tokens; decode ms per step = (time(64 new) - time(1 new)) / 63, medians, the two
implementations taking turns), both through the public `generate`. Also printed: whether the
tokens agree, and the collective ops in one compiled decode step of the sharded model.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections import Counter
from pathlib import Path

COLLECTIVE = re.compile(r"\b(all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)(?:-start)?\(")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, default=2, help="CPU devices, one tp shard each (default 2)")
    parser.add_argument("--repeats", type=int, default=15, help="timed runs per implementation (default 15)")
    args = parser.parse_args(argv)
    if args.tp < 2 or args.repeats < 1:
        parser.error(f"expected --tp >= 2 and --repeats >= 1, found {args.tp} and {args.repeats}")
    if "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", ""):
        parser.error("XLA_FLAGS already sets xla_force_host_platform_device_count; leave it to --tp")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Before JAX starts: the device count is read once, when the CPU backend is created.
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={args.tp}"
    if __package__ in (None, ""):
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import contextlib

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from bench.common import format_table, machine_description
    from bench.generate import CONFIG, HEADLINE_BATCH, HEADLINE_MAX_LEN, compare, podtrain_run, random_prompts
    from podtrain.models import Llama
    from podtrain.sharding import DEFAULT_RULES, build_mesh, create_sharded, use_rules

    mesh = build_mesh({"tp": args.tp}, jax.devices()[: args.tp])

    @contextlib.contextmanager
    def on_mesh():
        with jax.set_mesh(mesh), use_rules(DEFAULT_RULES):
            yield

    single = Llama(CONFIG, rngs=nnx.Rngs(0))
    sharded = create_sharded(lambda: Llama(CONFIG, rngs=nnx.Rngs(0)), mesh, DEFAULT_RULES)
    sharded_run = podtrain_run(sharded, HEADLINE_MAX_LEN)

    def tp_run(prompts, new_tokens):
        with on_mesh():
            return sharded_run(prompts, new_tokens)

    prompts = random_prompts(HEADLINE_BATCH, 64)
    rows = compare({"1 device": podtrain_run(single, HEADLINE_MAX_LEN), f"tp={args.tp}": tp_run}, prompts,
                   max_len=HEADLINE_MAX_LEN, new_tokens=64, repeats=args.repeats)
    with on_mesh():
        cache = sharded.init_cache(HEADLINE_BATCH, HEADLINE_MAX_LEN)
        token = jnp.ones((HEADLINE_BATCH, 1), jnp.int32)
        hlo = jax.jit(lambda model, token, cache: model(token, cache=cache)[:2]).lower(sharded, token, cache)
        collectives = Counter(COLLECTIVE.findall(hlo.compile().as_text()))
    print(f"# generate over tp={args.tp} CPU devices, {machine_description()}")
    print(f"batch {HEADLINE_BATCH}, max_len {HEADLINE_MAX_LEN}, 64-token prompts, 64 new tokens, greedy, "
          f"median of {args.repeats} runs each, in turns\n")
    print(format_table(rows, (
        ("implementation", "implementation", "<9"), ("runs", "runs", "d"), ("prefill_ms", "prefill ms", ".1f"),
        ("ms_per_step", "ms / decode step", ".3f"), ("ms_per_token", "ms / token", ".3f"),
        ("same_tokens", "same tokens", "<5"))))
    print(f"\ncollective ops in one compiled decode step's program (tp={args.tp}; the layer scan's body is counted "
          f"once and runs {CONFIG.num_layers} times): "
          + (", ".join(f"{n} {kind}" for kind, n in sorted(collectives.items())) or "none"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
