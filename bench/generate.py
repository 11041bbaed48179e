"""Greedy decoding benchmark: podtrain's `generate` against a per-layer Python-loop baseline.

    PYTHONPATH=. .venv/bin/python bench/generate.py [--quick] [--json] [--batches 1,8,32] [--max-lens 512,4096]
        [--reads-shapes 4x128,32x4096]

The issue's model (Llama, vocab 4096, hidden 256, ffn 1024, 8 layers, 8 query / 4 KV heads of
32, float32), 64-token prompts, no stop tokens, so every run makes exactly `--new-tokens` tokens.

- `podtrain`: `models.generate.generate`, prefill and a `lax.while_loop` decode in one jitted
  program over the stacked cache; attention reads only the filled cache slots (on CPU its decode
  steps do so in a C++ kernel, `cache_reads=kernel`, and multiply by the weights in another,
  `decode_matmuls=kernel`, the defaults there).
- `xla`: the same with the decode steps' attention and matmuls in XLA (`cache_reads=filled`: a
  loop over the filled blocks; `decode_matmuls=xla`); `stacked`: that, with each layer's weights
  sliced from the stacked arrays (`layer_weights=stacked`, as on TPU) instead of per-layer copies.
- `baseline`: written here, the naive scheme a public JAX project fell back to: per-layer weights
  in a Python list, one (k, v) cache pair per layer, a jitted step that loops over the layers in
  Python (unrolled in the trace) and attends to all `max_len` slots under a mask, called once per
  token from a Python loop with the caches donated. It makes the same greedy tokens (checked).

A run with n new tokens is prefill + (n - 1) decode steps, so the decode cost per generated token
is (time(n new) - time(1 new)) / ((n - 1) * batch), each time the median of `--repeats` runs
after the compiling calls (the two are run back to back, and the implementations take turns, so
that load drift hits all of them alike).
`prefill ms` is time(1 new): the prompt pass plus the first token. A table cell whose timed runs
pass `--cell-budget-s` stops early (the baseline at batch 32 x 4096 takes 40-60 s a run on 2 cores);
the `runs` column says how many runs its medians come from.
After the tables: floors for one decode step on this machine (`decode_floors`), where podtrain's
decode step goes (`decode_parts`: the step as is, with its attention reduced to reading the cache
blocks and the two products, to the block reads alone, and left out), with `--reads-shapes`
decode steps reading the cache with each `cache_reads` (`reads_stand_in`), and
the compiled decode step's memory figures.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
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
from podtrain.models import Llama, ModelConfig, kernels  # noqa: E402
from podtrain.models import layers as model_layers  # noqa: E402
from podtrain.models.generate import (  # noqa: E402
    Sampling,
    auto_cache_reads,
    auto_decode_matmuls,
    auto_layer_weights,
    generate,
)
from podtrain.models.kv_cache import CACHE_READS  # noqa: E402
from podtrain.models.layers import NEG_INF, apply_rope, dense, rope_inv_freq  # noqa: E402
from podtrain.models.runner import split_stack  # noqa: E402

CONFIG = ModelConfig(vocab_size=4096, hidden_size=256, intermediate_size=1024, num_layers=8, num_heads=8,
                     num_kv_heads=4, head_dim=32)
HEADLINE_BATCH, HEADLINE_MAX_LEN = 4, 128
TARGET_MS_PER_TOKEN = 0.5

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


def attend_all_slots(q_BTHD, k_cache_BSKD, v_cache_BSKD, positions_T, scale):
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
        h = h + dense(attend_all_slots(q, k_cache, v_cache, positions_T, scale), layer["wo"], n_in=2)
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


def podtrain_run(model: Llama, max_len: int, layer_weights: str = "auto", cache_reads: str = "auto",
                 decode_matmuls: str = "auto") -> Run:
    def run(prompts: np.ndarray, max_new_tokens: int) -> np.ndarray:
        lengths = np.full((prompts.shape[0],), prompts.shape[1], np.int32)
        return np.asarray(generate(model, prompts, lengths=lengths, max_new_tokens=max_new_tokens, max_len=max_len,
                                   layer_weights=layer_weights, cache_reads=cache_reads,
                                   decode_matmuls=decode_matmuls))

    return run


# "podtrain" is `generate` as called (on CPU its decode steps read per-layer weight copies, and
# attend to the cache and multiply by the weights in the C++ kernels); "xla" the same with the
# attention and the matmuls in XLA (`cache_reads="filled"`, the block loop, `decode_matmuls="xla"`,
# as on TPU); "stacked" that with the weights sliced from the stacks as well
# (`layer_weights="stacked"`, as on TPU).
IMPLEMENTATIONS = {"podtrain": podtrain_run,
                   "xla": partial(podtrain_run, cache_reads="filled", decode_matmuls="xla"),
                   "stacked": partial(podtrain_run, layer_weights="stacked", cache_reads="filled",
                                      decode_matmuls="xla"),
                   "baseline": baseline_run}


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


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """"4x128,32x4096" -> [(4, 128), (32, 4096)] (batch x max_len)."""
    shapes = [shape.split("x") for shape in text.split(",") if shape]
    if not all(len(shape) == 2 and all(n.isdigit() for n in shape) for shape in shapes):
        raise argparse.ArgumentTypeError(f"expected batch x max_len pairs such as 4x128,32x4096, found {text!r}")
    return [(int(batch), int(max_len)) for batch, max_len in shapes]


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
    parser.add_argument("--reads-shapes", type=parse_shapes, default=[],
                        help="also time decode steps with cache_reads=filled and =all at these batch x max_len "
                             "shapes (e.g. 4x128,16x4096,32x4096)")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.new_tokens < 2 or args.prompt_len < 1:
        parser.error(f"expected --repeats >= 1, --new-tokens >= 2 and --prompt-len >= 1, found {args.repeats}, "
                     f"{args.new_tokens} and {args.prompt_len}")
    needed = args.prompt_len + args.new_tokens - 1
    if min(args.max_lens + [HEADLINE_MAX_LEN] + [m for _, m in args.reads_shapes]) < needed:
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
    """XLA's figures for one compiled decode step (one token, cache donated) per cache size, layer
    weights (sliced from the stacks, or the per-layer copies `generate` makes on CPU, passed in)
    and cache reads (the block loop, or the C++ kernel): the cache is updated in place (aliased)
    and the temporaries do not hold a copy of it."""
    step = jax.jit(lambda m, token, cache, states: m(token, kv_cache=cache, layer_states=states), donate_argnums=2)
    rows = []
    for weights, reads in (("stacked", "filled"), ("split", "filled"), ("split", "kernel")):
        states = [split_stack(stack) for stack in model.stacks()] if weights == "split" else None
        for max_len in max_lens:
            cache = model.init_cache(batch, max_len, reads=reads)
            compiled = step.lower(model, jnp.zeros((batch, 1), jnp.int32), cache, states).compile()
            memory, cost = compiled.memory_analysis(), compiled.cost_analysis()
            cost = cost[0] if isinstance(cost, list) else cost
            rows.append({"weights": weights, "reads": reads, "max_len": max_len,
                         "cache_mib": sum(a.nbytes for a in (*cache.k, *cache.v)) / 2**20,
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
      `num_layers` times over layer 0's weights (3.8 MiB, they stay in cache): the time XLA:CPU's
      dot kernels take for the arithmetic alone, with no weight coming from memory.
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


def _new_token_values(queries, new_values):
    """The new token's own values repeated over each kv head's query heads: (B, 1, H, E)."""
    return jnp.repeat(new_values, queries[0].shape[2] // new_values.shape[2], axis=2)


def _first_blocks(key_caches, value_cache, layer, block):
    """Layer `layer`'s first `block` slots of its key and value caches, each (B, block, K, D)."""
    def read(cache):
        return jax.lax.dynamic_index_in_dim(cache, layer, 0, keepdims=False)[:, :block]
    return read(key_caches[0]), read(value_cache)


def _left_out(queries, new_keys, new_values, key_caches, value_cache, *, layer, block=128, **_):
    """No cache block read: the queries plus the new token's own values (every projection still runs)."""
    return queries[0] + _new_token_values(queries, new_values)


def _blocks_read(queries, new_keys, new_values, key_caches, value_cache, *, layer, block=128, **_):
    """The layer's first key and value blocks read whole (summed over their slots and kv heads: one
    pass over each), nothing else computed from them. (Using a single slot would not do: XLA
    narrows the block's slice to what is used, even behind an optimization barrier.)"""
    keys, values = _first_blocks(key_caches, value_cache, layer, block)
    total = keys.sum(axis=(1, 2)) + values.sum(axis=(1, 2))  # (B, D)
    return queries[0] + _new_token_values(queries, new_values) + total[:, None, None, :]


def _blocks_products(queries, new_keys, new_values, key_caches, value_cache, *, layer, block=128, **_):
    """The layer's first blocks through the two products `cached_attention` makes (queries x keys,
    then scores x values, the same einsums), without the mask, the softmax and the new token's part."""
    keys, values = _first_blocks(key_caches, value_cache, layer, block)
    b, t, heads, d = queries[0].shape
    q = queries[0].reshape(b, t, keys.shape[2], heads // keys.shape[2], d)
    scores = jnp.einsum("btkgd,bskd->bkgts", q, keys, preferred_element_type=jnp.float32)
    out = jnp.einsum("bkgts,bske->bkgte", scores, values, preferred_element_type=jnp.float32)
    return queries[0] + out.transpose(0, 3, 1, 2, 4).reshape(b, t, heads, -1)


def attention_stand_in(replacement: Callable | None) -> Callable[[], contextlib.AbstractContextManager]:
    """A context in which a decode step's attention (one new token) is `replacement(...)`, called
    with `cached_attention`'s arguments, instead of `models.layers.cached_attention` (None: the real
    one). Prefill is unchanged. Only for tracing `decode_parts`'s variants. The stand-ins read only
    the first cache block: at the headline's max_len (128 slots) that is the whole cache."""
    @contextlib.contextmanager
    def context():
        real = model_layers.cached_attention

        def stand_in(queries, *args, **kwargs):
            if queries[0].shape[1] != 1:
                return real(queries, *args, **kwargs)
            return replacement(queries, *args, **kwargs)

        model_layers.cached_attention = real if replacement is None else stand_in
        try:
            yield
        finally:
            model_layers.cached_attention = real
    return context


_CACHED_ATTENTION = model_layers.cached_attention


def reads_stand_in(reads: str) -> Callable[[], contextlib.AbstractContextManager]:
    """A context in which decode steps read the cache as `reads` says (`cached_attention(reads=)`),
    whatever the cache was made with."""
    return attention_stand_in(lambda queries, *args, **kwargs: _CACHED_ATTENTION(queries, *args,
                                                                                 **{**kwargs, "reads": reads}))


@contextlib.contextmanager
def xla_matmuls():
    """A context in which decode steps multiply by the weights with XLA's dots whatever
    `decode_matmuls` says (`models.kernels.use_matmul` answers no)."""
    real = kernels.use_matmul
    kernels.use_matmul = lambda x, w: False
    try:
        yield
    finally:
        kernels.use_matmul = real


# Variants of the decode step, from the full step down to no attention to the cache at all.
PART_VARIANTS = {
    "decode step": attention_stand_in(None),
    "decode step, cache_reads=filled": reads_stand_in("filled"),
    "decode step, decode_matmuls=xla": xla_matmuls,
    "blocks + the two products, no softmax": attention_stand_in(_blocks_products),
    "cache blocks read, nothing computed": attention_stand_in(_blocks_read),
    "attention to the cache left out": attention_stand_in(_left_out),
}


def decode_parts(models: dict[str, tuple[Llama, Callable[[], contextlib.AbstractContextManager]]],
                 prompts: np.ndarray, *, max_len: int, new_tokens: int, rounds: int,
                 variants: dict | None = None) -> list[dict]:
    """Each model's decode step as is and with parts of its attention replaced (`PART_VARIANTS`),
    all taking turns.

    `models` maps a name to (model, context): the context (e.g. a mesh) is entered to trace and
    compile. Each (model, variant) is `generate`'s jitted program compiled ahead of time (traced
    after `jax.clear_caches()`, so that no two variants share a trace) for 1 and `new_tokens` new
    tokens; per round each runs both back to back, and a step is their difference over
    `new_tokens - 1`. Returns median and minimum ms per step for each (model, variant).
    """
    program = sys.modules["podtrain.models.generate"]._generate  # `models.generate` the name is the function
    variants = PART_VARIANTS if variants is None else variants
    batch = prompts.shape[0]
    inputs = (jnp.asarray(prompts), jnp.full((batch,), prompts.shape[1], jnp.int32), jnp.full((8,), -1, jnp.int32),
              jax.random.key(0))
    programs = {}
    for model_name, (model, model_context) in models.items():
        graphdef, state = nnx.split(model)
        split = auto_layer_weights(model) == "split"
        reads = auto_cache_reads(model, batch, max_len)
        matmuls = auto_decode_matmuls(model)
        for variant, variant_context in variants.items():
            compiled = []
            with model_context(), variant_context():
                for n in (1, new_tokens):
                    jax.clear_caches()
                    compiled.append(program.lower(graphdef, state, *inputs, max_new_tokens=n, max_len=max_len,
                                                  sampling=Sampling(), pad_id=0, split_layers=split,
                                                  cache_reads=reads, decode_matmuls=matmuls).compile())
            programs[model_name, variant] = (state, *compiled)
    jax.clear_caches()

    def seconds(state, program):
        start = time.perf_counter()
        jax.block_until_ready(program(state, *inputs))
        return time.perf_counter() - start

    steps = {key: [] for key in programs}
    for state, one, full in programs.values():
        seconds(state, one), seconds(state, full)
    for _ in range(rounds):
        for key, (state, one, full) in programs.items():
            steps[key].append(1e3 * (seconds(state, full) - seconds(state, one)) / (new_tokens - 1))
    return [{"model": model_name, "variant": variant, "median_ms": statistics.median(times), "min_ms": min(times),
             "rounds": rounds} for (model_name, variant), times in steps.items()]


PARTS_COLUMNS = (("model", "podtrain", "<8"), ("variant", "at the headline shape", "<38"), ("rounds", "rounds", "d"),
                 ("median_ms", "ms / decode step, median", ".3f"), ("min_ms", "min", ".3f"))


FLOOR_COLUMNS = (("floor", "per decode step", "<44"), ("ms_per_step", "ms", ".3f"), ("gb_per_s", "GB/s", "<6"))


MEMORY_COLUMNS = (("weights", "layer weights", "<7"), ("reads", "cache reads", "<6"),
                  ("max_len", "max_len", "d"), ("cache_mib", "KV cache MiB", ".1f"),
                  ("alias_mib", "updated in place (alias) MiB", ".1f"), ("temp_mib", "temporaries MiB", ".2f"),
                  ("bytes_mib", "bytes accessed MiB (scan body once)", ".1f"))
ROW_COLUMNS = (("implementation", "implementation", "<9"), ("batch", "batch", "d"), ("max_len", "max_len", "d"),
               ("runs", "runs", "d"), ("prefill_ms", "prefill ms", ".1f"), ("total_ms", "total ms", ".1f"),
               ("ms_per_step", "ms / decode step", ".3f"), ("ms_per_token", "ms / token", ".3f"),
               ("tokens_per_s", "decode tokens/s", ".0f"), ("same_tokens", "same tokens", "<5"))
TARGET_COLUMNS = (("target", "target", "<58"), ("value", "measured", "<10"), ("status", "status", "<7"))


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
    ms = headline[0]["ms_per_token"]
    targets = [{"target": f"podtrain decode ms / generated token (batch {HEADLINE_BATCH}, max_len "
                          f"{HEADLINE_MAX_LEN}) <= {TARGET_MS_PER_TOKEN}",
                "value": f"{ms:.3f}", "status": "met" if ms <= TARGET_MS_PER_TOKEN else "NOT met"}]
    say("\n" + format_table(targets, TARGET_COLUMNS))
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
        f"{headline[0]['ms_per_step']:.3f} ms; the target is {TARGET_MS_PER_TOKEN * HEADLINE_BATCH:.3f} ms):\n"
        + format_table(floors, FLOOR_COLUMNS)
        + f"\nmatmuls with every weight already in cache: {compute_floor:.3f} ms per step, "
          f"{compute_floor / HEADLINE_BATCH:.3f} ms per token")
    parts = decode_parts({"1 device": (model, contextlib.nullcontext)}, random_prompts(HEADLINE_BATCH, args.prompt_len),
                         max_len=HEADLINE_MAX_LEN, new_tokens=args.new_tokens, rounds=3 * args.repeats)
    say("\nwhere a decode step goes (the compiled programs take turns):\n" + format_table(parts, PARTS_COLUMNS))
    reads_parts = []
    for batch, max_len in args.reads_shapes:
        variants = {f"cache_reads={reads}": reads_stand_in(reads) for reads in CACHE_READS}
        variants["attention to the cache left out"] = PART_VARIANTS["attention to the cache left out"]
        rows = decode_parts({f"{batch} x {max_len}": (model, contextlib.nullcontext)},
                            random_prompts(batch, args.prompt_len), max_len=max_len, new_tokens=args.new_tokens,
                            rounds=3 * args.repeats, variants=variants)
        reads_parts += rows
        say(("\ncache reads of a decode step (`auto` picks "
             f"{auto_cache_reads(model, batch, max_len)} here):\n") + format_table(rows, PARTS_COLUMNS))
    memory = decode_step_memory(model, HEADLINE_BATCH, sorted({*args.max_lens, HEADLINE_MAX_LEN}))
    say(f"\ncompiled decode step, batch {HEADLINE_BATCH} (XLA memory_analysis / cost_analysis):\n"
        + format_table(memory, MEMORY_COLUMNS))
    if args.json:
        strip = [{k: v for k, v in row.items() if k != "tokens"} for row in headline + rows]
        print(json.dumps({"machine": machine_description(), "rows": strip, "ratios": ratios, "targets": targets,
                          "floors": floors, "decode_parts": parts, "cache_reads_parts": reads_parts,
                          "decode_step_memory": memory},
                         indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
