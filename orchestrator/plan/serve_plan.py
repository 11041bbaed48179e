"""`podtrain plan --serve`: the service's engine compiled for a target before anything is reserved.

The engine's three programs (`serve.engine`) are compiled at their largest shapes on the engine's
layout (`serve.layout`): a training step of `serve.max_rows` rows of `serve.max_seq_len` tokens,
the Adam step of as many slots as one program steps, and sampling whose prompt and new tokens fill
`serve.max_sample_tokens` (by default `serve.max_seq_len`).
Each program also takes what the engine holds and it does not use (the Adam state during a pass,
the base during an Adam step), so the compiler's per-chip peak (arguments + outputs - aliased +
scratch) and, on TPUs, its own check against the chip's memory cover the whole engine. The
service fits when every program does.

How many adapters fit: the engine's memory grows by the same bytes with every slot (its adapters,
gradient and moments), so two compiles give the per-slot bytes, and the largest count under the
chip's memory is then checked by compiling it and one more.
"""

from __future__ import annotations

import math
import time

import jax
import jax.numpy as jnp

from podtrain.orchestrator.config.compose import apply_overrides
from podtrain.orchestrator.plan.hlo_comm import collectives, summarize
from podtrain.orchestrator.plan.host_memory import distinct_bytes_per_host, hf_bytes
from podtrain.orchestrator.plan.on_target import compile_or_oom, shard_bytes
from podtrain.orchestrator.plan.targets import Target, compile_devices, host_line
from podtrain.orchestrator.serve.batches import MIN_TOKENS
from podtrain.orchestrator.serve.layout import EngineLayout, engine_layout
from podtrain.orchestrator.serve.programs import ADAM_CHUNK, adam_steps, bucket, forward_backward, sample_rows
from podtrain.orchestrator.serve.work import ADAM_KEYS
from podtrain.sharding.rules import use_rules

PROGRAMS = ("forward_backward", "adam_steps", "sample")


def sample_shape(max_seq_len: int) -> tuple[int, int]:
    """(padded prompt, padded new tokens) of the largest sampling program the engine can run: a
    prompt and a token budget that together fit `max_seq_len`, each padded up to a power of two."""
    splits = [(bucket(p, MIN_TOKENS), bucket(max_seq_len - p, MIN_TOKENS)) for p in range(1, max_seq_len)]
    return max(splits, key=sum)


def _lowered(layout: EngineLayout) -> tuple[dict, dict]:
    """The engine's programs at their largest shapes, lowered, and the bytes per chip of what the
    engine holds. Each program also takes (unused, kept) whatever the engine holds that it does
    not, so that the compiler's memory figures and its HBM check cover the whole engine."""
    s = layout.config.serve
    n, graphdef, axes = s.max_adapters, layout.graphdef, layout.axes
    replicated = layout.batch(1, 1).slot.sharding
    adapters, rest, adam = layout.adapters, layout.rest, layout.adam()
    bytes_of = {"adapters": shard_bytes(jax.tree.leaves(adapters)), "rest": shard_bytes(jax.tree.leaves(rest)),
                "adam": shard_bytes(jax.tree.leaves(adam))}
    stepped = bucket(min(n, ADAM_CHUNK))  # the most slots one Adam program steps
    hyper = {key: jax.ShapeDtypeStruct((stepped,), jnp.float32, sharding=replicated) for key in ADAM_KEYS}
    hyper["slot"] = jax.ShapeDtypeStruct((stepped,), jnp.int32, sharding=replicated)
    prompt, new = sample_shape(s.sample_tokens())
    rows = bucket(s.max_rows)

    def passes(adam, adapters, rest, grads, batch):
        return forward_backward(graphdef, adapters, rest, grads, batch, loss_chunk=s.loss_chunk)

    def steps(rest, adapters, grads, adam, hyper):
        return adam_steps(adapters, grads, adam, hyper, axes=axes)

    def sample(grads, adam, adapters, rest, batch):
        return sample_rows(graphdef, adapters, rest, batch, new_tokens=new, filtered=True, prompt_logprobs=True,
                           loss_chunk=s.loss_chunk)

    def lower(fn, *args, donate=()):
        return jax.jit(fn, donate_argnums=donate, keep_unused=True).lower(*args)

    with jax.set_mesh(layout.mesh), use_rules(layout.placed.rules):
        return {
            "forward_backward": lower(passes, adam, adapters, rest, adapters,
                                      layout.batch(rows, bucket(s.max_seq_len, MIN_TOKENS)), donate=(3,)),
            "adam_steps": lower(steps, rest, adapters, adapters, adam, hyper, donate=(1, 2, 3)),
            "sample": lower(sample, adapters, adam, adapters, rest, layout.sample_batch(rows, prompt)),
        }, bytes_of


def plan_serve_on_target(config, target: Target, devices=None, *, programs=None) -> dict:
    """Compiles `config`'s engine for `target`: each program's per-chip peak, the verdict (the TPU
    compiler's own; on GPUs the peak against the GPU's memory), and the training pass's FLOPs and
    collective bytes per token. `programs` (names) compiles only those, in that order, and stops at the first that does
    not fit (enough to show that a config does not)."""
    devices = compile_devices(target) if devices is None else devices
    layout = engine_layout(config, devices)
    start = time.perf_counter()
    lowered, bytes_of = _lowered(layout)
    s, chip = layout.config.serve, target.chip
    hbm, report = chip.hbm_bytes, {}
    for name in PROGRAMS if programs is None else programs:
        compiled, oom = compile_or_oom(lowered[name])
        if compiled is None:
            needed, hbm = oom
            report[name] = {"peak_bytes": needed, "fits": False}
            break
        mem = compiled.memory_analysis()
        peak = int(mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
                   + mem.temp_size_in_bytes)
        # What every chip sends in the program's collectives (loops counted by their trips), summed over the chips.
        sent = summarize(collectives(compiled.as_text(), layout.mesh.devices.shape, layout.mesh.axis_names))
        report[name] = {"peak_bytes": peak, "temp_bytes": int(mem.temp_size_in_bytes), "fits": peak <= chip.hbm_bytes,
                        "collective_bytes": sent["traffic_bytes"] * target.devices}
        if name == "forward_backward":
            cost = compiled.cost_analysis()
            cost = cost[0] if isinstance(cost, list | tuple) else cost
            tokens = bucket(s.max_rows) * bucket(s.max_seq_len, MIN_TOKENS)
            report[name]["flops_per_token"] = float(cost.get("flops", 0.0)) * target.devices / tokens
            report[name]["collective_bytes_per_token"] = sent["traffic_bytes"] * target.devices / tokens
        if programs is not None and not report[name]["fits"]:
            break
    peak = max(p["peak_bytes"] for p in report.values())
    host = service_host_memory(layout, chip.host_ram_bytes)
    return {"host": host, "target": target.name, "chip": chip.name, "devices": target.devices, "hosts": target.hosts,
            "mesh": dict(layout.mesh.shape), "max_adapters": s.max_adapters, "max_rank": s.max_rank,
            "max_rows": s.max_rows, "max_seq_len": s.max_seq_len, "sample_shape": list(sample_shape(s.sample_tokens())),
            "base_bytes": bytes_of["rest"], "adapters_bytes": bytes_of["adapters"], "adam_bytes": bytes_of["adam"],
            "programs": report, "peak_bytes": peak, "hbm_bytes": hbm, "headroom_bytes": hbm - peak,
            "fits": all(p["fits"] for p in report.values()) and host["fits"],
            "checked_by": "the TPU compiler" if chip.platform == "tpu" else "podtrain (peak vs the GPU's memory)",
            "compile_s": time.perf_counter() - start}


def service_host_memory(layout: EngineLayout, ram_bytes: int) -> dict:
    """The service's host peak per host: the base's HF import (one parameter's shards of the host's
    devices, read and converted), or an adapter's save or load (one slot's weights and Adam
    moments gathered whole on every host, and their safetensors bytes); and the paged adapters
    (`serve/pages.py`): each keeps the host's shards of its weights and moments, so the RAM left
    beside the peak holds `page_capacity` of them beyond the device slots (a page with a pending
    gradient holds a third more)."""
    s = layout.config.serve
    state = [x for x in jax.tree.leaves((layout.adapters, layout.adam())) if x.ndim]
    slot = sum(x.size * x.dtype.itemsize for x in state) // s.max_adapters
    page = max(distinct_bytes_per_host(state).values()) // s.max_adapters
    imported, _ = hf_bytes(layout.rest)
    phases = {"HF import (the base)": imported, "adapter save": 2 * slot}
    peak_of = max(phases, key=phases.get)
    capacity = max(0, ram_bytes - phases[peak_of]) // max(1, page)
    paged = min(s.host_adapters if s.host_adapters is not None else math.inf, s.live_adapters() - s.max_adapters)
    phases["adapter pages"] = int(paged * page)
    peak = phases[peak_of] + phases["adapter pages"]
    if phases["adapter pages"]:
        peak_of += " beside the adapter pages"
    return {"ram_bytes": ram_bytes, "phases": phases, "peak_of": peak_of, "peak_bytes": peak,
            "fits": peak <= ram_bytes, "headroom_bytes": ram_bytes - peak, "data_bytes": 0,
            "page_bytes": int(page), "page_capacity": int(capacity)}


def adapters_that_fit(config, target: Target, devices=None, *, report: dict | None = None,
                      max_compiles: int = 6) -> dict:
    """The largest `serve.max_adapters` whose engine fits `target`, at the config's rank: from the
    per-slot bytes of two compiles, then searched by interpolating the compiled peaks and checked
    by compiling it (fits) and one more (does not).

    Returns {"max_adapters" (0 when not even one fits), "per_adapter_bytes", "checked" (both sides
    of the boundary compiled within `max_compiles`), "peak_bytes" (at that count), "compiles"}."""
    devices = compile_devices(target) if devices is None else devices
    plans: dict[int, dict] = {} if report is None else {report["max_adapters"]: report}
    compiles = 0

    def fits(n: int) -> bool:
        nonlocal compiles
        if n not in plans:
            compiles += 1
            # The programs largest at the nearest count compiled whole go first: where one does not
            # fit, the rest are not compiled.
            whole = [k for k in plans if len(plans[k]["programs"]) == len(PROGRAMS)]
            nearest = plans[min(whole, key=lambda k: abs(k - n))]["programs"] if whole else {}
            order = sorted(PROGRAMS, key=lambda p: -nearest.get(p, {}).get("peak_bytes", 0))
            sized = apply_overrides(config, [f"serve.max_adapters={n}"], serving=True)
            plans[n] = plan_serve_on_target(sized, target, devices, programs=order)
        return plans[n]["fits"]

    first = config.serve.max_adapters
    second = first * 2 if first > 1 else 2
    fits(first), fits(second)
    per_adapter = max(1, (plans[second]["peak_bytes"] - plans[first]["peak_bytes"]) // (second - first))
    estimate = max(0, first + (target.chip.hbm_bytes - plans[first]["peak_bytes"]) // per_adapter)

    def bracket() -> tuple[int, int | None]:
        """(the largest count compiled that fits, or 0; the smallest above it that does not)."""
        low = max((k for k in plans if plans[k]["fits"]), default=0)
        return low, min((k for k in plans if k > low and not plans[k]["fits"]), default=None)

    def above(low: int) -> int:
        """Upwards of every count compiled: where the line through the two largest counts that fit
        meets the chip's memory."""
        known = sorted(k for k in plans if plans[k]["fits"])[-2:]
        a, b = (known[0], known[-1]) if len(known) == 2 else (first, second)
        slope = (plans[b]["peak_bytes"] - plans[a]["peak_bytes"]) / (b - a) if b != a else per_adapter
        return a + int((target.chip.hbm_bytes - plans[a]["peak_bytes"]) // max(slope, 1))

    # Between a count that fits and one refused: where the line through their peaks meets the memory
    # the compiler reported (regula falsi, with the Illinois rule: an end kept twice in a row counts
    # half, so the search does not creep from one side as the peak grows a little faster than
    # linearly); kept strictly inside the bracket, so next to a count when the line says the
    # boundary is there. Upwards of every count compiled, at least a step that doubles.
    fits(max(1, estimate))
    up, kept, weight = 1, None, {"low": 1.0, "high": 1.0}
    while compiles < max_compiles:
        low, high = bracket()
        if high == low + 1:
            break
        if high is None:
            n, up = max(above(low), low + up), up * 2
        elif low == 0:
            n = high // 2
        else:
            limit = plans[high].get("hbm_bytes", target.chip.hbm_bytes)
            under = (limit - plans[low]["peak_bytes"]) * weight["low"]
            over = max(plans[high]["peak_bytes"] - limit, 1) * weight["high"]
            n = min(max(low + int((high - low) * under / (under + over)), low + 1), high - 1)
            if n in plans:
                n = (low + high) // 2
        fits(n)
        end = "high" if plans[n]["fits"] else "low"  # the end that stays
        weight[end] = weight[end] / 2 if kept == end else 1.0
        weight["low" if end == "high" else "high"] = 1.0
        kept = end
    count, high = bracket()
    checked = high == count + 1
    host = plans[count]["host"] if count in plans else plans[first]["host"]
    return {"max_adapters": int(count), "per_adapter_bytes": int(per_adapter), "checked": checked,
            "max_live_adapters": int(count + host["page_capacity"]), "page_bytes": host["page_bytes"],
            "peak_bytes": plans[count]["peak_bytes"] if count in plans else None,
            "fits_at": {str(k): plans[k]["fits"] for k in sorted(plans)}, "compiles": compiles}


def format_serve(report: dict) -> str:
    gib = 2**30
    lines = [f"serve on {report['target']} ({report['devices']} x {report['chip']}, mesh "
             + " ".join(f"{k}={v}" for k, v in report["mesh"].items() if v > 1) + ")",
             f"  {report['max_adapters']} adapters of rank up to {report['max_rank']}, "
             f"{report['max_rows']} rows of {report['max_seq_len']} tokens",
             f"  per chip: base {report['base_bytes'] / gib:.2f} GiB, adapters "
             f"{report['adapters_bytes'] / gib:.2f} GiB (and as much again for their gradients), Adam "
             f"{report['adam_bytes'] / gib:.2f} GiB"]
    for name, program in report["programs"].items():
        lines.append(f"  {name:<16} peak {program['peak_bytes'] / gib:.2f} GiB"
                     + ("" if program["fits"] else " (over the chip's memory)"))
    host = report["host"]
    lines.append("  host RAM per host: " + ", ".join(f"{k} {v / gib:.2f} GiB" for k, v in host["phases"].items()))
    verdict = "fits" if report["fits"] else "does not fit"
    lines.append(f"  {verdict}: peak {report['peak_bytes'] / gib:.2f} GiB of {report['hbm_bytes'] / gib:.2f} GiB "
                 f"per chip; {host_line(host)}")
    fit = report.get("adapters_that_fit")
    if fit:
        lines.append(f"  adapters that fit at rank {report['max_rank']}: {fit['max_adapters']} in device slots "
                     f"({fit['per_adapter_bytes'] / 2**20:.1f} MiB per chip each); {fit['max_live_adapters']} alive "
                     f"with the rest paged in host RAM ({fit['page_bytes'] / 2**20:.1f} MiB per host each)")
    return "\n".join(lines)
