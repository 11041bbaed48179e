"""Chat SFT with and without packing: trained tokens per second and the share of padding.

    PYTHONPATH=. .venv/bin/python bench/chat_sft.py [--steps N] [--json]

A synthetic chat corpus (user turns and answers of random lengths, as in instruction data: most
conversations far shorter than a row) trains llama3-tiny at the benchmark shape through
`orchestrator.train.loop.run`, once with `data.packing=true` (conversations packed whole into
rows, first fit) and once with `data.packing=false` (one conversation a row). For each: the share
of padding positions in the batches, step time and all positions per second (from
`metrics.jsonl`, the first step left out), and trained (assistant) tokens per second, the number
that decides how fast SFT learns.
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import BENCH_SHAPE, format_table, machine_description
from podtrain.orchestrator.config.compose import load_config
from podtrain.orchestrator.data.pipeline import make_dataset
from podtrain.orchestrator.data.tokenizers import ByteTokenizer
from podtrain.orchestrator.train.loop import run

TEMPLATE = ("{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] + '<|end|>' }}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def write_corpus(directory: Path, conversations: int = 4000) -> list[str]:
    rng = random.Random(0)
    words = ["the", "of", "and", "to", "in", "is", "that", "it", "for", "on", "with", "as", "was", "by", "at"]

    def text(low, high):
        return " ".join(rng.choices(words, k=rng.randint(low, high)))

    rows = [{"messages": [{"role": "user", "content": text(2, 16)}, {"role": "assistant", "content": text(1, 12)}]}
            for _ in range(conversations)]
    (directory / "chat.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (directory / "chat.jinja").write_text(TEMPLATE)
    return ["data.source=chat", f"data.path={directory / 'chat.jsonl'}",
            f"data.chat_template={directory / 'chat.jinja'}", "data.eval_fraction=0"]


def padding_share(config, batches: int = 20) -> float:
    dataset = iter(make_dataset(config.data, ByteTokenizer(), seq_len=config.train.seq_len,
                                global_batch=config.train.batch_size))
    padded = total = 0
    for _ in range(batches):
        batch = next(dataset)
        padded += int((batch["segment_ids"] == 0).sum())
        total += batch["segment_ids"].size
    return padded / total


def measure(directory: Path, data: list[str], packing: bool, steps: int) -> dict:
    config = load_config("llama3-tiny", [*BENCH_SHAPE, *data, f"data.packing={str(packing).lower()}",
                                         f"train.steps={steps}", "train.eval_every=0",
                                         f"checkpoint.every_steps={steps * 10}", "metrics.trackers=[jsonl]"])
    run_dir = directory / f"packing-{packing}"
    run(config, run_dir)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][1:]
    step_s = sum(r["step_s"] for r in records)
    return {"packing": packing, "padding": padding_share(config),
            "step_s": statistics.median(r["step_s"] for r in records),
            "tokens_per_s": sum(config.train.batch_size * config.train.seq_len for _ in records) / step_s,
            "trained_tokens_per_s": sum(r["loss_tokens"] for r in records) / step_s,
            "trained_per_step": statistics.mean(r["loss_tokens"] for r in records)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        data = write_corpus(Path(tmp))
        rows = [measure(Path(tmp), data, packing, args.steps) for packing in (True, False)]
    result = {"date": datetime.date.today().isoformat(), "machine": machine_description(), "steps": args.steps,
              "shape": BENCH_SHAPE, "rows": rows,
              "speedup_trained_tokens": rows[0]["trained_tokens_per_s"] / rows[1]["trained_tokens_per_s"]}
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(format_table(rows, [("packing", "packing", ""), ("padding", "padding share", ".1%"),
                              ("step_s", "median step s", ".3f"), ("tokens_per_s", "positions/s", ",.0f"),
                              ("trained_per_step", "trained tokens/step", ",.0f"),
                              ("trained_tokens_per_s", "trained tokens/s", ",.0f")]))
    print(f"packing trains {result['speedup_trained_tokens']:.2f}x the assistant tokens per second "
          f"({args.steps} steps, {' '.join(BENCH_SHAPE)}, {result['machine']['cpus']} CPUs, "
          f"load {result['machine']['load_average_1m']:.1f})")


if __name__ == "__main__":
    main()
