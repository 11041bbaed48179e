"""What a run will cost before it trains: parameters, FLOPs, shardings and compiled memory."""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
from flax import nnx

from podtrain.models import flops_per_token
from podtrain.models.moe.dispatch import capacity
from podtrain.models.moe.dropless import buffer_rows
from podtrain.orchestrator.plan.host_memory import host_memory, machine_ram_bytes
from podtrain.orchestrator.plan.targets import host_line, verdict_line
from podtrain.orchestrator.train.build import Training
from podtrain.sharding.mesh import describe_mesh
from podtrain.sharding.place import path_str
from podtrain.sharding.rules import sharded_over


def sharding_table(training: Training) -> list[dict]:
    """One row per parameter: path, shape, dtype, logical names, PartitionSpec, bytes per device."""
    rows = []
    for path, var in nnx.to_flat_state(training.abstract_params):
        value = var.get_value()
        shard_shape = value.sharding.shard_shape(value.shape)
        rows.append({
            "path": path_str(path),
            "shape": list(value.shape),
            "dtype": str(value.dtype),
            "logical": list(var.get_metadata().get("out_sharding") or []),
            "spec": [None if a is None else a if isinstance(a, str) else list(a) for a in value.sharding.spec],
            "bytes_per_device": int(math.prod(shard_shape) * np.dtype(value.dtype).itemsize),
        })
    return rows


def expert_plan(training: Training) -> dict | None:
    """How the routed experts are spread: experts per device, the mesh axes that shard them, and
    the slots per expert per token shard (the dispatch buffer; the worst case when dropless)."""
    c = training.config
    m = c.model
    if not m.num_moe_layers:
        return None
    sizes = dict(training.mesh.shape)
    axes, shards = sharded_over(("experts",), sizes, c.sharding.rules)
    _, token_shards = sharded_over(("batch", "seq"), sizes, c.sharding.rules)
    local_tokens = c.train.batch_size * c.train.seq_len // c.train.grad_accum // token_shards
    return {
        "num_experts": m.moe.num_experts, "per_token": m.moe.num_experts_per_tok, "shared": m.moe.num_shared_experts,
        "moe_layers": m.num_moe_layers, "mesh_axes": list(axes), "experts_per_device": m.moe.num_experts // shards,
        "capacity_factor": m.moe.capacity_factor,
        "slots_per_expert": capacity(local_tokens, m.moe.num_experts_per_tok, m.moe.num_experts,
                                     m.moe.capacity_factor),
        "buffer_factor": m.moe.buffer_factor,
        "buffer_rows": buffer_rows(local_tokens * m.moe.num_experts_per_tok, shards, m.moe.num_experts_per_tok,
                                   m.moe.num_experts // shards, m.moe.buffer_factor),
    }


def make_plan(training: Training, *, compile_step: bool = True) -> dict:
    """A JSON-ready plan; with `compile_step`, the compiled train step's per-device memory."""
    config = training.config
    rows = sharding_table(training)
    plan = {
        "config": dataclasses.asdict(config),
        "mesh": describe_mesh(training.mesh, training.config.cluster.num_slices),
        "param_count": sum(math.prod(r["shape"]) for r in rows),
        "trainable_param_count": sum(math.prod(v.shape) for v in jax.tree.leaves(training.abstract_state().params)),
        "param_bytes_per_device": sum(r["bytes_per_device"] for r in rows),
        "flops_per_token": flops_per_token(config.model, config.train.seq_len),
        "experts": expert_plan(training),
        "tokens_per_step": config.train.batch_size * config.train.seq_len,
        "sharding": rows,
    }
    if compile_step:
        compiled = training.step.lower(training.abstract_state(), training.abstract_batch(),
                                       training.abstract_frozen()).compile()
        mem = compiled.memory_analysis()
        plan["memory"] = {
            "argument_bytes": int(mem.argument_size_in_bytes),
            "output_bytes": int(mem.output_size_in_bytes),
            "alias_bytes": int(mem.alias_size_in_bytes),
            "temp_bytes": int(mem.temp_size_in_bytes),
            "peak_bytes_estimate": int(
                mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
                + mem.temp_size_in_bytes
            ),
        }
        platform = training.mesh.devices.flat[0].platform
        plan["host"] = host_memory(training, ram_bytes=machine_ram_bytes(), platform=platform,
                                   step_bytes=plan["memory"]["peak_bytes_estimate"] * training.mesh.devices.size)
        if platform == "cpu" and config.model.dtype != "float32":
            plan["memory"]["note"] = (f"compiled for CPU devices, where XLA computes {config.model.dtype} matmuls in "
                                      f"float32 (with float32 copies of activations): temp overstates what "
                                      f"model.dtype={config.model.dtype} needs on TPU or GPU")
    return plan


def _human(n: float) -> str:
    for unit in ("", "K", "M", "G", "T", "P"):
        if abs(n) < 1000:
            return f"{n:.3g}{unit}"
        n /= 1000
    return f"{n:.3g}E"


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def format_plan(plan: dict) -> str:
    """The plan as text: config summary, mesh, counts, grouped sharding table, memory."""
    m = plan["config"]["model"]
    mesh = plan["mesh"]
    lines = [
        f"model      {m['model_type']}: {m['num_layers']} layers, hidden {m['hidden_size']}, ffn "
        f"{m['intermediate_size']}, heads {m['num_heads']}/{m['num_kv_heads']} x {m['head_dim']}, vocab "
        f"{m['vocab_size']}, dtype {m['dtype']} (params {m['param_dtype']}), remat {m['remat']}, "
        f"attention {m['attention']}",
        "mesh       " + " x ".join(f"{k}={v}" for k, v in mesh["axes"].items())
        + f" = {mesh['devices']} {mesh['device_kind']} devices in {mesh['processes']} process(es)",
        f"params     {_human(plan['param_count'])} ({plan['param_count']:,}); "
        f"{_mib(plan['param_bytes_per_device'])} per device",
        *([f"lora       rank {plan['config']['lora']['rank']} on {', '.join(plan['config']['lora']['targets'])}: "
           f"{_human(plan['trainable_param_count'])} ({plan['trainable_param_count']:,}) trained params, "
           "the base frozen (no gradients, no optimizer state)"] if plan["config"]["lora"]["rank"] else []),
        f"flops      {_human(plan['flops_per_token'])} per token (train), "
        f"{_human(plan['flops_per_token'] * plan['tokens_per_step'])} per step of {plan['tokens_per_step']:,} tokens",
    ]
    experts = plan.get("experts")
    if experts:
        over = "+".join(experts["mesh_axes"]) or "no axis (replicated)"
        if experts["capacity_factor"]:
            mode = (f"capacity factor {experts['capacity_factor']}, {experts['slots_per_expert']:,} slots per expert "
                    "per token shard")
        else:
            mode = (f"dropless, {experts['buffer_rows']:,} rows per device per exchange round (buffer factor "
                    f"{experts['buffer_factor']})")
        lines.append(
            f"experts    {experts['moe_layers']} MoE layers x {experts['num_experts']} routed experts "
            f"({experts['per_token']} per token, {experts['shared']} shared) sharded over {over}: "
            f"{experts['experts_per_device']} per device; {mode}"
        )
    lines += [
        "",
        f"{'parameter':<32} {'shape':<22} {'spec':<30} {'per device':>12}",
    ]
    groups: dict[str, list[dict]] = {}  # module -> its rows, modules in order of first appearance
    for row in plan["sharding"]:
        groups.setdefault(row["path"].rsplit(".", 1)[0] if "." in row["path"] else "(top)", []).append(row)
    for group, rows in groups.items():
        lines.append(f"[{group}]")
        for row in rows:
            spec = ", ".join("-" if a is None else a if isinstance(a, str) else "+".join(a) for a in row["spec"])
            spec = f"({spec})"
            lines.append(f"  {row['path'].rsplit('.', 1)[-1]:<30} {str(tuple(row['shape'])):<22} {spec:<30} "
                         f"{_mib(row['bytes_per_device']):>12}")
    if "memory" in plan:
        mem = plan["memory"]
        lines += [
            "",
            "train step, compiled, per device: "
            f"arguments {_mib(mem['argument_bytes'])}, outputs {_mib(mem['output_bytes'])} "
            f"(aliased {_mib(mem['alias_bytes'])}), temp {_mib(mem['temp_bytes'])}; "
            f"peak about {_mib(mem['peak_bytes_estimate'])}",
        ]
        if "note" in mem:
            lines.append(f"  note: {mem['note']}")
    if "host" in plan:
        lines += ["", *host_lines(plan["host"], "this machine")]
    return "\n".join(lines)


def host_lines(host: dict, where: str) -> list[str]:
    """Each phase's host RAM peak, the data pipeline's share and the verdict against `where`'s RAM."""
    phases = ", ".join(f"{name} {_gib(value)}" for name, value in host["phases"].items())
    return [f"host RAM   per host: {phases}; data pipeline {_gib(host['data_bytes'])} beside them",
            f"           {host_line(host)} ({where})"]


def _gib(n: float | None) -> str:
    if n is None:
        return "-"
    return f"{n / 2**30:,.2f} GiB" if abs(n) >= 2**30 else f"{n / 2**20:,.1f} MiB"


def _bytes(n: float) -> str:
    return _human(n) + "B"


def format_target(report: dict) -> str:
    """The compiled-for-target part of a plan: memory and verdict, traffic, ideal, step estimate."""
    lines = [
        f"target     {report['target']}: {report['devices']} {report['chip']} devices in {report['hosts']} host(s); "
        f"attention {report['attention']}; compiled in {report['compile_s']:.1f} s, checked by {report['checked_by']}",
        f"memory     per device: params {_gib(report['params_bytes'])}, optimizer {_gib(report['optimizer_bytes'])}, "
        f"temp {_gib(report['temp_bytes'])}, peak {_gib(report['peak_bytes'])} of {_gib(report['hbm_bytes'])}",
        f"verdict    {verdict_line(report)}",
    ]
    if report.get("host"):
        lines[2:2] = host_lines(report["host"], f"a {report['chip']} host")
    if report.get("attention_note"):
        lines.insert(2, f"  note: {report['attention_note']}")
    comm = report.get("communication")
    if comm:
        kinds = ", ".join(f"{kind} {_bytes(v['traffic_bytes'])} ({v['ops']} ops, {v['executions']} runs)"
                          for kind, v in comm["by_kind"].items()) or "none"
        axes = ", ".join(f"{a} {_bytes(v)}" for a, v in comm["by_axes"].items()) or "none"
        ideal = ", ".join(f"{kind} {_bytes(v)}" for kind, v in comm["ideal"]["by_kind"].items()) or "none"
        lines += [
            f"traffic    sent per device per step {_bytes(comm['traffic_bytes'])}: {kinds}; by mesh axes: {axes}",
            f"ideal      {_bytes(comm['ideal']['traffic_bytes'])}: {ideal}",
            "  " + "; ".join(f"{key}: {_bytes(v['measured'])} (ideal {_bytes(v['ideal'])})"
                             for key, v in comm["by_category"].items()),
        ]
        if comm["unexplained"]:
            lines.append("not in the ideal (largest first):")
            for c in comm["unexplained"]:
                lines.append(f"  {c['kind']:<18} {c['shape'][:48]:<48} over {'+'.join(c['axes']) or '-':<8} "
                             f"x{c['executions']:<4} {_bytes(c['traffic']):>8}  {c['op_name'][-60:]} {c['source']}")
    r = report.get("estimate")
    if r:
        lines.append(
            f"estimate   step {r['step_s'] * 1e3:,.1f} ms bound by {r['bound_by']}: "
            f"{_human(r['tokens_per_s_per_chip'])} tokens/s per chip, MFU {r['mfu']:.1%} "
            f"(compute {r['compute_s'] * 1e3:,.1f} ms, HBM {r['hbm_s'] * 1e3:,.1f} ms, collectives "
            f"{r['comm_s'] * 1e3:,.1f} ms of which {r['exposed_s'] * 1e3:,.1f} ms not overlapped) -- "
            "from the compiled program at the chip's published rates, not a measurement")
    return "\n".join(lines)
