"""`podtrain goodput <run dir> [--json]`: the breakdown of the run's goodput ledger."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from podtrain.orchestrator.train.goodput import LEDGER, format_summary, read_ledger, summarize, summary_json


def run_command(args: argparse.Namespace) -> int:
    if args.overrides:
        print(f"podtrain: error: goodput takes a run directory and --json, found {' '.join(args.overrides)}",
              file=sys.stderr)
        return 2
    lines = read_ledger(Path(args.run_dir))
    if not lines:
        print(f"podtrain: error: {Path(args.run_dir) / LEDGER}: expected a run directory's goodput ledger, "
              "found none (a run writes it as it trains)", file=sys.stderr)
        return 2
    summary = summarize(lines)
    print(summary_json(summary) if args.json else format_summary(summary))
    return 0
