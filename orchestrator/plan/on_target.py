"""The train step compiled for a real target (a TPU slice, GPU nodes) on compile-only devices: does
it fit, how close is it, what it communicates, and how long a step should take.

The step is the one `podtrain train` runs (`build_training`: shardings, remat, micro-batches,
optimizer state, loss chunking). The TPU compiler checks memory itself and refuses a step that does
not fit (`RESOURCE_EXHAUSTED`, with the bytes it needed); the GPU compiler does not, so its peak is
compared with the GPU's memory here. When the step does not fit, `find_fit` compiles a bounded
number of changes (more micro-batches, full remat, fsdp over dp) and reports the first that fits.
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from collections import defaultdict

import jax
import numpy as np
from flax import nnx

from podtrain.models import flops_per_token
from podtrain.models.kernels.attention import resolve_backend
from podtrain.models.runner import REMAT
from podtrain.orchestrator.common.errors import ConfigError
from podtrain.orchestrator.config.compose import apply_overrides
from podtrain.orchestrator.config.schema import Config
from podtrain.orchestrator.plan.hlo_comm import as_rows, collectives, summarize
from podtrain.orchestrator.plan.hlo_cost import step_time
from podtrain.orchestrator.plan.host_memory import host_memory
from podtrain.orchestrator.plan.targets import Target, compile_devices
from podtrain.orchestrator.train.build import Training, build_training
from podtrain.sharding.rules import axes_of, logical_to_spec

_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_SMALL = 64 * 2**10  # traffic below this (scalars, norms of a tiny model) is noise to the comparison
# The TPU compiler's two ways of saying how much a step needed and how much the chip has.
_OOM = (re.compile(r"Used ([0-9.]+)([KMGT]?) of ([0-9.]+)([KMGT]?) hbm"),
        re.compile(r"required for [^(]*\(([0-9.]+)([KMGT]?)\) exceeds available HBM \(([0-9.]+)([KMGT]?)\)"))


def shard_bytes(leaves) -> int:
    """Bytes per device of arrays (or abstract arrays) as their shardings place them."""
    total = 0
    for leaf in leaves:
        shape = leaf.sharding.shard_shape(leaf.shape) if getattr(leaf, "sharding", None) else leaf.shape
        total += math.prod(shape) * np.dtype(leaf.dtype).itemsize
    return int(total)


def compile_or_oom(lowered):
    """(compiled, None), or (None, (needed, capacity) bytes) when the TPU compiler ran out of HBM."""
    try:
        return lowered.compile(), None
    except Exception as error:  # XlaRuntimeError; its text is all it says
        text = str(error)
        m = next((found for pattern in _OOM if (found := pattern.search(text))), None)
        if "RESOURCE_EXHAUSTED" not in text or not m:
            raise
        return None, (int(float(m[1]) * _UNITS[m[2]]), int(float(m[3]) * _UNITS[m[4]]))


def category(kind: str, axes) -> str:
    """What a collective is compared by: all-gathers, reduce-scatters and the collective-permutes the
    TPU compiler decomposes them into are one kind ("gather/scatter"), per mesh axes."""
    group = "gather/scatter" if kind in ("all-gather", "reduce-scatter", "collective-permute") else kind
    return f"{group} over {'+'.join(axes) or '-'}"


def ideal_traffic(training: Training) -> dict:
    """Bytes per device per step of an ideal program for this mesh, by kind and by category.

    FSDP: every parameter gathered (in the compute dtype) along the batch axes that shard it, a
    layer's once for its forward and once for its backward iteration of each micro-batch (the other
    parameters, used once, kept gathered for the backward pass), its gradient reduce-scattered once
    per micro-batch; gradients all-reduced over the batch axes that do not shard the parameter.
    Routed experts stay where they are (their dimension sharded over `ep` is not gathered): each
    token's hidden state goes to its `num_experts_per_tok` experts and back by all-to-all along the
    expert axes, in every pass over a MoE layer. The token embedding is not gathered: its rows are
    looked up where the table is, and one all-to-all along the axes sharding its hidden dimension
    hands them to their tokens (and back in the backward pass); along `tp` its vocabulary is
    gathered once. Tensor parallelism: per layer two
    activation all-reduces in the forward pass and two in the backward, one more when remat
    recomputes the attention output projection; one for the LM head's input gradient, and the
    loss's reductions over the vocabulary (the logits' max, two float32 sums). Context
    parallelism: the sequence's axes count as batch axes for the parameters, and each attention
    layer gathers the whole sequence's keys and values in every forward pass and reduce-scatters
    their gradients.
    """
    config, mesh = training.config, training.mesh
    m = config.model
    sizes = dict(mesh.shape)
    order = list(mesh.axis_names)
    rules = config.sharding.rules
    # Devices that hold different tokens: the batch axes, and the sequence's (context parallelism).
    seq_axes = axes_of(logical_to_spec(("seq",), sizes, rules=rules)[0])
    batch_axes = set(axes_of(logical_to_spec(("batch",), sizes, rules=rules)[0])) | set(seq_axes)
    itemsize = np.dtype(m.dtype).itemsize
    accum = config.train.grad_accum
    token_shards = math.prod(sizes[a] for a in batch_axes)
    tokens = config.train.batch_size * config.train.seq_len / token_shards / accum  # per micro-batch
    by_kind: dict[str, float] = defaultdict(float)
    by_category: dict[str, float] = defaultdict(float)

    def add(kind: str, axes, value: float, times: int = accum) -> None:
        if value:
            by_kind[kind] += value * times
            by_category[category(kind, sorted(axes, key=order.index))] += value * times

    for path, var in nnx.to_flat_state(training.abstract_params):
        value = var.get_value()
        names = list(var.get_metadata().get("out_sharding") or [None] * value.ndim)
        spec = list(value.sharding.spec) + [None] * (value.ndim - len(value.sharding.spec))
        gathered_axes, kept = [], 1
        for name, entry in zip(names, spec, strict=True):
            for axis in axes_of(entry):
                if axis in batch_axes and name != "experts":
                    gathered_axes.append(axis)
                else:
                    kept *= sizes[axis]
        gathered = math.prod(sizes[a] for a in gathered_axes)
        full = math.prod(value.shape) * itemsize / kept  # its size on a device once gathered
        spec_axes = {a for entry in spec for a in axes_of(entry)}
        replica_axes = batch_axes - spec_axes
        replicas = math.prod(sizes[a] for a in replica_axes)
        if tuple(path) == ("embed",):  # the token table: rows move, the table does not
            add("all-to-all", gathered_axes, 2 * tokens * m.hidden_size * itemsize * (gathered - 1) / gathered)
            vocab_axes = [a for a in axes_of(spec[0]) if a not in batch_axes]
            along = math.prod(sizes[a] for a in vocab_axes)
            param_bytes = math.prod(value.shape) * itemsize / gathered  # cast to the compute dtype first
            add("all-gather", vocab_axes, param_bytes * (along - 1) / along, times=1)
        else:
            passes = 2 if names[:1] == ["layers"] else 1  # a layer's again in its backward iteration
            add("all-gather", gathered_axes, passes * full * (gathered - 1) / gathered)
            add("reduce-scatter", gathered_axes, full * (gathered - 1) / gathered)
        add("all-reduce", replica_axes, 2 * (full / gathered) * (replicas - 1) / replicas)
    ep = math.prod(sizes[a] for a in axes_of(logical_to_spec(("experts",), sizes, rules=rules)[0]))
    if m.num_moe_layers and ep > 1:
        # Each token's hidden state to its routed experts and back (dispatch and combine), in the
        # forward pass, the remat recompute and the backward pass.
        passes = 3 if REMAT[m.remat].reruns_forward else 2
        routed = tokens * m.moe.num_experts_per_tok * m.hidden_size * itemsize * (ep - 1) / ep
        experts_axes = axes_of(logical_to_spec(("experts",), sizes, rules=rules)[0])
        add("all-to-all", experts_axes, m.num_moe_layers * 2 * passes * routed)
    tp = sizes.get("tp", 1)
    cp = math.prod(sizes[a] for a in seq_axes)
    if cp > 1:
        # Each attention layer gathers its keys and values over the sequence's devices in every
        # forward pass (the remat recompute too) and reduce-scatters their gradients.
        passes = 2 if REMAT[m.remat].reruns_forward else 1
        if m.model_type == "deepseek_v3":  # MLA: per-head keys (no-rope and rope parts) and values
            width = m.num_heads * (m.mla.qk_nope_head_dim + m.mla.qk_rope_head_dim + m.mla.v_head_dim)
        else:
            width = 2 * m.num_kv_heads * m.head_dim
        whole = tokens * cp * width * itemsize / tp  # a device's rows, the whole sequence
        add("all-gather", seq_axes, m.num_layers * passes * whole * (cp - 1) / cp)
        add("reduce-scatter", seq_axes, m.num_layers * whole * (cp - 1) / cp)
    if tp > 1:
        count = (4 + REMAT[m.remat].tp_all_reduces_again) * m.num_layers + 1
        share = 2 * (tp - 1) / tp
        add("all-reduce", ["tp"], count * share * tokens * m.hidden_size * itemsize)
        add("all-reduce", ["tp"], share * tokens * (itemsize + 2 * 4))  # the logits' max; two float32 sums
    return {"by_kind": dict(by_kind), "by_category": dict(by_category), "traffic_bytes": sum(by_kind.values())}


def link_bandwidth(row: dict, mesh, target: Target) -> float:
    """Bytes/s a device sends one collective's data at: across slices or nodes the data-centre
    network's share per chip; inside a GPU node NVLink; inside a TPU slice the links of the torus
    dimensions its group spans, two per dimension (a bidirectional ring, or a line sending both
    ways), one along a dimension of 2 chips, and one link for a collective-permute (a shift to a
    neighbour)."""
    chip = target.chip
    if row["crosses"]:
        return chip.dcn_bandwidth
    if chip.platform != "tpu" or not chip.ici_links:
        return chip.ici_bandwidth
    link = chip.ici_bandwidth / chip.ici_links
    if row["kind"] == "collective-permute":
        return link
    flat = list(mesh.devices.flat)
    coords = np.array([flat[i].coords for i in members(row, mesh)])
    extents = [len(set(coords[:, d].tolist())) for d in range(coords.shape[1])]
    return link * max(1, sum(1 if e == 2 else 2 for e in extents if e > 1))


def estimate(training: Training, target: Target, hlo: str, rows: list[dict]) -> dict:
    """The step time of the compiled program (`hlo_cost.step_time`: each instruction's FLOPs at the
    chip's peak or its HBM bytes at the chip's bandwidth, collectives at their links', overlapped as
    the schedule allows), with tokens/s and MFU (model FLOPs, as `flops_per_token` counts them)."""
    config, chip = training.config, target.chip
    seconds = {r["name"]: r["traffic"] / max(r["executions"], 1) / link_bandwidth(r, training.mesh, target)
               for r in rows}
    t = step_time(hlo, peak_flops=chip.peak_flops, hbm_bandwidth=chip.hbm_bandwidth,
                  comm_seconds=lambda name: seconds.get(name, 0.0))
    tokens = config.train.batch_size * config.train.seq_len
    model_flops = flops_per_token(config.model, config.train.seq_len) * tokens
    return {"estimate": True, "model_flops_per_step": model_flops} | t | {
        "tokens_per_s": tokens / t["step_s"], "tokens_per_s_per_chip": tokens / t["step_s"] / target.devices,
        "mfu": model_flops / (t["step_s"] * target.devices * chip.peak_flops)}


def _group_of(device, target: Target) -> int:
    """The slice (TPU) or node (GPU) a device is in."""
    if target.chip.platform == "tpu":
        return int(getattr(device, "slice_index", 0) or 0)
    return int(device.process_index)


def plan_on_target(config: Config, target: Target, devices=None) -> dict:
    """Compiles `config`'s train step for `target`: memory, verdict, communication, step estimate."""
    devices = compile_devices(target) if devices is None else devices
    m = config.model
    attention_note = None
    if target.chip.platform == "cuda" and resolve_backend(m.attention, "gpu", m.dtype, config.train.seq_len) == "cudnn":
        # JAX traces cuDNN attention only with a GPU and its cuDNN present.
        config = dataclasses.replace(config, model=dataclasses.replace(m, attention="xla"))
        attention_note = ("cuDNN attention cannot be compiled without a GPU: compiled with model.attention=xla, "
                          "whose (queries x keys) scores overstate the memory the GPUs' cudnn run needs")
    training = build_training(config, devices)
    state = training.abstract_state()
    # Resident parameters: the trained ones and a LoRA run's frozen base (no gradient, no optimizer state).
    params = shard_bytes(jax.tree.leaves(state.params)) + shard_bytes(jax.tree.leaves(training.abstract_frozen()))
    optimizer = shard_bytes(jax.tree.leaves(state.opt_state))
    start = time.perf_counter()
    compiled, oom = compile_or_oom(
        training.step.lower(training.abstract_state(), training.abstract_batch(), training.abstract_frozen()))
    seconds = time.perf_counter() - start
    chip = target.chip
    report = {"target": target.name, "chip": chip.name, "devices": target.devices, "hosts": target.hosts,
              "hbm_bytes": chip.hbm_bytes, "compile_s": seconds, "params_bytes": params,
              "optimizer_bytes": optimizer, "mesh": dict(training.mesh.shape),
              "attention": training.config.model.attention}
    if attention_note:
        report["attention_note"] = attention_note
    report["host"] = host = host_memory(training, ram_bytes=chip.host_ram_bytes, platform=chip.platform)
    if oom:
        needed, capacity = oom
        report.update(fits=False, hbm_fits=False, peak_bytes=needed, temp_bytes=None, headroom_bytes=capacity - needed,
                      hbm_bytes=capacity, checked_by="the TPU compiler (RESOURCE_EXHAUSTED)")
        return report
    mem = compiled.memory_analysis()
    peak = int(getattr(mem, "peak_memory_in_bytes", 0) or 0) or int(
        mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes + mem.temp_size_in_bytes)
    report.update(fits=peak <= chip.hbm_bytes and host["fits"], hbm_fits=peak <= chip.hbm_bytes, peak_bytes=peak,
                  temp_bytes=int(mem.temp_size_in_bytes), headroom_bytes=chip.hbm_bytes - peak,
                  checked_by="the TPU compiler" if chip.platform == "tpu" else "podtrain (peak vs the GPU's memory)")
    mesh = training.mesh
    flat = list(mesh.devices.flat)
    groups = [_group_of(d, target) for d in flat]
    grid = np.asarray(groups).reshape(mesh.devices.shape)  # the slice or node of each mesh position
    slice_axes = tuple(name for i, name in enumerate(mesh.axis_names)
                       if (grid.max(axis=i) != grid.min(axis=i)).any())
    hlo = compiled.as_text()
    found = collectives(hlo, mesh.devices.shape, mesh.axis_names,
                        num_slices=len(set(groups)) if target.chip.platform == "tpu" else 1, slice_axes=slice_axes)
    rows = as_rows(found)
    for row in rows:
        row["crosses"] = bool(row["axes"]) and len({groups[i] for i in members(row, mesh)}) > 1
    ideal = ideal_traffic(training)
    measured: dict[str, float] = defaultdict(float)
    for row in rows:
        measured[category(row["kind"], row["axes"])] += row["traffic"]
    compared = {key: {"measured": measured.get(key, 0.0), "ideal": ideal["by_category"].get(key, 0.0)}
                for key in sorted(set(measured) | set(ideal["by_category"]))}
    # A category moving more than its ideal (beyond a rounding margin): its collectives, largest first.
    over = {key for key, v in compared.items() if v["measured"] > v["ideal"] * 1.01 + _SMALL}
    unexplained = sorted((r for r in rows if category(r["kind"], r["axes"]) in over), key=lambda r: -r["traffic"])
    report["communication"] = summarize(found) | {"ideal": ideal, "by_category": compared,
                                                  "unexplained": unexplained[:12], "collectives": rows}
    report["estimate"] = estimate(training, target, hlo, rows)
    return report


def members(row: dict, mesh) -> list[int]:
    """Logical device positions along a collective's axes through position 0 (enough to tell
    whether its group leaves a slice or node: groups along the same axes are alike)."""
    names = list(mesh.axis_names)
    shape = mesh.devices.shape
    ids = np.arange(mesh.devices.size).reshape(shape)
    index = tuple(slice(None) if n in row["axes"] else 0 for n in names)
    return ids[index].ravel().tolist()


def _candidates(config: Config, target: Target, report: dict):
    """Changes that lower the memory of a step, cheapest first: more micro-batches, full remat,
    both, then the dp axis folded into fsdp (kept at one per slice). When parameters, gradients and
    optimizer state alone exceed the device's memory, only sharding them further can help."""
    t, m, mesh = config.train, config.model, config.mesh
    static = 2 * report["params_bytes"] + report["optimizer_bytes"]
    sizes = report["mesh"]
    shards = math.prod(sizes[a] for a in axes_of(logical_to_spec(("batch",), sizes, rules=config.sharding.rules)[0]))
    if static < target.chip.hbm_bytes:
        for accum in (2, 4, 8):  # each micro-batch must still give every batch shard a whole row
            if accum > t.grad_accum and t.batch_size % (accum * shards) == 0:
                yield [f"train.grad_accum={accum}"]
        if m.remat != "full":
            yield ["model.remat=full"]
            if t.batch_size % 4 == 0 and t.grad_accum < 4:
                yield ["model.remat=full", "train.grad_accum=4"]
    if mesh.dp > target.groups:
        fsdp = -1 if mesh.fsdp == -1 else mesh.fsdp * mesh.dp // target.groups
        yield [f"mesh.dp={target.groups}", f"mesh.fsdp={fsdp}"]


def find_fit(config: Config, target: Target, devices, max_compiles: int, report: dict) -> dict | None:
    """The first change from `_candidates` whose compiled step fits, trying at most `max_compiles`."""
    compiles = 0
    for overrides in _candidates(config, target, report):
        if compiles >= max_compiles:
            break
        try:
            result = plan_on_target(apply_overrides(config, overrides), target, devices)
        except ConfigError:  # not a valid config for this target (found before compiling)
            continue
        compiles += 1
        if result["hbm_fits"]:
            return {"overrides": overrides, "peak_bytes": result["peak_bytes"],
                    "headroom_bytes": result["headroom_bytes"], "compiles": compiles}
    return None


def check(config: Config, target: Target, *, suggest: bool = True, devices=None) -> dict:
    """`plan_on_target`, and when the step does not fit the devices' memory, `find_fit`'s suggestion."""
    devices = compile_devices(target) if devices is None else devices
    report = plan_on_target(config, target, devices)
    if not report["hbm_fits"] and suggest and config.plan.max_fit_compiles:
        report["suggestion"] = find_fit(config, target, devices, config.plan.max_fit_compiles, report)
    return report
