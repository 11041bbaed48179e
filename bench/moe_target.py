"""MoE layer on a TPU target: per-device FLOPs and all-to-all bytes over the routed ideal.

    PYTHONPATH=. .venv/bin/python bench/moe_target.py [--target v5p-16] [--ep 8] [--tokens 4096]
                                                      [--preset deepseek-v3-671b] [--lora RANK] [--json]

One MoE layer of the preset (routed experts only: the shared expert is a dense MLP), forward and
backward of sum(y), compiled for `--ep` chips of the compile-only TPU devices of `--target`
(needs podtrain[aot]; `--target cpu`: simulated CPU devices, where XLA:CPU's grouped matmul costs
every row times every local expert and the ragged exchange is a padded all-to-all), `--tokens`
tokens per chip, bf16. For each dispatch and with and without
rematerialisation (the presets' `model.remat: full`: a scan over two stacked layers, each under
`jax.checkpoint`, as the model runs them; figures per layer):

- FLOPs: the compiled program's `cost_analysis()` per device over the routed ideal, `tokens x k`
  rows through the three expert matmuls, backward twice the forward, a second forward under
  remat. The scan over layers counts its trips. The dropless dispatch runs round 0 and then a
  `while` loop over the overflow rounds, which makes no trips when the routing fits the buffer
  but which `cost_analysis` counts once: the figures are of the program as it runs in one round
  (compiled with the overflow loops left out), and `+ round` what each further round adds (the
  program as shipped less that one), in routed forward passes.
- all-to-all bytes: what one device sends (`orchestrator/plan/hlo_comm.py`) over the routed ideal,
  `tokens x k` rows of `D` leaving each device `(ep - 1) / ep` of the time, to their experts and
  back in the forward, gradients both ways in the backward, and the rows again under remat;
  `+ round` in routed one-way exchanges, like the FLOPs.

`--lora RANK`: the experts carry LoRA adapters of that rank (the "experts" target) and the
gradient is the adapters' and the tokens', as in a LoRA run: the ideal has no weight-gradient
pass (forward and the tokens' gradient, and the second forward under remat); the adapters' own
matmuls are above it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from unittest import mock

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402

from podtrain.orchestrator.common.platforms import start_jax  # noqa: E402

start_jax(compile_only=True)  # the CPU alone: the target's devices are compile-only
jax.config.update("jax_num_cpu_devices", 8)  # for --cpu; compile-only TPU devices do not use them

import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

from bench.common import format_table, machine_description  # noqa: E402
from podtrain.models.kernels.exchange import resolve_exchange  # noqa: E402
from podtrain.models.kernels.grouped_matmul import resolve_grouped_matmul  # noqa: E402
from podtrain.models.lora import LoRAConfig, LoRAParam, apply_lora  # noqa: E402
from podtrain.models.moe import MoE, dropless  # noqa: E402
from podtrain.orchestrator.config.compose import load_config  # noqa: E402
from podtrain.orchestrator.plan import hlo_comm  # noqa: E402
from podtrain.orchestrator.plan.targets import compile_devices, parse_target  # noqa: E402
from podtrain.sharding.mesh import build_mesh  # noqa: E402
from podtrain.sharding.place import abstract_model  # noqa: E402
from podtrain.sharding.rules import DEFAULT_RULES, use_rules  # noqa: E402


def schemes(num_experts: int, top_k: int) -> dict[str, dict]:
    """Dispatch name -> MoE config changes. Slots of `tokens` per expert (capacity factor E/k) is
    the dropless dispatch as it was before the grouped one: the same program."""
    return {
        "dropless, grouped, buffer 1.25": {"capacity_factor": 0.0, "buffer_factor": 1.25},
        "dropless, grouped, buffer 1.0": {"capacity_factor": 0.0, "buffer_factor": 1.0},
        "capacity 1.25 (drops)": {"capacity_factor": 1.25},
        "dropless, slots (before)": {"capacity_factor": num_experts / top_k},
    }


def measure(preset: str, scheme: dict, devices, ep: int, tokens: int, remat: bool, lora_rank: int = 0) -> dict:
    model = load_config(preset).model
    platform = devices[0].platform  # the kernels a run's build resolves for these devices
    moe = dataclasses.replace(model.moe, num_shared_experts=0, grouped_matmul=resolve_grouped_matmul("auto", platform),
                              exchange=resolve_exchange("auto", platform), **scheme)
    config = model.replace(moe=moe, dtype="bfloat16", param_dtype="bfloat16", interpret_kernels=platform == "cpu")
    mesh = build_mesh({"fsdp": 1, "ep": ep}, devices[:ep])
    lora = LoRAConfig(rank=lora_rank, targets=("experts",))
    graphdef, state = abstract_model(lambda: apply_lora(MoE(config, rngs=nnx.Rngs(0)), lora), mesh, DEFAULT_RULES)
    x = jax.ShapeDtypeStruct((ep, tokens, config.hidden_size), jnp.bfloat16,
                             sharding=NamedSharding(mesh, PartitionSpec("ep")))

    if remat:  # as the model runs it: a scan over stacked layers, each rematerialised (two layers here)
        state = jax.tree.map(lambda v: jax.ShapeDtypeStruct(
            (2, *v.shape), v.dtype, sharding=NamedSharding(mesh, PartitionSpec(None, *v.sharding.spec))), state)

    trained, frozen = nnx.split_state(state, LoRAParam if lora_rank else nnx.Param, ...)

    def loss(trained, x, frozen):
        def layer(state, x):  # a new function each trace: jax.checkpoint caches its traces by function
            return nnx.merge(graphdef, *state)(x)[0]

        state = (trained, frozen)

        if not remat:
            return layer(state, x).astype(jnp.float32).sum()

        def body(h, layer_state):
            return h + jax.checkpoint(layer)(layer_state, h), None
        return jax.lax.scan(body, x, state)[0].astype(jnp.float32).sum()

    def costs(compiled):
        found = hlo_comm.collectives(compiled.as_text(), mesh.devices.shape, mesh.axis_names)
        sent = sum(c.traffic for c in found if c.kind in ("all-to-all", "ragged-all-to-all"))
        return compiled.cost_analysis()["flops"], sent / layers

    def compile_():
        with jax.set_mesh(mesh), use_rules(DEFAULT_RULES):
            return jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(trained, x, frozen).compile()

    layers = 2 if remat else 1
    start = time.perf_counter()
    with mock.patch.object(dropless, "_overflow", lambda plan, one_round, body, init: init):
        compiled = compile_()
    flops, sent = costs(compiled)
    extra = [a - b for a, b in zip(costs(compile_()), (flops, sent), strict=True)] if moe.capacity_factor == 0 \
        else [0.0, 0.0]
    seconds = time.perf_counter() - start
    d, f, k = config.hidden_size, moe.moe_intermediate_size, moe.num_experts_per_tok
    forward = tokens * k * 3 * 2 * d * f
    crossing = tokens * k * d * 2 * (ep - 1) / ep
    return {
        # cost_analysis() counts a scan's body once: one layer's forward and backward either way
        "flops": flops, "flops_ideal": (3 + remat - bool(lora_rank)) * forward, "flops_round": extra[0] / forward,
        "a2a_bytes": sent, "a2a_ideal": (4 + remat) * crossing, "a2a_round": extra[1] / crossing,
        "temp_gib": compiled.memory_analysis().temp_size_in_bytes / 2**30, "compile_s": seconds,
    }


COLUMNS = (("scheme", "dispatch", "<32"), ("remat", "remat", "<5"), ("flops", "FLOPs / device", ".3e"),
           ("flops_ratio", "over routed", ".3f"), ("flops_round", "+ round", ".3f"),
           ("a2a_bytes", "all-to-all B / device", ".3e"), ("a2a_ratio", "over routed", ".3f"),
           ("a2a_round", "+ round", ".3f"), ("temp_gib", "temp GiB", ".2f"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="v5p-16", help="a TPU slice, or cpu (simulated CPU devices)")
    parser.add_argument("--ep", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per chip")
    parser.add_argument("--preset", default="deepseek-v3-671b")
    parser.add_argument("--only", default="", help="the dispatches whose name contains this")
    parser.add_argument("--remat", choices=("both", "none", "full"), default="both")
    parser.add_argument("--lora", type=int, default=0, metavar="RANK", help="LoRA adapters of this rank on the experts")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    devices = jax.devices("cpu") if args.target == "cpu" else compile_devices(parse_target(args.target))
    moe = load_config(args.preset).model.moe
    rows = []
    remats = {"both": (False, True), "none": (False,), "full": (True,)}[args.remat]
    for name, scheme in schemes(moe.num_experts, moe.num_experts_per_tok).items():
        if args.only not in name:
            continue
        for remat in remats:
            row = measure(args.preset, scheme, devices, args.ep, args.tokens, remat, args.lora)
            rows.append(row | {"scheme": name, "remat": "full" if remat else "none",
                               "flops_ratio": row["flops"] / row["flops_ideal"],
                               "a2a_ratio": row["a2a_bytes"] / row["a2a_ideal"]})
            print(f"  {name}, remat {rows[-1]['remat']}: compiled in {row['compile_s']:.0f} s", file=sys.stderr)
    if args.json:
        print(json.dumps({"machine": machine_description(), "args": vars(args), "rows": rows}))
        return 0
    lora = f", LoRA rank {args.lora} on the experts (base frozen)" if args.lora else ""
    print(f"# MoE layer on {args.target}: {args.preset} layer shapes ({moe.num_experts} experts, top-"
          f"{moe.num_experts_per_tok}), ep {args.ep}, {args.tokens} tokens per chip{lora}; {machine_description()}\n")
    print(format_table(rows, COLUMNS))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
