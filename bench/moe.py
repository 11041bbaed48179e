"""MoE layer benchmark: step time and per-device FLOPs at EP = 1, 2, 4 against a baseline.

    PYTHONPATH=. .venv/bin/python bench/moe.py [--quick] [--json]

One DeepSeek-V3 MoE layer (sigmoid router, group-limited top-k, routed experts; no shared
expert so that the routed part is what is measured), forward + backward of sum(y) over a global
batch of tokens, on 1, 2 and 4 simulated CPU devices with the experts sharded over `ep`:

- `dispatch (dropless)` and `dispatch (capacity 1.25)`: podtrain's all-to-all token dispatch
  (`models/moe/dispatch.py`); each device runs only its experts, on the slots of its experts.
- `every rank sees every token`: the baseline written here, the scheme a public JAX peer uses:
  every EP rank all-gathers the tokens, runs its experts on all of them (weights zero where a
  token did not choose the expert) and the partial outputs are summed back (psum-scatter).

Per-device FLOPs come from the compiled program's `cost_analysis()` (no loops inside, so the
count is exact). Step times on 2 cores with 4 simulated devices share the same 2 cores: they show
how the work shrinks, not a real multi-chip speed-up.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

import jax

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

jax.config.update("jax_num_cpu_devices", 4)

import dataclasses  # noqa: E402

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

from bench.common import format_table, machine_description, time_calls  # noqa: E402
from podtrain.models.config import ModelConfig, MoEConfig  # noqa: E402
from podtrain.models.moe import MoE, route  # noqa: E402
from podtrain.sharding.mesh import build_mesh  # noqa: E402
from podtrain.sharding.place import create_sharded  # noqa: E402
from podtrain.sharding.rules import DEFAULT_RULES, use_rules  # noqa: E402

# A layer big enough for the matmuls to dominate on this CPU: 16 experts of 512 -> 256, top-2.
CONFIG = ModelConfig(
    model_type="deepseek_v3", vocab_size=256, hidden_size=512, intermediate_size=1024, num_layers=1,
    num_heads=4, num_kv_heads=4, head_dim=16,
    moe=MoEConfig(num_experts=16, num_experts_per_tok=2, moe_intermediate_size=256, num_shared_experts=0,
                  n_group=4, topk_group=2, routed_scaling_factor=2.5),
)
BATCH, SEQ = 8, 256
SCHEMES = ("dispatch (dropless)", "dispatch (capacity 1.25)", "every rank sees every token")


def every_rank_sees_every_token(moe: MoE, x_BTD: jax.Array) -> jax.Array:
    """The baseline: all-gather the tokens, run the local experts on all of them, psum-scatter back."""
    weights, experts = route(x_BTD, moe.router[...], moe.router_bias[...], moe.config)
    num_experts = moe.config.num_experts
    combine = (jax.nn.one_hot(experts, num_experts) * weights[..., None]).sum(-2)  # (B, T, E)
    mesh = jax.sharding.get_abstract_mesh()
    ep = dict(mesh.shape).get("ep", 1) if not mesh.empty else 1
    tokens = PartitionSpec("ep") if ep > 1 else PartitionSpec()
    experts_spec = PartitionSpec("ep") if ep > 1 else PartitionSpec()

    def local(x, combine, w_gate, w_up, w_down):
        if ep > 1:
            x = jax.lax.all_gather(x, "ep", axis=0, tiled=True)
            combine = jax.lax.all_gather(combine, "ep", axis=0, tiled=True)
            first = jax.lax.axis_index("ep") * w_gate.shape[0]
            combine = jax.lax.dynamic_slice_in_dim(combine, first, w_gate.shape[0], axis=2)
        hidden = jax.nn.silu(jnp.einsum("btd,edf->ebtf", x, w_gate)) * jnp.einsum("btd,edf->ebtf", x, w_up)
        out = jnp.einsum("ebtf,efd,bte->btd", hidden, w_down, combine)
        return jax.lax.psum_scatter(out, "ep", scatter_dimension=0, tiled=True) if ep > 1 else out

    w = [p[...] for p in (moe.w_gate, moe.w_up, moe.w_down)]
    return jax.shard_map(local, in_specs=(tokens, tokens, experts_spec, experts_spec, experts_spec),
                         out_specs=tokens)(x_BTD, combine, *w)


def measure(scheme: str, ep: int, repeats: int) -> dict:
    capacity_factor = 1.25 if "capacity" in scheme else 0.0
    config = CONFIG.replace(moe=dataclasses.replace(CONFIG.moe, capacity_factor=capacity_factor))
    mesh = build_mesh({"fsdp": 1, "ep": ep}, jax.devices()[:ep])
    layer = create_sharded(lambda: MoE(config, rngs=nnx.Rngs(0)), mesh)
    graphdef, state = nnx.split(layer)
    spec = PartitionSpec("ep") if ep > 1 else PartitionSpec()
    x = jax.device_put(np.random.default_rng(0).normal(size=(BATCH, SEQ, CONFIG.hidden_size)).astype(np.float32),
                       NamedSharding(mesh, spec))

    def loss(state, x):
        moe = nnx.merge(graphdef, state)
        y = every_rank_sees_every_token(moe, x) if scheme.startswith("every") else moe(x)[0]
        return y.sum()

    with jax.set_mesh(mesh), use_rules(DEFAULT_RULES):
        step = jax.jit(jax.value_and_grad(loss))
        flops = step.lower(state, x).compile().cost_analysis()["flops"]
        time_calls(lambda: step(state, x), 2)  # compile and warm up
        wall = time_calls(lambda: step(state, x), repeats).wall
    return {"scheme": scheme, "ep": ep, "gflop_per_device": flops / 1e9, "ms": 1e3 * statistics.median(wall)}


COLUMNS = (("scheme", "scheme", "<28"), ("ep", "EP", "d"), ("gflop_per_device", "GFLOP per device (fwd+bwd)", ".3f"),
           ("vs_ep1", "vs EP=1", ".3f"), ("ms", "step ms (median)", ".1f"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 timed steps instead of 10")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = parser.parse_args(argv)
    rows = []
    for scheme in SCHEMES:
        base = None
        for ep in (1, 2, 4):
            row = measure(scheme, ep, 3 if args.quick else 10)
            base = base or row["gflop_per_device"]
            rows.append(row | {"vs_ep1": row["gflop_per_device"] / base})
    if args.json:
        print(json.dumps({"machine": machine_description(), "rows": rows}))
        return 0
    print(f"# MoE layer benchmark, {datetime.date.today()}, {machine_description()}")
    print(f"layer: {CONFIG.moe.num_experts} experts, top-{CONFIG.moe.num_experts_per_tok}, hidden "
          f"{CONFIG.hidden_size}, expert ffn {CONFIG.moe.moe_intermediate_size}; {BATCH} x {SEQ} tokens\n")
    print(format_table(rows, COLUMNS))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
