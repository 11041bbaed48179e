"""What a run will cost before it trains: parameters, FLOPs, shardings and compiled memory."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
from flax import nnx

from models import ModelConfig
from orchestrator.build import Training
from sharding.mesh import describe_mesh
from sharding.place import path_str


def matmul_params(config: ModelConfig) -> int:
    """Parameters that take part in a matmul per token (all but the embedding lookup and norms)."""
    c = config
    attn = c.hidden_size * c.head_dim * (2 * c.num_heads + 2 * c.num_kv_heads)
    mlp = 3 * c.hidden_size * c.intermediate_size
    return c.num_layers * (attn + mlp) + c.hidden_size * c.vocab_size


def flops_per_token(config: ModelConfig, seq_len: int) -> float:
    """Model FLOPs of one training token (forward + backward, no remat recompute).

    6 per matmul parameter, plus causal attention: QK^T and AV cost 4 * seq * heads * head_dim
    per token and layer forward over the full square, half of that under the causal mask,
    times 3 for forward and backward.
    """
    c = config
    attention = 3 * 2 * seq_len * c.num_heads * c.head_dim * c.num_layers
    return 6.0 * matmul_params(config) + attention


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


def make_plan(training: Training, *, compile_step: bool = True) -> dict:
    """A JSON-ready plan; with `compile_step`, the compiled train step's per-device memory."""
    config = training.config
    rows = sharding_table(training)
    plan = {
        "config": dataclasses.asdict(config),
        "mesh": describe_mesh(training.mesh, training.config.cluster.num_slices),
        "param_count": sum(math.prod(r["shape"]) for r in rows),
        "param_bytes_per_device": sum(r["bytes_per_device"] for r in rows),
        "flops_per_token": flops_per_token(config.model, config.train.seq_len),
        "tokens_per_step": config.train.batch_size * config.train.seq_len,
        "sharding": rows,
    }
    if compile_step:
        compiled = training.step.lower(training.abstract_state(), training.abstract_batch()).compile()
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
        f"{m['vocab_size']}, dtype {m['dtype']} (params {m['param_dtype']}), remat {m['remat']}",
        "mesh       " + " x ".join(f"{k}={v}" for k, v in mesh["axes"].items())
        + f" = {mesh['devices']} {mesh['device_kind']} devices in {mesh['processes']} process(es)",
        f"params     {_human(plan['param_count'])} ({plan['param_count']:,}); "
        f"{_mib(plan['param_bytes_per_device'])} per device",
        f"flops      {_human(plan['flops_per_token'])} per token (train), "
        f"{_human(plan['flops_per_token'] * plan['tokens_per_step'])} per step of {plan['tokens_per_step']:,} tokens",
        "",
        f"{'parameter':<32} {'shape':<22} {'spec':<30} {'per device':>12}",
    ]
    group = None
    for row in plan["sharding"]:
        head = row["path"].rsplit(".", 1)[0] if "." in row["path"] else "(top)"
        if head != group:
            group = head
            lines.append(f"[{group}]")
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
    return "\n".join(lines)
