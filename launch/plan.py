"""`podtrain plan`: the plan of a run, as text or one JSON object."""

from __future__ import annotations

import json

from podtrain.orchestrator.build import build_training
from podtrain.orchestrator.config import load_config
from podtrain.orchestrator.plan import format_plan, make_plan


def run_command(args) -> int:
    config = load_config(args.config, args.overrides)
    plan = make_plan(build_training(config), compile_step=not args.no_compile)
    print(json.dumps(plan) if args.json else format_plan(plan))
    return 0
