"""What one adapter slot's state (its A and B, pending gradient and two Adam moments) costs each
chip, and each host to keep paged, for the serve engine's layout of a preset on a target; laid out
only, nothing compiled or allocated. Needs podtrain[aot].

    .venv/bin/python bench/serve_state.py [PRESET:TARGET ...] [--rank R]

Defaults: qwen3-8b:v5p-16, llama3-70b:v5p-128, deepseek-v3-671b:v5p-256 at rank 32.
"""

import argparse

from podtrain.orchestrator.common.platforms import start_jax


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("pairs", nargs="*", default=["qwen3-8b:v5p-16", "llama3-70b:v5p-128",
                                                     "deepseek-v3-671b:v5p-256"])
    parser.add_argument("--rank", type=int, default=32)
    args = parser.parse_args()
    start_jax(compile_only=True)
    import jax

    from podtrain.launch.serve import serve_config
    from podtrain.orchestrator.plan.host_memory import distinct_bytes_per_host
    from podtrain.orchestrator.plan.on_target import shard_bytes
    from podtrain.orchestrator.plan.targets import compile_devices, parse_target
    from podtrain.orchestrator.serve.layout import engine_layout

    slots = 8
    for pair in args.pairs:
        preset, name = pair.split(":")
        target = parse_target(name)
        config, _ = serve_config(preset, [f"serve.max_adapters={slots}", f"serve.max_rank={args.rank}"])
        layout = engine_layout(config, compile_devices(target))
        adapters, adam = jax.tree.leaves(layout.adapters), jax.tree.leaves(layout.adam())
        chip = (2 * shard_bytes(adapters) + shard_bytes(adam)) / slots
        whole = 4 * sum(x.size * x.dtype.itemsize for x in adapters) / slots
        page = max(distinct_bytes_per_host([*adapters, *[x for x in adam if x.ndim]]).values()) / slots
        print(f"{preset} on {name} (mesh {dict((k, v) for k, v in layout.mesh.shape.items() if v > 1)}), rank "
              f"{args.rank}: a slot's adapter, gradient and moments {whole / 2**20:,.1f} MiB whole, "
              f"{chip / 2**20:,.1f} MiB per chip; a page (weights and moments) {page / 2**20:,.1f} MiB per host",
              flush=True)


if __name__ == "__main__":
    main()
