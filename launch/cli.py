"""`podtrain <command> -c <preset or YAML> [key=value ...]`: parse, dispatch, turn user errors (and a checkpoint
that cannot be written) into one line."""

from __future__ import annotations

import argparse
import sys

# Each command is the module `podtrain.launch.<command>`, with its `run_command(args)`.
COMMANDS = {
    "train": "train on the configured cluster (cluster.kind), resuming from the last checkpoint",
    "submit": "submit `podtrain train` as a Ray job (--address http://HEAD:8265)",
    "plan": "show the resolved config, mesh, sharding, FLOPs and compiled memory; no training",
    "export": "write a checkpoint's weights as HF safetensors (checkpoint=<dir> out=<dir> [step=N])",
    "generate": "continue prompts with a checkpoint or HF model (checkpoint=<dir> prompt=<text> "
                "[max_new_tokens=N] [temperature=T] [top_k=K] [top_p=P])",
    "check": "build the model sharded over the devices and run train steps on random tokens",
    "serve": "serve the Tinker training API: many LoRA adapters on one base model (serve.port=8000 ...)",
    "goodput": "where a run's wall-clock time went, per attempt and in total (podtrain goodput <run dir>)",
    "status": "how a cluster job's attempts ended and what each failure cost (podtrain status <run dir>)",
}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="podtrain", description="Train LLMs on TPU pod slices and GPU nodes.")
    sub = p.add_subparsers(dest="command", required=True, metavar="command")
    for name, help_text in COMMANDS.items():
        cmd = sub.add_parser(name, help=help_text, description=help_text)
        if name in ("goodput", "status"):
            cmd.add_argument("run_dir", help="a run directory (<run.dir>/<run.name>)")
            cmd.add_argument("--json", action="store_true", help="print one JSON object")
            continue
        cmd.add_argument("-c", "--config", default="llama3-tiny", help="preset name in configs/ or a YAML path")
        cmd.add_argument("--cpu-devices", type=int, default=None,
                         help="simulate this many CPU devices (sets jax_num_cpu_devices before JAX starts)")
        cmd.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
        if name == "plan":
            cmd.add_argument("--json", action="store_true", help="print one JSON object")
            cmd.add_argument("--no-compile", action="store_true", help="skip compiling the train step")
            cmd.add_argument("--target", default=None,
                             help="compile for this TPU slice or these GPU nodes instead of this machine's devices "
                                  "(e.g. v5p-128, 2xv5p-64, v6e-256, h100x8, 4xh100x8; needs podtrain[aot])")
            cmd.add_argument("--serve", action="store_true",
                             help="plan `podtrain serve` of this config (-c as for serve) on --target: per-chip "
                                  "memory of its programs and how many adapters of serve.max_rank fit")
        if name == "check":
            cmd.add_argument("--steps", type=int, default=2, help="train steps to run")
        if name == "submit":
            from podtrain.launch.submit import add_arguments

            add_arguments(cmd)
    return p


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The command line; overrides may also come after options (`a=1 --cpu-devices 2 b=2`), which
    argparse alone takes for unrecognised arguments."""
    p = parser()
    args, extra = p.parse_known_args(argv)
    unknown = [arg for arg in extra if arg.startswith("-") or "=" not in arg]
    if unknown:
        p.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.overrides = [*getattr(args, "overrides", []), *extra]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    import importlib

    from podtrain.orchestrator.common.errors import ConfigError
    from podtrain.orchestrator.common.platforms import start_jax

    if args.command in ("goodput", "status"):  # they read a file: no JAX
        module = importlib.import_module(f"podtrain.launch.{args.command}")
        return module.run_command(args)
    if args.cpu_devices is not None and args.cpu_devices < 1:
        print(f"podtrain: error: --cpu-devices: expected a positive number of devices, found {args.cpu_devices}",
              file=sys.stderr)
        return 2
    start_jax(compile_only=bool(getattr(args, "target", None)))
    if args.cpu_devices:
        import jax

        jax.config.update("jax_num_cpu_devices", args.cpu_devices)
    module = importlib.import_module(f"podtrain.launch.{args.command}")
    try:
        return module.run_command(args)
    except ConfigError as e:
        print(f"podtrain: error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        # imported here: Orbax is slow to import
        from podtrain.orchestrator.checkpoint.checkpointer import CheckpointWriteError

        if not isinstance(e, CheckpointWriteError):
            raise
        print(f"podtrain: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
