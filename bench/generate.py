"""Greedy decoding benchmark: podtrain's `generate` against a per-layer Python-loop baseline.

    PYTHONPATH=. .venv/bin/python bench/generate.py [--quick] [--json] [--batches 1,8,32] [--max-lens 512,4096]

The model (Llama, vocab 4096, hidden 256, ffn 1024, 8 layers, 8 query / 4 KV heads of 32,
float32), 64-token prompts, no stop tokens, so every run makes exactly `--new-tokens` tokens.

- `podtrain`: `models.generate.generate`, prefill and a `lax.while_loop` decode in one jitted
  program over the stacked cache; attention reads only the filled cache entries.
- `baseline`: written here, the naive scheme a public JAX project fell back to: per-layer weights
  in a Python list, one (k, v) cache pair per layer, a jitted step that loops over the layers in
  Python (unrolled in the trace) and attends to all `max_len` slots under a mask, called once per
  token from a Python loop with the caches donated. It makes the same greedy tokens (checked).

A run with n new tokens is prefill + (n - 1) decode steps, so the decode cost per generated token
is (time(n new) - time(1 new)) / ((n - 1) * batch), each time the median of `--repeats` runs
after the compiling calls (the two are run back to back, and the implementations take turns, so
that load drift hits all of them alike).
`prefill ms` is time(1 new): the prompt pass plus the first token. A table cell whose timed runs
pass `--cell-budget-s` stops early (the baseline's biggest cells take the longest); the `runs`
column says how many runs its medians come from.
After the tables: floors for one decode step on this machine (`decode_floors`) and the compiled
decode step's memory figures (`decode_step_memory`).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import format_table, machine_description, time_calls  # noqa: E402
from podtrain.models import Llama, ModelConfig  # noqa: E402
from podtrain.models.generate import generate  # noqa: E402
from podtrain.models.kernels.attention import NEG_INF  # noqa: E402
from podtrain.models.linear import dense  # noqa: E402
from podtrain.models.rope import apply_rope, rope_inv_freq  # noqa: E402

CONFIG = ModelConfig(vocab_size=4096, hidden_size=256, intermediate_size=1024, num_layers=8, num_heads=8,
                     num_kv_heads=4, head_dim=32)
HEADLINE_BATCH, HEADLINE_MAX_LEN = 4, 128

Run = Callable[[np.ndarray, int], np.ndarray]


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    return scale * (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)


def per_layer_weights(model: Llama) -> dict:
    """The model's weights with the stacked layer parameters sliced into a Python list of per-layer dicts."""
    stack = model.layers
    stacked = {
        "input_norm": stack.input_norm.scale, "wq": stack.attn.wq, "wk": stack.attn.wk, "wv": stack.attn.wv,
        "wo": stack.attn.wo, "post_attn_norm": stack.post_attn_norm.scale, "w_gate": stack.mlp.w_gate,
        "w_up": stack.mlp.w_up, "w_down": stack.mlp.w_down,
    }
    layers = [{name: p[...][i] for name, p in stacked.items()} for i in range(model.config.num_layers)]
    return {"embed": model.embed[...], "layers": layers, "final_norm": model.final_norm.scale[...],
            "head": model.head()}


def attend_all_entries(q_BTHD, k_cache_BSKD, v_cache_BSKD, positions_T, scale):
    """GQA of the new tokens to every slot of one layer's cache; slot s holds position s, so slots
    after a token's position (later tokens, or never written) are masked out."""
    b, t, heads, d = q_BTHD.shape
    kv_heads = k_cache_BSKD.shape[2]
    q = (q_BTHD * scale).reshape(b, t, kv_heads, heads // kv_heads, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k_cache_BSKD, preferred_element_type=jnp.float32)
    mask_TS = jnp.arange(k_cache_BSKD.shape[1])[None, :] <= positions_T[:, None]
    probs = jax.nn.softmax(jnp.where(mask_TS, scores, NEG_INF), axis=-1)
    out = jnp.einsum("bkgts,bskd->btkgd", probs.astype(v_cache_BSKD.dtype), v_cache_BSKD)
    return out.reshape(b, t, heads, d)


@partial(jax.jit, static_argnames=("config",), donate_argnames=("caches",))
def baseline_forward(weights: dict, caches: list, ids_BT: jax.Array, start: jax.Array, *, config: ModelConfig):
    """Runs T tokens at positions start.. of every sequence through the layers, one Python
    iteration per layer, writing each layer's new keys and values into its own cache.

    Returns the greedy next token of each sequence (B, 1) and the updated caches.
    """
    b, t = ids_BT.shape
    eps, inv_freq, scale = config.rms_norm_eps, rope_inv_freq(config.head_dim, config.rope), config.head_dim**-0.5
    positions_T = start + jnp.arange(t, dtype=jnp.int32)
    positions_BT = jnp.broadcast_to(positions_T, (b, t))
    zero = jnp.zeros((), jnp.int32)
    h = jnp.take(weights["embed"], ids_BT, axis=0)
    new_caches = []
    for layer, (k_cache, v_cache) in zip(weights["layers"], caches, strict=True):
        x = rms_norm(h, layer["input_norm"], eps)
        q = apply_rope(dense(x, layer["wq"]), positions_BT, inv_freq)
        k = apply_rope(dense(x, layer["wk"]), positions_BT, inv_freq)
        v = dense(x, layer["wv"])
        k_cache = jax.lax.dynamic_update_slice(k_cache, k, (zero, start, zero, zero))
        v_cache = jax.lax.dynamic_update_slice(v_cache, v, (zero, start, zero, zero))
        h = h + dense(attend_all_entries(q, k_cache, v_cache, positions_T, scale), layer["wo"], n_in=2)
        x = rms_norm(h, layer["post_attn_norm"], eps)
        h = h + dense(jax.nn.silu(dense(x, layer["w_gate"])) * dense(x, layer["w_up"]), layer["w_down"])
        new_caches.append((k_cache, v_cache))
    last = rms_norm(h[:, -1], weights["final_norm"], eps)
    token = jnp.argmax((last @ weights["head"]).astype(jnp.float32), axis=-1).astype(jnp.int32)
    return token[:, None], new_caches


def baseline_run(model: Llama, max_len: int) -> Run:
    """`run(prompts (B, P), n)`: the baseline's n greedy tokens after each (unpadded) prompt."""
    weights = per_layer_weights(model)
    c = model.config

    def run(prompts: np.ndarray, max_new_tokens: int) -> np.ndarray:
        batch, prompt_len = prompts.shape
        shape = (batch, max_len, c.num_kv_heads, c.head_dim)
        caches = [(jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.float32)) for _ in range(c.num_layers)]
        token, caches = baseline_forward(weights, caches, jnp.asarray(prompts), np.int32(0), config=c)
        tokens = [token]
        for step in range(max_new_tokens - 1):
            token, caches = baseline_forward(weights, caches, token, np.int32(prompt_len + step), config=c)
            tokens.append(token)
        return np.asarray(jnp.concatenate(tokens, axis=1))

    return run


def podtrain_run(model: Llama, max_len: int) -> Run:
    """`run(prompts (B, P), n)`: `generate`'s n greedy tokens after each prompt, as a user calls it."""
    def run(prompts: np.ndarray, max_new_tokens: int) -> np.ndarray:
        lengths = np.full((prompts.shape[0],), prompts.shape[1], np.int32)
        return np.asarray(generate(model, prompts, lengths=lengths, max_new_tokens=max_new_tokens, max_len=max_len))

    return run


IMPLEMENTATIONS = {"podtrain": podtrain_run, "baseline": baseline_run}


def time_decode(runs: dict[str, Run], prompts: np.ndarray, *, new_tokens: int, repeats: int,
                budget_s: float) -> dict[str, dict]:
    """Per implementation, medians of time(1 new) and time(`new_tokens` new), after compiling calls.

    The implementations take turns (one pair of runs each per round, the pair's two runs back to
    back) so that load drift on this shared machine hits all of them alike. An implementation
    stops after `repeats` pairs, or earlier once its timed pairs took longer than `budget_s` (at
    least one pair).
    """
    for name, run in runs.items():
        run(prompts, 2 if name == "baseline" else new_tokens)  # 2 compiles both of the baseline's programs
        run(prompts, 1)
    times = {name: {1: [], new_tokens: []} for name in runs}
    spent, tokens = dict.fromkeys(runs, 0.0), {}
    for _ in range(repeats):
        for name, run in runs.items():
            if times[name][1] and spent[name] >= budget_s:
                continue
            for n in (1, new_tokens):
                start = time.perf_counter()
                out = run(prompts, n)
                times[name][n].append(time.perf_counter() - start)
                spent[name] += times[name][n][-1]
            tokens[name] = out
    batch, result = prompts.shape[0], {}
    for name in runs:
        prefill_s, full_s = statistics.median(times[name][1]), statistics.median(times[name][new_tokens])
        per_token_ms = 1e3 * (full_s - prefill_s) / ((new_tokens - 1) * batch)
        result[name] = {"batch": batch, "runs": len(times[name][1]), "prefill_ms": 1e3 * prefill_s,
                        "total_ms": 1e3 * full_s, "ms_per_token": per_token_ms, "ms_per_step": per_token_ms * batch,
                        "tokens_per_s": 1e3 / per_token_ms, "tokens": tokens[name]}
    return result


def compare(runs: dict[str, Run], prompts: np.ndarray, *, max_len: int, new_tokens: int, repeats: int,
            budget_s: float = float("inf")) -> list[dict]:
    """`time_decode`'s timings as one row per run; `same_tokens` compares each run's tokens with the first's."""
    timings = time_decode(runs, prompts, new_tokens=new_tokens, repeats=repeats, budget_s=budget_s)
    rows = [{"implementation": name, "max_len": max_len} | timing for name, timing in timings.items()]
    rows[0]["same_tokens"] = "(ref)"
    for row in rows[1:]:
        row["same_tokens"] = "yes" if np.array_equal(row["tokens"], rows[0]["tokens"]) else "NO"
    return rows


def measure(model: Llama, prompts: np.ndarray, *, max_len: int, new_tokens: int, repeats: int,
            budget_s: float = float("inf")) -> list[dict]:
    """One row per implementation for these prompts and cache size; `same_tokens` compares with podtrain's."""
    runs = {name: make_run(model, max_len) for name, make_run in IMPLEMENTATIONS.items()}
    return compare(runs, prompts, max_len=max_len, new_tokens=new_tokens, repeats=repeats, budget_s=budget_s)


def random_prompts(batch: int, prompt_len: int) -> np.ndarray:
    return np.random.default_rng(batch).integers(1, CONFIG.vocab_size, (batch, prompt_len), dtype=np.int32)


def parse_sizes(text: str) -> list[int]:
    return [int(size) for size in text.split(",") if size]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="only the headline (batch 4, max_len 128)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    parser.add_argument("--batches", type=parse_sizes, default=[1, 8, 32], help="table batch sizes (default 1,8,32)")
    parser.add_argument("--max-lens", type=parse_sizes, default=[512, 4096],
                        help="table cache sizes (default 512,4096); the ratio compares the last with the first")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per cell, median taken (default 5)")
    parser.add_argument("--cell-budget-s", type=float, default=45.0,
                        help="table cells stop timing after this many seconds of timed runs, with fewer than "
                             "--repeats runs (shown in `runs`); the headline always makes --repeats (default 45)")
    parser.add_argument("--prompt-len", type=int, default=64, help="prompt tokens (default 64)")
    parser.add_argument("--new-tokens", type=int, default=64, help="generated tokens per run (default 64)")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.new_tokens < 2 or args.prompt_len < 1:
        parser.error(f"expected --repeats >= 1, --new-tokens >= 2 and --prompt-len >= 1, found {args.repeats}, "
                     f"{args.new_tokens} and {args.prompt_len}")
    needed = args.prompt_len + args.new_tokens - 1
    if min(args.max_lens + [HEADLINE_MAX_LEN]) < needed:
        parser.error(f"--max-lens: every cache (and the headline's {HEADLINE_MAX_LEN}) must hold --prompt-len + "
                     f"--new-tokens - 1 = {needed} tokens; found {args.max_lens}")
    return args


def ratio_rows(rows: list[dict], short: int, long: int) -> list[dict]:
    """ms/token at the `long` cache over the `short` one, per implementation and batch."""
    cells = {(r["implementation"], r["batch"], r["max_len"]): r["ms_per_token"] for r in rows}
    return [{"implementation": name, "batch": batch, "short": cells[(name, batch, short)],
             "long": cells[(name, batch, long)], "ratio": cells[(name, batch, long)] / cells[(name, batch, short)]}
            for name, batch, max_len in cells if max_len == short and (name, batch, long) in cells]


def decode_step_memory(model: Llama, batch: int, max_lens: list[int]) -> list[dict]:
    """XLA's figures for one compiled decode step (one token, cache donated) per cache size: the
    cache is updated in place (aliased) and the temporaries do not hold a copy of it."""
    step = jax.jit(lambda m, token, cache: m(token, cache=cache)[:2], donate_argnums=2)
    rows = []
    for max_len in max_lens:
        cache = model.init_cache(batch, max_len)
        compiled = step.lower(model, jnp.zeros((batch, 1), jnp.int32), cache).compile()
        memory, cost = compiled.memory_analysis(), compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        rows.append({"max_len": max_len, "cache_mib": sum(a.nbytes for a in (*cache.k, *cache.v)) / 2**20,
                     "alias_mib": memory.alias_size_in_bytes / 2**20,
                     "temp_mib": memory.temp_size_in_bytes / 2**20, "bytes_mib": cost["bytes accessed"] / 2**20})
    return rows


def time_per_call(fn: Callable, *args, calls: int = 20, repeats: int = 7) -> float:
    """Seconds per call of `fn(*args)`: `calls` calls chained in one jitted loop, best of `repeats`."""
    looped = jax.jit(lambda x, *rest: jax.lax.fori_loop(0, calls, lambda _, x: fn(x, *rest), x))
    looped(*args).block_until_ready()
    return min(time_calls(lambda: looped(*args), repeats).wall) / calls


def decode_floors(model: Llama, batch: int) -> list[dict]:
    """Lower bounds for one decode step on this machine, from the model's own weights and matmuls.

    - `read every weight once`: one pass summing as many bytes as the weights a step uses (layers
      and head, as one flat array): the memory-bandwidth floor, since a decode step must read each
      weight once.
    - `the same, numpy, 2 threads`: the same bytes summed by two threads, a half each (numpy
      releases the GIL): whether both cores together stream faster than XLA's pass.
    - `layer matmuls, weights in cache`: the step's seven matmuls per layer on (batch, hidden) rows,
      `num_layers` times over layer 0's weights (which stay in cache): the time XLA:CPU's dot
      kernels take for the arithmetic alone, with no weight coming from memory.
    - `head matmul, weights in cache`: (batch, hidden) @ (hidden, vocab), repeated.
    """
    weights = per_layer_weights(model)
    layer, c = weights["layers"][0], model.config
    stacked = [p[...] for p in jax.tree.leaves(nnx.state(model.layers, nnx.Param))]
    every_weight = [*stacked, weights["final_norm"], weights["head"]]
    rows_BH = jnp.full((batch, c.hidden_size), 0.01, jnp.float32)

    def read_all(total, flat):  # `+ total` keeps XLA from hoisting the sum out of the timing loop
        return total + jnp.sum(flat + total) * 1e-9

    def layer_matmuls(x, w):
        def one_layer(x, _):
            q, k, v = dense(x, w["wq"]), dense(x, w["wk"]), dense(x, w["wv"])
            x = x + dense(q, w["wo"], n_in=2) + 1e-6 * (k.sum() + v.sum())
            return x + 0.5 * dense(jax.nn.silu(dense(x, w["w_gate"])) * dense(x, w["w_up"]), w["w_down"]), None

        return jax.lax.scan(one_layer, x, None, length=c.num_layers)[0]

    def head_matmul(x, head):
        return x + 1e-6 * jnp.sum(x @ head)

    flat = jnp.concatenate([a.reshape(-1) for a in every_weight])  # one array: the best case for streaming
    read_s = time_per_call(read_all, jnp.zeros((), jnp.float32), flat)
    halves = np.array_split(np.asarray(flat), 2)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        threads_s = min(time_calls(lambda: list(pool.map(np.sum, halves)), 30).wall)
    matmul_s = time_per_call(layer_matmuls, rows_BH, layer)
    head_s = time_per_call(head_matmul, rows_BH, weights["head"])
    mib = sum(a.nbytes for a in every_weight) / 2**20
    return [{"floor": f"read every weight once ({mib:.1f} MiB)", "ms_per_step": read_s * 1e3,
             "gb_per_s": f"{mib * 2**20 / read_s / 1e9:.1f}"},
            {"floor": "the same, numpy, 2 threads", "ms_per_step": threads_s * 1e3,
             "gb_per_s": f"{mib * 2**20 / threads_s / 1e9:.1f}"},
            {"floor": f"layer matmuls, weights in cache ({c.num_layers} x 7)", "ms_per_step": matmul_s * 1e3,
             "gb_per_s": ""},
            {"floor": "head matmul, weights in cache", "ms_per_step": head_s * 1e3, "gb_per_s": ""}]


FLOOR_COLUMNS = (("floor", "per decode step", "<44"), ("ms_per_step", "ms", ".3f"), ("gb_per_s", "GB/s", "<6"))


MEMORY_COLUMNS = (("max_len", "max_len", "d"), ("cache_mib", "KV cache MiB", ".1f"),
                  ("alias_mib", "updated in place (alias) MiB", ".1f"), ("temp_mib", "temporaries MiB", ".2f"),
                  ("bytes_mib", "bytes accessed MiB (scan body once)", ".1f"))
ROW_COLUMNS = (("implementation", "implementation", "<9"), ("batch", "batch", "d"), ("max_len", "max_len", "d"),
               ("runs", "runs", "d"), ("prefill_ms", "prefill ms", ".1f"), ("total_ms", "total ms", ".1f"),
               ("ms_per_step", "ms / decode step", ".3f"), ("ms_per_token", "ms / token", ".3f"),
               ("tokens_per_s", "decode tokens/s", ".0f"), ("same_tokens", "same tokens", "<5"))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    say = (lambda *_: None) if args.json else partial(print, flush=True)
    model = Llama(CONFIG, rngs=nnx.Rngs(0))
    say(f"# generate benchmark, {datetime.date.today()}, {machine_description()}")
    say(f"model: Llama, vocab {CONFIG.vocab_size}, hidden {CONFIG.hidden_size}, ffn {CONFIG.intermediate_size}, "
        f"{CONFIG.num_layers} layers, {CONFIG.num_heads} / {CONFIG.num_kv_heads} heads of {CONFIG.head_dim}, "
        f"{CONFIG.dtype}; prompts {args.prompt_len} tokens, {args.new_tokens} new, greedy, "
        f"median of {3 * args.repeats} runs in the headline, {args.repeats} in the table (fewer once a cell's "
        f"runs pass {args.cell_budget_s:g} s)\n")
    headline = measure(model, random_prompts(HEADLINE_BATCH, args.prompt_len), max_len=HEADLINE_MAX_LEN,
                       new_tokens=args.new_tokens, repeats=3 * args.repeats)
    if any(row["same_tokens"] != "yes" for row in headline[1:]):
        raise RuntimeError("greedy tokens differ from podtrain's on the headline shape: the implementations "
                           "no longer compute the same model")
    say(format_table(headline, ROW_COLUMNS))
    rows, ratios = [], []
    if not args.quick:
        say("\n" + format_table([], ROW_COLUMNS))
        for batch in args.batches:
            prompts = random_prompts(batch, args.prompt_len)
            for max_len in args.max_lens:
                for row in measure(model, prompts, max_len=max_len, new_tokens=args.new_tokens,
                                   repeats=args.repeats, budget_s=args.cell_budget_s):
                    rows.append(row)
                    say(format_table([row], ROW_COLUMNS).splitlines()[-1])
        short_cells = [f"{r['implementation']} {r['batch']} x {r['max_len']}: {r['runs']}" for r in rows
                       if r["runs"] < args.repeats]
        if short_cells:
            say(f"fewer than {args.repeats} runs (the budget of {args.cell_budget_s:g} s per cell): "
                + "; ".join(short_cells))
        short, long = args.max_lens[0], args.max_lens[-1]
        ratios = ratio_rows(rows, short, long)
        say("\n" + format_table(ratios, (
            ("implementation", "implementation", "<9"), ("batch", "batch", "d"),
            ("short", f"ms / token at {short}", ".3f"), ("long", f"ms / token at {long}", ".3f"),
            ("ratio", f"{long} / {short}", ".2f"))))
    floors = decode_floors(model, HEADLINE_BATCH)
    compute_floor = sum(f["ms_per_step"] for f in floors if "matmul" in f["floor"])
    say(f"\nfloors, batch {HEADLINE_BATCH} (each timed alone; podtrain's decode step: "
        f"{headline[0]['ms_per_step']:.3f} ms):\n"
        + format_table(floors, FLOOR_COLUMNS)
        + f"\nmatmuls with every weight already in cache: {compute_floor:.3f} ms per step, "
          f"{compute_floor / HEADLINE_BATCH:.3f} ms per token")
    memory = decode_step_memory(model, HEADLINE_BATCH, sorted({*args.max_lens, HEADLINE_MAX_LEN}))
    say(f"\ncompiled decode step, batch {HEADLINE_BATCH} (XLA memory_analysis / cost_analysis):\n"
        + format_table(memory, MEMORY_COLUMNS))
    if args.json:
        strip = [{k: v for k, v in row.items() if k != "tokens"} for row in headline + rows]
        print(json.dumps({"machine": machine_description(), "rows": strip, "ratios": ratios,
                          "floors": floors, "decode_step_memory": memory},
                         indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
