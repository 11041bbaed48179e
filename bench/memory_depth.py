"""Train-step temp memory against depth with `full` remat, at growing sequence lengths.

    PYTHONPATH=. .venv/bin/python bench/memory_depth.py [--json]      # about 2 minutes, compiles only

For llama3-tiny's model on one device: XLA temp bytes (`memory_analysis()`) of the whole train step
(forward, loss, backward, clipping, AdamW) with `full` remat at 8 and 32 layers and with no remat at
32, per batch x seq. Per layer, full remat adds its saved input (batch x seq x hidden) and the
layer's gradients; one layer's recomputed activations, the attention probabilities and the logits
do not grow with depth but do with the sequence, so the growth from 8 to 32 layers falls as the
sequence grows. Nothing is allocated: the programs are compiled, not run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import PRESET, compile_stats, format_table, machine_description, table_row
from podtrain.orchestrator.config.compose import load_config

# (batch, seq): the benchmark shape first.
SHAPES = ((8, 256), (8, 1024), (8, 2048), (2, 4096))
GROWTH_TARGET = 0.25
COLUMNS = [
    ("shape", "batch x seq", "<10"), ("full_8", "full, 8 layers MiB", ".1f"), ("full_32", "full, 32 layers MiB", ".1f"),
    ("growth", "growth 8 -> 32", ".1%"), ("none_32", "none, 32 layers MiB", ".1f"),
    ("ratio", "full / none at 32", ".3f"),
]


def temp_mib(batch: int, seq: int, layers: int, remat: str) -> float:
    overrides = [f"train.batch_size={batch}", f"train.seq_len={seq}", f"model.num_layers={layers}",
                 f"model.remat={remat}", f"model.max_position_embeddings={max(seq, 2048)}"]
    return compile_stats(load_config(PRESET, overrides), num_devices=1)["temp_mib"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = parser.parse_args(argv)
    rows = []
    if not args.json:
        print(format_table([], COLUMNS), flush=True)
    for batch, seq in SHAPES:
        full_8, full_32, none_32 = (temp_mib(batch, seq, 8, "full"), temp_mib(batch, seq, 32, "full"),
                                    temp_mib(batch, seq, 32, "none"))
        rows.append({"shape": f"{batch} x {seq}", "full_8": full_8, "full_32": full_32,
                     "growth": full_32 / full_8 - 1, "none_32": none_32, "ratio": full_32 / none_32})
        if not args.json:
            print(table_row(rows[-1], COLUMNS), flush=True)
    if args.json:
        print(json.dumps({"machine": machine_description(), "rows": rows}))
    else:
        met = [r["shape"] for r in rows if r["growth"] <= GROWTH_TARGET and r["ratio"] <= 0.25]
        print(f"\ngrowth <= {GROWTH_TARGET:.0%} and full <= 1/4 of none at 32 layers: {', '.join(met) or 'none'}")


if __name__ == "__main__":
    main()
