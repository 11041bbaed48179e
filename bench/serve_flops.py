"""The compiled FLOPs and collective bytes per token of the serve engine's training pass with 1 and
16 adapter slots (the adapter axis must not multiply the base's work), the Adam step's collective
bytes, and what one slot's state (adapter, gradient, moments) costs each chip. Needs podtrain[aot].

    PYTHONPATH=. .venv/bin/python bench/serve_flops.py [-c PRESET] [--target TARGET] [key=value ...]

Defaults: llama3-tiny on v5p-8 at rank 32, 16 rows x 256 tokens.
"""

import argparse

from podtrain.orchestrator.common.platforms import start_jax


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-c", dest="preset", default="llama3-tiny")
    parser.add_argument("--target", default="v5p-8")
    parser.add_argument("overrides", nargs="*", default=["serve.max_rank=32", "serve.max_seq_len=256",
                                                         "serve.max_rows=16"])
    args = parser.parse_args()
    start_jax(compile_only=True)
    from podtrain.launch.serve import serve_config
    from podtrain.orchestrator.plan.serve_plan import plan_serve_on_target
    from podtrain.orchestrator.plan.targets import compile_devices, parse_target
    from podtrain.orchestrator.serve.programs import ADAM_CHUNK

    target = parse_target(args.target)
    devices = compile_devices(target)
    flops, sent = {}, {}
    for slots in (1, 16):
        config, _ = serve_config(args.preset, [f"serve.max_adapters={slots}", *args.overrides])
        report = plan_serve_on_target(config, target, devices, programs=("forward_backward", "adam_steps"))
        flops[slots] = report["programs"]["forward_backward"]["flops_per_token"]
        sent[slots] = report["programs"]["forward_backward"]["collective_bytes_per_token"]
        state = (2 * report["adapters_bytes"] + report["adam_bytes"]) / slots
        print(f"{slots:>2} adapter slots: {flops[slots]:,.0f} FLOPs and {sent[slots]:,.0f} collective bytes per token "
              f"(mesh {report['mesh']}); one Adam program (up to {ADAM_CHUNK} slots): "
              f"{report['programs']['adam_steps']['collective_bytes']:,.0f} collective bytes; "
              f"per slot per chip: {state / 2**20:,.1f} MiB", flush=True)
    print(f"16 / 1: FLOPs {flops[16] / flops[1]:.4f}, collective bytes {sent[16] / sent[1]:.4f}")


if __name__ == "__main__":
    main()
