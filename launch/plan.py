"""`podtrain plan`: the plan of a run, as text or one JSON object; with `--target`, the train step
compiled for that TPU slice or those GPU nodes (exit code 1 when it does not fit); with `--serve`
and `--target`, the `podtrain serve` engine's programs and how many adapters fit."""

from __future__ import annotations

import json

from podtrain.orchestrator.config.compose import load_config
from podtrain.orchestrator.plan.report import format_plan, format_target, make_plan
from podtrain.orchestrator.train.build import build_training


def run_command(args) -> int:
    if args.serve:
        return _serve(args)
    config = load_config(args.config, args.overrides)
    if not args.target:
        plan = make_plan(build_training(config), compile_step=not args.no_compile)
        print(json.dumps(plan) if args.json else format_plan(plan))
        return 0
    from podtrain.orchestrator.plan.on_target import check
    from podtrain.orchestrator.plan.targets import compile_devices, parse_target

    target = parse_target(args.target)
    devices = compile_devices(target)
    plan = make_plan(build_training(config, devices), compile_step=False)
    plan["target"] = check(config, target, devices=devices)
    print(json.dumps(plan) if args.json else format_plan(plan) + "\n\n" + format_target(plan["target"]))
    return 0 if plan["target"]["fits"] else 1


def _serve(args) -> int:
    """The serve engine compiled for `--target`, and how many adapters fit (exit code 1 when the
    configured count does not)."""
    from podtrain.launch.serve import serve_config
    from podtrain.orchestrator.common.errors import ConfigError
    from podtrain.orchestrator.plan.serve_plan import adapters_that_fit, format_serve, plan_serve_on_target
    from podtrain.orchestrator.plan.targets import compile_devices, parse_target

    if not args.target:
        raise ConfigError("--serve: expected --target (a TPU slice or GPU nodes, e.g. v5p-16 or h100x8)")
    config, _ = serve_config(args.config, args.overrides)
    target = parse_target(args.target)
    devices = compile_devices(target)
    report = plan_serve_on_target(config, target, devices)
    if config.plan.max_fit_compiles:
        report["adapters_that_fit"] = adapters_that_fit(config, target, devices, report=report,
                                                        max_compiles=config.plan.max_fit_compiles)
    print(json.dumps(report) if args.json else format_serve(report))
    return 0 if report["fits"] else 1
