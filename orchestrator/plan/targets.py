"""The machines a run can target: target names (`v5p-128`, `2xv5p-64`, `4xh100x8`) over the chips of
`common.chips`, and compile-only devices of a target (TPU through libtpu, CUDA through XLA's GPU
compiler), so that the real train step compiles for it on any machine.

A target names what `cluster.kind=tpu|gpu` reserves: TPU slices by their GCP type (v4 and v5p types
count TensorCores, two per chip; v5e and v6e count chips), optionally `<n>x` slices; GPU nodes as
`[<nodes>x]<gpu>x<gpus per node>`.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass

from podtrain.orchestrator.common.chips import CHIPS, Chip
from podtrain.orchestrator.common.errors import ConfigError
from podtrain.orchestrator.common.platforms import register_cuda_compiler

AOT_INSTALL = "pip install 'podtrain[aot]'"


# TPU generations whose type names count TensorCores (two per chip); the others count chips.
_CORES_NAMED = ("v2", "v3", "v4", "v5p")
_TWO_D = ("v2", "v3", "v5e", "v5litepod", "v6e")  # 2-D tori (v4 and v5p are 3-D)
# Names Ray's TPU support does not take, as it spells them (GCP calls v5e slices `v5litepod-N`).
_RAY_VERSIONS = {"v5e": "v5litepod"}


def tpu_chips(tpu_type: str) -> int:
    version, _, count = tpu_type.lower().partition("-")
    return int(count) // 2 if version in _CORES_NAMED else int(count)


def ray_tpu_version(tpu_type: str) -> str:
    """The TPU generation of `tpu_type` as Ray names it (`v5e-16` -> `v5litepod`)."""
    version = tpu_type.lower().partition("-")[0]
    return _RAY_VERSIONS.get(version, version)


def tpu_topology(tpu_type: str) -> str:
    """The default topology of a TPU type: `v4-8` -> 2x2x1, `v5p-64` -> 2x4x4, `v6e-16` -> 4x4."""
    version = tpu_type.lower().partition("-")[0]
    chips = tpu_chips(tpu_type)
    if chips < 1 or chips & (chips - 1):
        raise ValueError(f"cluster.tpu_type={tpu_type!r}: expected a power-of-two chip count, found {chips}")
    dims = [1, 1] if version in _TWO_D else [1, 1, 1]
    while math.prod(dims) < chips:  # double the smallest dimension, keeping the shape balanced
        dims[dims.index(min(dims))] *= 2
    return "x".join(map(str, sorted(dims, key=lambda d: (d == 1, d))))  # GCP's order: 2x2x1, 2x4x4, 4x8


@dataclass(frozen=True)
class Target:
    """What a run will be compiled for: `groups` slices (TPU) or nodes (GPU) of `per_group` devices."""

    name: str
    chip: Chip
    groups: int
    per_group: int
    topology: str  # TPU: the slice's chip grid, e.g. 4x4x4; GPU: "<nodes> nodes x <gpus>"

    @property
    def devices(self) -> int:
        return self.groups * self.per_group

    @property
    def hosts(self) -> int:
        return self.groups * max(1, self.per_group // self.chip.chips_per_host)


EXAMPLES = ("v4-32", "v5e-16", "v5p-128", "v6e-256", "2xv5p-64", "h100x8", "4xh100x8", "h200x8", "a100-80gbx8")
_TPU = re.compile(r"^(?:(\d+)x)?(v4|v5e|v5litepod|v5p|v6e)-(\d+)$")
_GPU = re.compile(r"^(?:(\d+)x)?(" + "|".join(n for n, c in CHIPS.items() if c.platform == "cuda") + r")x(\d+)$")


def known_targets() -> str:
    tpus = ", ".join(n for n, c in CHIPS.items() if c.platform == "tpu")
    gpus = ", ".join(n for n, c in CHIPS.items() if c.platform == "cuda")
    return (f"TPU slices [<n>x]<generation>-<size> with generation one of {tpus} (e.g. v5p-128, 2xv5p-64); "
            f"GPU nodes [<nodes>x]<gpu>x<gpus per node> with gpu one of {gpus} (e.g. h100x8, 4xh100x8)")


def parse_target(name: str, key: str = "--target") -> Target:
    """A target from its name; ConfigError listing the known kinds for anything else."""
    text = name.strip().lower()
    if m := _TPU.match(text):
        groups, generation, size = int(m[1] or 1), m[2], m[3]
        generation = "v5e" if generation == "v5litepod" else generation
        chip = CHIPS[generation]
        try:
            topology = tpu_topology(f"{generation}-{size}")
        except ValueError:
            topology = ""
        chips = tpu_chips(f"{generation}-{size}")
        if not topology or chips < 1:
            counts = "TensorCores, 2 per chip" if generation in _CORES_NAMED else "chips"
            raise ConfigError(f"{key}={name}: {generation}-{size} is not a TPU slice (expected a power-of-two size; "
                              f"{generation} sizes count {counts})")
        if groups < 1:
            raise ConfigError(f"{key}={name}: expected at least one slice, found {groups}")
        return Target(text, chip, groups, chips, topology)
    if m := _GPU.match(text):
        nodes, gpu, per_node = int(m[1] or 1), m[2], int(m[3])
        if nodes < 1 or not 1 <= per_node <= 16:
            raise ConfigError(f"{key}={name}: expected 1-16 GPUs per node and at least one node, found "
                              f"{nodes} node(s) x {per_node}")
        return Target(text, CHIPS[gpu], nodes, per_node, f"{nodes} node(s) x {per_node} GPUs")
    raise ConfigError(f"{key}={name!r}: not a known target; expected {known_targets()}")


def cluster_target(cluster) -> Target | None:
    """The target a `cluster` config reserves (None for local and none, and for GPU nodes of an
    unnamed `cluster.gpu_type`)."""
    if cluster.kind == "tpu":
        prefix = f"{cluster.num_slices}x" if cluster.num_slices > 1 else ""
        return parse_target(prefix + cluster.tpu_type, key="cluster.tpu_type")
    if cluster.kind == "gpu" and cluster.gpu_type:
        prefix = f"{cluster.num_nodes}x" if cluster.num_nodes > 1 else ""
        return parse_target(f"{prefix}{cluster.gpu_type}x{cluster.gpus_per_node}", key="cluster.gpu_type")
    return None


def _gpu_target_config(chip: Chip) -> str:
    """A GpuTargetConfigProto (text format) for `chip`: what XLA's GPU compiler reads of a device."""
    major, minor = chip.compute_capability
    return "\n".join([
        "gpu_device_info {",
        "  threads_per_block_limit: 1024", "  threads_per_warp: 32",
        "  shared_memory_per_block: 49152", f"  shared_memory_per_core: {chip.shared_memory_per_sm}",
        f"  shared_memory_per_block_optin: {chip.shared_memory_per_sm - 1024}",
        "  threads_per_core_limit: 2048", f"  core_count: {chip.sm_count}", "  fpus_per_core: 128",
        "  block_dim_limit_x: 2147483647", "  block_dim_limit_y: 65535", "  block_dim_limit_z: 65535",
        f"  memory_bandwidth: {int(chip.hbm_bandwidth)}", f"  l2_cache_size: {chip.l2_bytes}",
        f"  clock_rate_ghz: {chip.clock_ghz}", f"  device_memory_size: {chip.hbm_bytes}",
        f"  cuda_compute_capability {{ major: {major} minor: {minor} }}",
        "  registers_per_core_limit: 65536", "  registers_per_block_limit: 65536",
        "}",
        'platform_name: "CUDA"',
        "dnn_version_info { major: 9 minor: 8 patch: 0 }",
        f'device_description_str: "{chip.device_kind}"',
    ])


def _missing(what: str, target: Target) -> ConfigError:
    return ConfigError(f"--target {target.name}: compiling for {target.chip.platform.upper()} needs {what}; "
                       f"install it with: {AOT_INSTALL}")


def compile_devices(target: Target) -> list:
    """Compile-only JAX devices of `target`, in the order of its processes (hosts)."""
    import importlib.util

    from jax.experimental import topologies

    chip = target.chip
    if chip.platform == "tpu":
        if importlib.util.find_spec("libtpu") is None:
            raise _missing("libtpu", target)
        # No TPU is attached: libtpu must not look for the slice's other hosts, nor hold the lock
        # that keeps a second process off the chips (plans may compile side by side).
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
        os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
        os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
        slice_type = target.name.split("x", 1)[1] if target.groups > 1 else target.name
        os.environ.setdefault("TPU_ACCELERATOR_TYPE", ray_tpu_version(slice_type) + "-" + slice_type.partition("-")[2])
        name = f"{chip.tpu_generation}:{target.topology}"
        description = topologies.get_topology_desc(
            platform="tpu", topology_name=name, chip_config_name=chip.chip_config,
            chips_per_host_bounds=(2, 2, 1), num_slices=target.groups, wrap=(False,) * 3)
    else:
        if importlib.util.find_spec("jax_plugins.xla_cuda12") is None:
            raise _missing("the CUDA compiler plugin (jax-cuda12-pjrt) and ptxas", target)
        register_cuda_compiler()
        description = topologies.get_topology_desc(
            target.name, "cuda", target_config=_gpu_target_config(chip),
            topology=f"1x{target.groups}x{target.per_group}")
    devices = list(description.devices)
    if len(devices) != target.devices:
        raise ConfigError(f"--target {target.name}: the compiler gave {len(devices)} devices, "
                          f"expected {target.devices}")
    return devices


def host_line(host: dict) -> str:
    """The host RAM part of a verdict: the peak, what sets it, against the host's RAM."""
    gib = 2**30
    line = (f"host RAM peak {host['peak_bytes'] / gib:.2f} GiB ({host['peak_of']}) of "
            f"{host['ram_bytes'] / gib:.2f} GiB per host")
    if host["fits"]:
        return line
    line += f" (over by {-host['headroom_bytes'] / gib:.2f} GiB)"
    if host.get("host_gb"):
        line += f"; fits with checkpoint.host_gb={host['host_gb']}"
    return line


def verdict_line(report: dict) -> str:
    """One line: fits or not, peak against the device's memory and the host's, and the suggestion if any."""
    gib = 2**30
    peak, hbm = report["peak_bytes"] / gib, report["hbm_bytes"] / gib
    host = report.get("host")
    if report["fits"]:
        return (f"fits on {report['target']}: peak {peak:.2f} GiB of {hbm:.2f} GiB per device "
                f"({report['headroom_bytes'] / gib:.2f} GiB headroom)" + (f"; {host_line(host)}" if host else ""))
    if report.get("hbm_fits", False):
        return f"does not fit on {report['target']}: {host_line(host)}; peak {peak:.2f} GiB of {hbm:.2f} GiB per device"
    line = (f"does not fit on {report['target']}: peak {peak:.2f} GiB of {hbm:.2f} GiB per device "
            f"(over by {-report['headroom_bytes'] / gib:.2f} GiB)")
    fit = report.get("suggestion")
    if fit:
        line += f"; fits with {' '.join(fit['overrides'])} (peak {fit['peak_bytes'] / gib:.2f} GiB)"
    elif "suggestion" in report:
        line += "; no tried change fits (more micro-batches, full remat, fsdp over dp): use a larger target"
    if host and not host["fits"]:
        line += f"; {host_line(host)}"
    return line
