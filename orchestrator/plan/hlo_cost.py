"""What a compiled step costs, read from its optimized HLO: the FLOPs and HBM bytes of every
instruction, each loop body counted once per iteration, and a step time that walks the compiled
schedule.

Per instruction outside fused computations (a fusion counts as one, with the work inside it):
- FLOPs: a `dot` is 2 x its output elements x its contracted size; a `convolution` (how the TPU
  compiler writes most matmuls) 2 x its input features x the (input, window) positions it pairs;
  elementwise and reduction ops one per element; a cuBLAS call as a `dot`; a Pallas kernel what
  its cost estimate says.
  Splash attention carries none: its calls count the causal blocks of their block grid, 2 matmuls
  in the forward kernel, 3 in `dq` and 4 in `dkv`, each 2 x heads x queries x keys x head_dim.
- HBM bytes: what a fusion reads and writes, its operands and results; an operand that is only
  dynamically sliced counts the slices, a buffer updated in place counts the update; arrays in
  on-chip memory (layout `S(n)`, n > 0) count nothing. Collectives move their bytes over links,
  not here.
- Time: the larger of FLOPs at the chip's peak and bytes at its HBM bandwidth (a roofline per
  instruction), summed in schedule order. A collective takes its bytes over the links of its group
  (`comm_seconds`). An asynchronous one (`*-start` ... `*-done`, a DCN `send`) runs under the
  instructions scheduled between its start and its done, one at a time in the order they started;
  the part not hidden is waited for at its done; so does one the TPU compiler's asynchronous
  collective fusion splits over fusions (`hlo_comm.chain_of`), from its first part to its
  `async-collective-done`. A synchronous one is waited for whole. An
  asynchronous copy between HBM and on-chip memory (`copy-start` ... `copy-done`) runs the same
  way, at the HBM bandwidth.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from podtrain.orchestrator.plan.hlo_comm import (
    INSTRUCTION,
    KINDS,
    arrays,
    chain_of,
    computations_of,
    multipliers,
    nbytes,
    operand_names,
    trip_count,
)

ELEMENTWISE = frozenset((
    "add", "subtract", "multiply", "divide", "maximum", "minimum", "negate", "abs", "exponential",
    "exponential-minus-one", "log", "log-plus-one", "tanh", "logistic", "rsqrt", "sqrt", "cbrt", "power",
    "sine", "cosine", "select", "compare", "clamp", "and", "or", "xor", "not", "floor", "ceil",
    "round-nearest-even", "round-nearest-afz", "sign", "atan2", "remainder", "erf", "is-finite"))
# Instructions that move no data of their own: views, tuples, control flow (its bodies count).
_FREE = frozenset(("parameter", "get-tuple-element", "tuple", "bitcast", "constant", "while", "call",
                   "conditional", "after-all", "partition-id", "replica-id", "iota", "opt-barrier",
                   "add-dependency", "recv", "recv-done", "copy-done", "send-done", "domain"))
_SPLASH_MATMULS = (("dkv", 4), ("dq", 3), ("fwd", 2))
_ON_CHIP = re.compile(r"S\(([1-9]\d*)\)")


@dataclass
class Op:
    """One scheduled instruction's cost for one execution."""

    name: str
    opcode: str
    flops: float = 0.0
    bytes: float = 0.0
    collectives: list[str] = field(default_factory=list)  # synchronous collectives inside a fusion


def _placed(shape: str) -> list[tuple[str, tuple[int, ...], bool]]:
    """(dtype, dims, on chip) of each array of a shape string."""
    return [(m[1], tuple(int(d) for d in m[2].split(",") if d), bool(m[3] and _ON_CHIP.search(m[3])))
            for m in re.finditer(r"\b(pred|[suf]\d+|bf16|c64|c128|f8e\w+)\[([0-9,]*)\](\{[^}]*\})?", shape)]


def _dims(shape: str) -> list[tuple[str, tuple[int, ...]]]:
    """Arrays of a shape string, leaving out those in on-chip memory spaces."""
    return [(dtype, dims) for dtype, dims, on_chip in _placed(shape) if not on_chip]


def _elements(shape: str) -> int:
    return sum(math.prod(d) for _, d in arrays(shape))


def _matmul_flops(m, defs) -> float:
    """FLOPs of a `dot` or `convolution` instruction match `m`."""
    out = _elements(m[2])
    operands = operand_names(m[4])
    if m[3] == "dot":
        lhs = defs.get(operands[0]) if operands else None
        dims = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", m[4])
        if lhs is None or not dims:
            return 0.0
        shape = arrays(lhs[2])[0][1]
        return 2.0 * out * math.prod(shape[int(i)] for i in dims[1].split(",") if i)
    lhs, rhs = (defs.get(o) for o in operands[:2]) if len(operands) > 1 else (None, None)
    labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", m[4])
    if lhs is None or rhs is None or not labels:
        return 0.0
    shapes = {"lhs": arrays(lhs[2])[0][1], "rhs": arrays(rhs[2])[0][1], "out": arrays(m[2])[0][1]}
    size = {side: dict(zip(labels[i], shapes[side], strict=True)) for i, side in ((1, "lhs"), (2, "rhs"), (3, "out"))}
    # A spatial dimension d (window w over input i into output o) pairs at most min(i, o) * w
    # positions: the compiler also writes batch-like dimensions as windows over padding.
    spatial = [d for d in labels[3] if d.isdigit()]
    pairs = math.prod(min(size["lhs"][d], size["out"][d]) * size["rhs"][d] for d in spatial)
    rows = out // max(math.prod(size["out"][d] for d in spatial), 1)
    return 2.0 * rows * size["rhs"]["i"] * pairs


def _kernel_flops(m, defs) -> float:
    """FLOPs of a custom call: a cuBLAS matmul's as a `dot`'s; a Pallas kernel's cost estimate, or
    for splash attention its causal blocks."""
    if "cublas" in m[4] and (dims := re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', m[4])):
        operands = operand_names(m[4])
        lhs = defs.get(operands[0]) if operands else None
        if lhs is None:
            return 0.0
        shape = arrays(lhs[2])[0][1]
        return 2.0 * math.prod(arrays(m[2])[0][1]) * math.prod(shape[int(i)] for i in re.findall(r"\d+", dims[1]))
    if c := re.search(r'"cost_estimate":\{[^}]*"flops":"?(\d+)', m[4]):
        return float(c[1])
    name = m[1]
    if not name.startswith("splash"):
        return 0.0
    constraints = re.search(r"operand_layout_constraints=\{(.*?)\}, (?:frontend|metadata|backend)", m[4], re.DOTALL)
    shapes = arrays(constraints[1]) if constraints else []
    four = [d for t, d in shapes if len(d) == 4 and t.startswith(("f", "bf"))]
    grid = next((d for t, d in shapes if t == "s8" and len(d) == 3), None)
    if len(four) < 2:
        return 0.0
    (batch, heads, queries, head_dim), keys = four[0], four[1][2]
    nq, nk = (grid[1], grid[2]) if grid else (1, 1)
    visited = sum(min(nk, math.ceil((i + 1) * nk / nq)) for i in range(nq)) / (nq * nk)
    matmuls = next((n for key, n in _SPLASH_MATMULS if f"_{key}_" in name or name.endswith(f"_{key}")), 0)
    return matmuls * 2.0 * batch * heads * queries * keys * head_dim * visited


def _flops(m, defs) -> float:
    """FLOPs of one instruction match `m` (a fusion's are its computation's)."""
    if m[3] in ("dot", "convolution"):
        return _matmul_flops(m, defs)
    if m[3] in ELEMENTWISE:
        return float(_elements(m[2]))
    if m[3] == "reduce":
        operands = operand_names(m[4])
        return float(_elements(defs[operands[0]][2])) if operands and operands[0] in defs else 0.0
    if m[3] == "custom-call":
        return _kernel_flops(m, defs)
    return 0.0


def _fused_flops(comp: str, parsed, defs, seen=()) -> float:
    total = 0.0
    for m in parsed.get(comp, []):
        if m[3] == "fusion" and (c := re.search(r"calls=%?([^\s,]+)", m[4])) and c[1] not in seen:
            total += _fused_flops(c[1], parsed, defs, (*seen, c[1]))
        else:
            total += _flops(m, defs)
    return total


def _parsed(computations) -> dict[str, list]:
    """Each instruction's match (`INSTRUCTION`: name, shape, opcode, rest), by computation."""
    return {name: [x for line in lines if (x := INSTRUCTION.match(line))] for name, lines in computations.items()}


def _fusion_bytes(m, callee: str, parsed, defs) -> float:
    """HBM bytes a fusion reads and writes: each operand whole, or its dynamic slices when the
    fusion only slices it; nothing for the buffer a dynamic-update-slice result writes into, whose
    update is written instead of the whole result."""
    lines = parsed.get(callee, [])
    local = {x[1]: x for x in lines}
    params = {int(re.match(r"(\d+)", x[4])[1]): x[1] for x in lines if x[3] == "parameter"}
    root = next((x for x in lines if x[0].lstrip().startswith("ROOT")), None)
    results = [local.get(o) for o in operand_names(root[4])] if root and root[3] == "tuple" else [root]
    total, in_place = 0.0, set()
    for r in results:
        if r is None:
            continue
        if r[3] == "dynamic-update-slice":
            buffer, update = operand_names(r[4])[:2]
            in_place.add(buffer)
            total += nbytes(_dims(local[update][2])) if update in local else 0
        else:
            total += nbytes(_dims(r[2]))
    for index, name in enumerate(operand_names(m[4])):
        param = params.get(index)
        if name not in defs or param is None or param in in_place:
            continue
        total += _read(callee, param, parsed, nbytes(_dims(defs[name][2])))
    return total


def _read(comp: str, param: str, parsed, whole: float, depth: int = 0) -> float:
    """Bytes a fused computation reads of its parameter `param`: the slices when every use of it
    (through bitcasts and nested fusions) is a dynamic-slice, else the whole array."""
    users = [x for x in parsed.get(comp, []) if param in operand_names(x[4])]
    if not users or depth > 8:
        return whole
    total = 0.0
    for x in users:
        operands = operand_names(x[4])
        if x[3] == "dynamic-slice" and operands[0] == param:
            total += nbytes(_dims(x[2]))
        elif x[3] == "bitcast":
            total += _read(comp, x[1], parsed, whole, depth + 1)
        elif x[3] == "fusion" and (callee := re.search(r"calls=%?([^\s,]+)", x[4])):
            index = operands.index(param)
            inner = next((y[1] for y in parsed.get(callee[1], [])
                          if y[3] == "parameter" and re.match(rf"{index}\)", y[4])), None)
            total += _read(callee[1], inner, parsed, whole, depth + 1) if inner else whole
        else:
            return whole
    return min(total, whole)


def op_costs(hlo: str):
    """(computations, entry, multipliers, instructions by name, {computation: [Op in schedule
    order]}): the cost of every instruction outside fused computations, for one execution."""
    computations, entry = computations_of(hlo)
    times, _ = multipliers(computations, entry)
    parsed = _parsed(computations)
    every = [(comp, m) for comp, found in parsed.items() for m in found]
    defs = {m[1]: m for _, m in every}
    fused = {c[1] for _, m in every if m[3] == "fusion" and (c := re.search(r"calls=%?([^\s,]+)", m[4]))}
    ops: dict[str, list[Op]] = {}
    for comp, m in every:
        if comp in fused:
            continue
        opcode = m[3]
        op = Op(m[1], opcode)
        if opcode == "fusion":
            callee = re.search(r"calls=%?([^\s,]+)", m[4])[1]
            op.flops = _fused_flops(callee, parsed, defs)
            op.bytes = _fusion_bytes(m, callee, parsed, defs)
            op.collectives = [x[1] for x in parsed.get(callee, []) if x[3] in KINDS]
        elif opcode == "async-start":  # a collective wrapped to run asynchronously
            callee = re.search(r"calls=%?([^\s,]+)", m[4])
            op.collectives = [x[1] for x in parsed.get(callee[1], []) if x[3] in KINDS] if callee else []
        elif opcode in _FREE or opcode.removesuffix("-start").removesuffix("-done") in KINDS \
                or opcode in ("send", "async-update", "async-done"):
            pass
        elif opcode == "copy-start":  # (destination, source, context): reads the source, writes the destination
            destination = _placed(m[2])[:1]
            op.bytes = sum(nbytes([(t, d)]) for t, d, on_chip in destination if not on_chip) + sum(
                nbytes(_dims(defs[o][2])) for o in operand_names(m[4]) if o in defs)
        elif opcode == "dynamic-slice":
            op.bytes = 2 * nbytes(_dims(m[2]))
        elif opcode == "dynamic-update-slice":
            ops_ = operand_names(m[4])
            op.bytes = 2 * nbytes(_dims(defs[ops_[1]][2])) if len(ops_) > 1 and ops_[1] in defs else 0
        else:  # matmuls, kernels, copies and other unfused ops: read the operands, write the result
            op.flops = _flops(m, defs)
            op.bytes = nbytes(_dims(m[2])) + sum(nbytes(_dims(defs[o][2])) for o in operand_names(m[4]) if o in defs)
        ops.setdefault(comp, []).append(op)
    return computations, entry, times, defs, ops


def step_time(hlo: str, *, peak_flops: float, hbm_bandwidth: float,
              comm_seconds: Callable[[str], float]) -> dict:
    """A step's time from the schedule (see the module's docstring), and its parts per step:
    FLOPs, HBM bytes, compute-bound and HBM-bound seconds, collective seconds, and how much of the
    collectives' time was not hidden under other work (`exposed_s`)."""
    computations, entry, times, defs, ops = op_costs(hlo)
    totals = {"flops": 0.0, "hbm_bytes": 0.0, "compute_s": 0.0, "hbm_s": 0.0, "comm_s": 0.0, "exposed_s": 0.0}
    memo: dict[str, float] = {}
    conditions: dict[str, int] = {}
    chained: dict[str, list[str]] = {}  # chain -> its collectives (the copies of one collective)
    for name, m in defs.items():
        if m[3] in KINDS and (chain := chain_of(m[4])) is not None:
            chained.setdefault(chain, []).append(name)

    def walk(comp: str, depth: int = 0) -> float:
        """Seconds of one run of `comp`; adds each instruction's per-step share to `totals`."""
        if comp in memo or depth > 64:
            return memo.get(comp, 0.0)
        runs = times.get(comp) or conditions.get(comp, 1)
        clock, in_flight = 0.0, {}  # start instruction -> [seconds still to go, the part waiting for it counts as]
        for op in ops.get(comp, []):
            m = defs[op.name]
            if op.opcode == "while":
                body = re.search(r"body=%?([^\s,]+)", m[4])[1]
                cond = re.search(r"condition=%?([^\s,]+)", m[4])[1]
                trips = trip_count(m[4], computations, defs) or 1
                conditions[cond] = trips * runs  # not among `times`, which counts bodies
                clock += trips * (walk(body, depth + 1) + walk(cond, depth + 1))
                continue
            if op.opcode in ("call", "conditional"):
                callees = re.findall(r"(?:to_apply|calls|true_computation|false_computation)=%?([^\s,}]+)", m[4])
                for group in re.findall(r"branch_computations=\{([^}]*)\}", m[4]):
                    callees += re.findall(r"%?([^\s,]+)", group)
                seconds = [walk(c, depth + 1) for c in callees]
                clock += (max(seconds) if op.opcode == "conditional" else sum(seconds)) if seconds else 0.0
                continue
            base = op.opcode.removesuffix("-start")
            if (op.opcode.endswith("-start") and base in KINDS) or op.opcode in ("send", "async-start"):
                seconds = comm_seconds(op.name) + sum(comm_seconds(c) for c in op.collectives)
                totals["comm_s"] += seconds * runs
                in_flight[op.name] = [seconds, "exposed_s"]
                continue
            if op.opcode == "copy-start":  # an asynchronous copy between HBM and on-chip memory
                totals["hbm_bytes"] += op.bytes * runs
                in_flight[op.name] = [op.bytes / hbm_bandwidth, "hbm_s"]
                continue
            if op.opcode.endswith("-done") or op.opcode in ("send-done", "async-done"):
                start = operand_names(m[4])[0] if operand_names(m[4]) else ""
                waited, part = in_flight.pop(start, [0.0, "exposed_s"])
                clock += waited
                totals[part] += waited * runs
                continue
            chain_by_part = {c: chain_of(defs[c][4]) for c in op.collectives}
            for chain in set(chain_by_part.values()) - {None}:
                if chain not in in_flight:  # the chain's start: its collective runs under what follows
                    seconds = sum(comm_seconds(c) for c in chained.get(chain, ()))
                    totals["comm_s"] += seconds * runs
                    in_flight[chain] = [seconds, "exposed_s"]
                if op.name.startswith("async-collective-done"):
                    waited, part = in_flight.pop(chain)
                    clock += waited
                    totals[part] += waited * runs
            plain = [c for c, chain in chain_by_part.items() if chain is None]
            if op.opcode in KINDS or plain:
                seconds = comm_seconds(op.name) + sum(comm_seconds(c) for c in plain)
                totals["comm_s"] += seconds * runs
                totals["exposed_s"] += seconds * runs
                clock += seconds
            compute, memory = op.flops / peak_flops, op.bytes / hbm_bandwidth
            totals["flops"] += op.flops * runs
            totals["hbm_bytes"] += op.bytes * runs
            totals["compute_s" if compute >= memory else "hbm_s"] += max(compute, memory) * runs
            spent = max(compute, memory)
            clock += spent
            for left in in_flight.values():  # transfers in flight progress under this work, first started first
                used = min(spent, left[0])
                left[0] -= used
                spent -= used
                if spent <= 0:
                    break
        for waited, part in in_flight.values():  # transfers never waited for inside this computation
            clock += waited
            totals[part] += waited * runs
        memo[comp] = clock
        return clock

    step = walk(entry)
    parts = {"compute": totals["compute_s"], "HBM bandwidth": totals["hbm_s"], "communication": totals["exposed_s"]}
    return totals | {"step_s": step, "bound_by": max(parts, key=parts.get)}
