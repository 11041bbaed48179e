"""`podtrain plan`: the plan of a run, as text or one JSON object; with `--target`, the train step
compiled for that TPU slice or those GPU nodes (exit code 1 when it does not fit)."""

from __future__ import annotations

import json

from podtrain.orchestrator.config.compose import load_config
from podtrain.orchestrator.plan.report import format_plan, format_target, make_plan
from podtrain.orchestrator.train.build import build_training


def run_command(args) -> int:
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
