"""Bytes a compiled step moves between devices, read from its optimized HLO text.

Each collective is counted once per execution: a collective inside a `while` body runs once per
iteration, so it is multiplied by the trip counts of the loops around it (read from the loop's
`known_trip_count`, else from its counter's start, step and the bound its condition compares with). A collective's
`traffic` is what one device sends for it with a ring (or direct) algorithm on a group of `g`:
all-gather `out * (g-1)/g`, reduce-scatter `out * (g-1)`, all-reduce `2 * size * (g-1)/g`,
all-to-all `size * (g-1)/g`, collective-permute its operand from each device that sends. The TPU
compiler rewrites many FSDP all-gathers and reduce-scatters into loops of collective-permutes that
overlap with matmuls ("windowed einsums"); counted this way they move the bytes the collective they
replace would. It writes other reduce-scatters as a fusion of an all-reduce and a slice (counted as
the reduce-scatter), and on some groups (all three axes of a 3-D torus) as a plain all-reduce and a
slice (counted as the all-reduce it is).

The replica groups name logical devices: positions in `mesh.devices.flat`. A group's mesh axes are
those along which its devices' coordinates differ.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import asdict, dataclass

import numpy as np

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute", "ragged-all-to-all")
_DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
                "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_ARRAY = re.compile(r"\b(pred|[suf]\d+|bf16|c64|c128|f8e\w+)\[([0-9,]*)\]")
INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?(\S+) = (.*?) ([a-z][a-z0-9-]*)\((.*)$", re.DOTALL)
_HEADER = re.compile(r"^(ENTRY )?%?(\S+) .*\{\s*$")


@dataclass
class Collective:
    kind: str
    name: str
    shape: str
    bytes: int  # the data of one execution, per device (the gathered, reduced or exchanged arrays)
    group: int
    axes: tuple[str, ...]
    executions: int
    traffic: float  # bytes one device sends per step, all executions together
    op_name: str
    source: str


def arrays(text: str) -> list[tuple[str, tuple[int, ...]]]:
    return [(m[1], tuple(int(d) for d in m[2].split(",") if d)) for m in _ARRAY.finditer(text)]


def nbytes(arrays) -> int:
    return int(sum(math.prod(dims) * _DTYPE_BYTES.get(dtype, 1) for dtype, dims in arrays))


def _iota(spec: str) -> np.ndarray:
    """`[g...]<=[r...]T(p...)` (or `[r...]T(p...)`): iota over r, transposed by p, reshaped to g."""
    m = re.fullmatch(r"\[([0-9,]+)\](?:<=\[([0-9,]+)\])?(?:T\(([0-9,]+)\))?", spec.strip())
    if not m:
        raise ValueError(f"unrecognised iota {spec!r}")
    shape = [int(x) for x in m[1].split(",")]
    source = [int(x) for x in m[2].split(",")] if m[2] else shape
    ids = np.arange(math.prod(source)).reshape(source)
    if m[3]:
        ids = ids.transpose([int(x) for x in m[3].split(",")])
    return ids.reshape(shape)


def replica_groups(attrs: str, num_devices: int) -> list[list[int]] | None:
    """The groups of a collective's `replica_groups` (explicit, iota or mesh form); None without."""
    if m := re.search(r"replica_groups=\{(\{[0-9,{} ]*\})\}", attrs):
        return [[int(x) for x in g.split(",") if x.strip()] for g in re.findall(r"\{([0-9, ]*)\}", m[1])]
    if m := re.search(r"replica_groups=(\[[0-9,]+\](?:<=\[[0-9,]+\])?(?:T\([0-9,]+\))?)", attrs):
        return _iota(m[1]).tolist()
    if m := re.search(r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\(([^)]*\)?)\))?\s*(\{[^}]*\})?", attrs):
        axes = re.findall(r"'([^']+)'=(\d+)", m[1])
        names, sizes = [a for a, _ in axes], [int(s) for _, s in axes]
        ids = _iota(m[2]) if m[2] else np.arange(math.prod(sizes))
        ids = ids.reshape(sizes)
        chosen = re.findall(r"'([^']+)'", m[3]) if m[3] else names
        inner = [names.index(a) for a in chosen]
        outer = [i for i in range(len(names)) if i not in inner]
        size = math.prod(sizes[i] for i in inner)
        return ids.transpose(outer + inner).reshape(-1, size).tolist()
    if "replica_groups={}" in attrs or "replica_groups" not in attrs:
        return [list(range(num_devices))]
    return None


def _axes(ids: list[int], mesh_shape: tuple[int, ...], axis_names: tuple[str, ...]) -> tuple[str, ...]:
    coords = np.array(np.unravel_index(np.asarray(ids), mesh_shape)).T
    return tuple(name for i, name in enumerate(axis_names) if len(set(coords[:, i].tolist())) > 1)


def _tables(hlo: str) -> dict[str, dict[int, str]]:
    """The HLO text's source tables (FileNames, FunctionNames, FileLocations, StackFrames) by id."""
    tables: dict[str, dict[int, str]] = {}
    current = None
    for line in hlo.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            current = tables.setdefault(line, {})
        elif current is not None and (m := re.match(r"^(\d+) (.*)$", line)):
            current[int(m[1])] = m[2]
        elif line.startswith(("HloModule", "%", "ENTRY")) or not line.strip():
            current = None
    return tables


def _source(frame: int, tables: dict[str, dict[int, str]]) -> str:
    """`file:line (function)` of the innermost frame of `frame` outside JAX and other libraries."""
    frames, locations = tables.get("StackFrames", {}), tables.get("FileLocations", {})
    files, functions = tables.get("FileNames", {}), tables.get("FunctionNames", {})
    seen = set()
    while frame in frames and frame not in seen:
        seen.add(frame)
        f = dict(re.findall(r"(\w+)=(\d+)", frames[frame]))
        loc = dict(re.findall(r"(\w+)=(\d+)", locations.get(int(f.get("file_location_id", 0)), "")))
        path = files.get(int(loc.get("file_name_id", 0)), "").strip('"')
        if path and "site-packages" not in path and "/jax/" not in path:
            name = functions.get(int(loc.get("function_name_id", 0)), "").strip('"')
            return f"{'/'.join(path.split('/')[-2:])}:{loc.get('line')} ({name})"
        frame = int(f.get("parent_frame_id", frame))
    return ""


def computations_of(hlo: str) -> tuple[dict[str, list[str]], str]:
    computations: dict[str, list[str]] = {}
    entry, current = "", None
    for line in hlo.splitlines():
        if current is None:
            if (m := _HEADER.match(line)) and "=" not in line.split("(")[0]:
                current = m[2]
                computations[current] = []
                if m[1]:
                    entry = current
        elif line.rstrip() == "}":
            current = None
        elif line[:1].isspace() or not computations[current]:
            computations[current].append(line)
        else:  # an attribute string with line breaks (a Pallas kernel's metadata) goes on
            computations[current][-1] += "\n" + line
    return computations, entry


def instructions(computations: dict[str, list[str]]):
    """(computation name, instruction match) of every instruction: groups 1 name, 2 shape, 3 opcode,
    4 operands and attributes."""
    for name, lines in computations.items():
        for line in lines:
            if m := INSTRUCTION.match(line):
                yield name, m


def operand_names(rest: str) -> list[str]:
    """The operand names of an instruction, from the text after its opcode's parenthesis."""
    return re.findall(r"%([^\s,()]+)", rest.split(")")[0])


def trip_count(attrs: str, computations: dict[str, list[str]], defs: dict) -> int | None:
    """A while loop's trip count: its `known_trip_count`, else ceil((bound - start) / step) from its
    condition's `counter < bound`, its body's `counter + step` and its initial tuple's `start`.

    (The TPU compiler unrolls windowed-einsum loops, stepping the counter by 2, and gives them no
    known_trip_count: the bound alone would count them twice.) `defs` maps every instruction name
    of the module (unique in HLO) to its parsed line.
    """
    if m := re.search(r'"known_trip_count":\{"n":"(\d+)"', attrs):
        return int(m[1])
    cond, body = (re.search(rf"{key}=%?([^\s,]+)", attrs) for key in ("condition", "body"))
    if not cond or not body:
        return None

    def value(name, depth=0):
        """("const", v), ("counter", tuple index), ("step", tuple index, v), or None."""
        m = defs.get(name)
        if m is None or depth > 16:
            return None
        if m[3] == "constant":
            c = re.match(r"(-?\d+)\)", m[4])
            return ("const", int(c[1])) if c else None
        if m[3] in ("copy", "convert", "bitcast"):
            operands = operand_names(m[4])
            return value(operands[0], depth + 1) if operands else None
        if m[3] == "get-tuple-element":
            return ("counter", int(re.search(r"index=(\d+)", m[4])[1]))
        if m[3] == "add":
            terms = [value(o, depth + 1) for o in operand_names(m[4])[:2]]
            kinds = sorted(t[0] for t in terms if t)
            if kinds == ["const", "counter"]:
                counter, const = sorted(terms, key=lambda t: t[0] != "counter")
                return ("step", counter[1], const[1])
        return None

    compare = next((m for line in computations.get(cond[1], [])
                    if (m := INSTRUCTION.match(line)) and m[3] == "compare"), None)
    direction = re.search(r"direction=(\w+)", compare[4]) if compare else None
    counter, bound = (value(o) for o in operand_names(compare[4])[:2]) if compare else (None, None)
    direction = direction[1] if direction else None
    if bound and bound[0] == "counter":  # `bound > counter` is `counter < bound`
        counter, bound, direction = bound, counter, {"GT": "LT", "GE": "LE", "NE": "NE"}.get(direction)
    if direction not in ("LT", "LE", "NE") or not (counter and bound and counter[0] == "counter"
                                                   and bound[0] == "const"):
        return None
    index, bound = counter[1], bound[1] + (direction == "LE")
    root = next((m for line in computations.get(body[1], [])
                 if line.lstrip().startswith("ROOT") and (m := INSTRUCTION.match(line))), None)
    next_value = operand_names(root[4]) if root is not None and root[3] == "tuple" else []
    step = value(next_value[index]) if index < len(next_value) else None
    step = step[2] if step and step[0] == "step" and step[1] == index and step[2] > 0 else 1
    initial = defs.get((operand_names(attrs) or [""])[0])
    starts = operand_names(initial[4]) if initial is not None and initial[3] == "tuple" else []
    start = value(starts[index]) if index < len(starts) else None
    start = start[1] if start and start[0] == "const" else 0
    return max(0, math.ceil((bound - start) / step))


def multipliers(computations: dict[str, list[str]], entry: str) -> tuple[dict[str, int], list[str]]:
    """How many times each computation runs per step (loop bodies by their trip counts)."""
    calls: dict[str, list[tuple[str, int]]] = defaultdict(list)  # callee -> (caller, times per call)
    unknown = []
    defs = {m[1]: m for _, m in instructions(computations)}
    for name, m in instructions(computations):
        rest = m[4]
        if m[3] == "while":
            body = re.search(r"body=%?([^\s,]+)", rest)
            trips = trip_count(rest, computations, defs)
            if trips is None:
                unknown.append(m[1])
            calls[body[1]].append((name, 1 if trips is None else trips))
            continue
        for callee in re.findall(r"(?:calls|true_computation|false_computation)=%?([^\s,}]+)", rest):
            calls[callee].append((name, 1))
        for group in re.findall(r"branch_computations=\{([^}]*)\}", rest):
            for callee in re.findall(r"%?([^\s,]+)", group):
                calls[callee].append((name, 1))
    memo: dict[str, int] = {entry: 1}

    def times(name: str, depth: int = 0) -> int:
        if name not in memo:
            memo[name] = 0 if depth > 64 else sum(n * times(caller, depth + 1) for caller, n in calls.get(name, []))
        return memo[name]

    return {name: times(name) for name in computations}, unknown


def chain_of(attrs: str) -> str | None:
    """The chain of a collective the TPU compiler's asynchronous collective fusion
    (`--xla_tpu_enable_async_collective_fusion`) splits into an `async-collective-start` fusion,
    continuation fusions beside other work and an `async-collective-done` fusion, each holding a
    copy of the collective: the copies share a `chain_id` and move its bytes once."""
    m = re.search(r'chain_id="(\d+)"', attrs)
    return m[1] if m else None


def collectives(hlo: str, mesh_shape: tuple[int, ...], axis_names: tuple[str, ...], *,
                num_slices: int = 1, slice_axes: tuple[str, ...] = ()) -> list[Collective]:
    """Every collective of the optimized HLO `hlo` with its bytes, group, mesh axes and executions.

    Between TPU slices the compiler sends data over the data-centre network with `send`s to the
    MegaScale runtime (`_xla_megascale_transfer_type`): each is counted as that collective over the
    `num_slices` slices, along `slice_axes` (the mesh axes that span slices)."""
    computations, entry = computations_of(hlo)
    times, _ = multipliers(computations, entry)
    tables = _tables(hlo)
    callers = {}  # a fused computation -> the attributes of the fusion calling it (its op name, source)
    for _, m in instructions(computations):
        if m[3] == "fusion" and (c := re.search(r"calls=%?([^\s,]+)", m[4])):
            callers[c[1]] = m[4]
    num_devices = math.prod(mesh_shape)
    found, chains = [], set()
    for comp, m in instructions(computations):
        dcn = re.search(r'_xla_megascale_transfer_type="(\w+)"', m[4]) if m[3] == "send" else None
        if dcn:
            found.append(_megascale(m, dcn[1], num_slices, slice_axes, times.get(comp, 1), tables))
            continue
        if m[3].removesuffix("-start") not in KINDS:
            continue
        if (chain := chain_of(m[4])) is not None:  # one collective split over a start, continuations and a done
            if chain in chains:
                continue
            chains.add(chain)
        kind, shape, rest = m[3].removesuffix("-start"), m[2], m[4]
        # The TPU compiler writes a reduce-scatter as a fusion of an all-reduce and a slice (a
        # computation named all-reduce-scatter...): it moves what a reduce-scatter does.
        fused_scatter = kind == "all-reduce" and comp.startswith("all-reduce-scatter")
        data = arrays(shape)
        if m[3].endswith("-start"):
            data = [a for a in data if a[0] != "u32" or a[1]]  # drop the async context scalars
            if kind != "all-reduce" and len(data) > 1:  # (operands..., outputs...): the outputs
                data = data[len(data) // 2:]
        size = nbytes(data)
        if kind == "collective-permute":
            listed = rest.split("source_target_pairs=")[1].split("}}")[0] + "}"
            pairs = [(int(a), int(b)) for a, b in re.findall(r"\{(\d+),(\d+)\}", listed)]
            senders = sorted({s for s, t in pairs if s != t})
            ids = sorted({i for p in pairs if p[0] != p[1] for i in p})
            group, share = len(ids), len(senders) / num_devices
            moved = {a for src, dst in pairs if src != dst for a in _axes([src, dst], mesh_shape, axis_names)}
            axes = tuple(a for a in axis_names if a in moved)  # the axes a pair's ends differ along
            per_run = size * share
        else:
            groups = replica_groups(rest, num_devices) or [list(range(num_devices))]
            group = len(groups[0])
            axes = _axes(groups[0], mesh_shape, axis_names)
            fraction = (group - 1) / group if group else 0.0
            if fused_scatter:
                kind, size = "reduce-scatter", size // group
            per_run = {"all-gather": size * fraction, "reduce-scatter": size * (group - 1),
                       "all-reduce": 2 * size * fraction}.get(kind, size * fraction)
        where = callers.get(comp, rest) if fused_scatter else rest
        op_name = re.search(r'op_name="([^"]*)"', where)
        frame = re.search(r"stack_frame_id=(\d+)", where)
        executions = times.get(comp, 1)
        found.append(Collective(
            kind=kind, name=m[1], shape=" ".join(f"{d}[{','.join(map(str, s))}]" for d, s in data),
            bytes=size, group=group, axes=axes, executions=executions, traffic=per_run * executions,
            op_name=op_name[1] if op_name else "",
            source=_source(int(frame[1]), tables) if frame else ""))
    return found


def _megascale(m, transfer: str, num_slices: int, slice_axes, executions: int, tables) -> Collective:
    kind = transfer.lower().replace("_", "-")
    data = [a for a in arrays(m[2]) if a[0] != "u32" or a[1]][:1]  # (data, context, token)
    size = nbytes(data)
    g = max(num_slices, 1)
    per_run = {"all-reduce": 2 * size * (g - 1) / g, "reduce-scatter": size * (g - 1)}.get(kind, size * (g - 1) / g)
    op_name = re.search(r'op_name="([^"]*)"', m[4])
    frame = re.search(r"stack_frame_id=(\d+)", m[4])
    return Collective(kind=kind, name=m[1], shape=" ".join(f"{d}[{','.join(map(str, s))}]" for d, s in data),
                      bytes=size, group=g, axes=tuple(slice_axes), executions=executions,
                      traffic=per_run * executions, op_name=op_name[1] if op_name else "",
                      source=_source(int(frame[1]), tables) if frame else "")


def summarize(found: list[Collective]) -> dict:
    """Traffic per device per step by kind and by mesh axes, with op and execution counts."""
    by_kind: dict[str, dict] = {}
    by_axes: dict[str, float] = defaultdict(float)
    for c in found:
        entry = by_kind.setdefault(c.kind, {"ops": 0, "executions": 0, "traffic_bytes": 0.0})
        entry["ops"] += 1
        entry["executions"] += c.executions
        entry["traffic_bytes"] += c.traffic
        by_axes["+".join(c.axes) or "(none)"] += c.traffic
    return {"by_kind": by_kind, "by_axes": dict(by_axes),
            "traffic_bytes": sum(c.traffic for c in found)}


def as_rows(found: list[Collective]) -> list[dict]:
    return [asdict(c) | {"axes": list(c.axes)} for c in found]
