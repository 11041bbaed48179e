"""Reserving a gang of hosts on Ray: a TPU pod slice (or several), GPU nodes, or simulated local hosts.

A reservation is all or nothing: one placement group whose bundles are the hosts (one bundle per
TPU VM, per GPU node, per simulated host) must be ready within `cluster.reserve_timeout_s`, or it
is removed and the attempt fails with the resources it asked for (`ReservationError`, also when
Ray finds no TPU slice or the host actors do not start in that time). Each bundle gets one host
actor; one that dies before it answers raises Ray's `RayActorError` (the driver's `node_lost`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from typing import Any

from podtrain.orchestrator.cluster.host import HostActor
from podtrain.orchestrator.common.errors import ConfigError
from podtrain.orchestrator.common.protocol import ENV_LOCAL_DEVICE_IDS
from podtrain.orchestrator.config.cluster import ClusterConfig
from podtrain.orchestrator.config.schema import Config
from podtrain.orchestrator.plan.targets import parse_target, ray_tpu_version, tpu_chips, tpu_topology

DEVICE_COUNT_FLAG = "xla_force_host_platform_device_count"  # fake CPU devices of a local host


class ReservationError(RuntimeError):
    """The cluster could not give the whole gang in time (nothing of it is kept)."""


def connect(config: Config) -> bool:
    """Joins the Ray cluster the job runs in, or starts an embedded one bound to loopback; True when
    embedded (one node, which no other can replace)."""
    import ray

    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    address = config.cluster.address or os.environ.get("RAY_ADDRESS", "")
    if address:
        ray.init(address=address, logging_level="WARNING", log_to_driver=False)
        return False
    c = config.cluster
    needed = c.num_hosts * c.cpus_per_host if c.kind == "local" else 1
    ray.init(num_cpus=max(os.cpu_count() or 1, int(needed + 0.999)), include_dashboard=False,
             _node_ip_address="127.0.0.1", logging_level="WARNING", log_to_driver=False)
    return True


def gang_devices(cluster: ClusterConfig) -> int | None:
    """How many JAX devices the whole gang will have, when the config alone says it: local hosts'
    CPU devices, GPU nodes' GPUs, TPU chips from v4 on (one device per chip); None for v2/v3 (a
    device per core) and when `cluster.env` sets JAX_PLATFORMS (the workers use other devices)."""
    if cluster.kind == "local":
        return cluster.num_hosts * cluster.devices_per_host
    if cluster.kind == "gpu":
        return cluster.num_nodes * cluster.gpus_per_node
    per_core = cluster.tpu_type.lower().partition("-")[0] in ("v2", "v3")
    if cluster.kind == "tpu" and not per_core and "JAX_PLATFORMS" not in cluster.env:
        return tpu_chips(cluster.tpu_type) * cluster.num_slices
    return None


@dataclasses.dataclass
class Gang:
    """A reserved gang: host actors (rank order), their placement groups, and what runs where."""

    actors: list[Any]
    placement_groups: list[Any]
    infos: list[dict]
    host_env: list[dict[str, str]]  # per host, set before the worker imports JAX
    slices: list[int]  # the slice index of each host (0 unless several TPU slices)
    slice_handles: list[Any] = dataclasses.field(default_factory=list)

    def release(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        for actor in self.actors:
            # An actor or node that is gone took its process with it (a worker exits with its parent).
            with contextlib.suppress(Exception):
                ray.get(actor.kill.remote(), timeout=60)
            ray.kill(actor, no_restart=True)
        for handle in self.slice_handles:
            handle.shutdown()
        for pg in self.placement_groups:
            with contextlib.suppress(Exception):
                remove_placement_group(pg)


NODE_ID_LABEL = "ray.io/node-id"  # every Ray node's own label
# What Ray's TPU support labels a TPU host's node with.
SLICE_LABEL = "ray.io/tpu-slice-name"
POD_TYPE_LABEL = "ray.io/tpu-pod-type"
WORKER_ID_LABEL = "ray.io/tpu-worker-id"
HEAD_TRY_S = 0.5  # how long to try for one slice's head before the next slice


def pod_type(cluster: ClusterConfig) -> str:
    """The slice type as Ray's labels and head resources name it (`v5e-16` -> `v5litepod-16`)."""
    return f"{ray_tpu_version(cluster.tpu_type)}-{cluster.tpu_type.partition('-')[2]}"


def slice_nodes(cluster: ClusterConfig) -> dict[str, list[str]]:
    """Each slice of `cluster.tpu_type`: the node ids of its hosts that are alive."""
    import ray

    slices: dict[str, list[str]] = {}
    for node in ray.nodes():
        labels = node.get("Labels", {})
        if node.get("Alive") and labels.get(POD_TYPE_LABEL) == pod_type(cluster) and labels.get(SLICE_LABEL):
            slices.setdefault(labels[SLICE_LABEL], []).append(node["NodeID"])
    return slices


def _hold_heads(cluster: ClusterConfig, exclude: frozenset[str], hosts_per_slice: int) -> dict[str, Any]:
    """The heads of `cluster.num_slices` whole slices none of whose hosts `exclude` names, held as
    Ray's own slice reservation holds them (a placement group on the slice's head resource): slice
    name -> its head's placement group. ReservationError when they are not all held within
    `cluster.reserve_timeout_s`."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    pod, held = pod_type(cluster), {}
    deadline = time.monotonic() + cluster.reserve_timeout_s
    while len(held) < cluster.num_slices:
        for name, nodes in sorted(slice_nodes(cluster).items()):
            if len(held) == cluster.num_slices:
                break
            if name in held or len(nodes) < hosts_per_slice or exclude & set(nodes):
                continue
            head = placement_group([{f"TPU-{pod}-head": 1}], bundle_label_selector=[
                {WORKER_ID_LABEL: "0", POD_TYPE_LABEL: pod, SLICE_LABEL: name}])
            if ray.wait([head.ready()], timeout=HEAD_TRY_S)[0]:
                held[name] = head
            else:
                remove_placement_group(head)
        if len(held) < cluster.num_slices:
            if time.monotonic() > deadline:
                for head in held.values():
                    remove_placement_group(head)
                raise ReservationError(f"could not reserve {cluster.num_slices} x {cluster.tpu_type} without the "
                                       "quarantined hosts within cluster.reserve_timeout_s="
                                       f"{cluster.reserve_timeout_s:g}s")
            time.sleep(1.0)
    return held


def _bundles(cluster: ClusterConfig) -> tuple[list[dict], str, dict]:
    """(bundles, strategy, actor resource options) for the local and GPU kinds."""
    if cluster.kind == "local":
        return [{"CPU": cluster.cpus_per_host}] * cluster.num_hosts, "PACK", {"num_cpus": cluster.cpus_per_host}
    if cluster.kind == "gpu":
        bundle = {"CPU": cluster.cpus_per_host, "GPU": cluster.gpus_per_node}
        return [bundle] * cluster.num_nodes, "STRICT_SPREAD", {"num_cpus": cluster.cpus_per_host,
                                                                 "num_gpus": cluster.gpus_per_node}
    raise ValueError(f"no bundles for cluster.kind={cluster.kind!r}")


def _wait_ready(pgs: list, cluster: ClusterConfig, what: str) -> None:
    import ray
    from ray.util.placement_group import remove_placement_group

    try:
        ray.get([pg.ready() for pg in pgs], timeout=cluster.reserve_timeout_s)
    except ray.exceptions.GetTimeoutError:
        for pg in pgs:
            remove_placement_group(pg)
        raise ReservationError(
            f"could not reserve {what} within cluster.reserve_timeout_s={cluster.reserve_timeout_s:g}s; "
            f"available resources: {ray.available_resources()}"
        ) from None


def _reserve_slices(cluster: ClusterConfig, name: str, exclude: frozenset[str]) -> tuple[Any, list]:
    """Ray's `SlicePlacementGroup` for `cluster.num_slices` slices of `cluster.tpu_type`, one group
    per slice, and the heads held for it. With `exclude` (quarantined hosts), only slices none of
    whose hosts it names: a single-host slice by its node, a multi-host one by its name, its head
    held here first (a slice is one ICI domain: a host cannot be swapped out of it)."""
    from ray.util.placement_group import remove_placement_group
    from ray.util.tpu import SlicePlacementGroup

    what = f"cluster.tpu_type={cluster.tpu_type!r}, cluster.tpu_topology={cluster.tpu_topology!r}"
    heads, selector = {}, None
    hosts_per_slice = max(1, parse_target(cluster.tpu_type, key="cluster.tpu_type").hosts)
    if exclude and hosts_per_slice == 1:
        selector = [{NODE_ID_LABEL: f"!in({','.join(sorted(exclude))})"}] * cluster.num_slices
    elif exclude:
        heads = _hold_heads(cluster, exclude, hosts_per_slice)
        selector = [{SLICE_LABEL: slice_name} for slice_name in heads for _ in range(hosts_per_slice)]
    try:
        return SlicePlacementGroup(
            topology=cluster.tpu_topology or tpu_topology(cluster.tpu_type),
            accelerator_version=ray_tpu_version(cluster.tpu_type), num_slices=cluster.num_slices,
            resources_per_bundle={"CPU": cluster.cpus_per_host} if cluster.cpus_per_host else None,
            head_reservation_timeout_s=cluster.reserve_timeout_s, pg_per_slice=True, name=name,
            bundle_label_selector=selector,
        ), list(heads.values())
    except BaseException as error:
        for head in heads.values():
            remove_placement_group(head)
        if isinstance(error, ValueError):  # a topology Ray does not know for this TPU generation
            raise ConfigError(f"{what}: not a slice Ray can reserve: {error}") from None
        if isinstance(error, TimeoutError | RuntimeError):  # no free slice (its head) within the timeout
            raise ReservationError(f"could not reserve {cluster.num_slices} x {cluster.tpu_type} within "
                                   f"cluster.reserve_timeout_s={cluster.reserve_timeout_s:g}s: {error}") from None
        raise


def _host_infos(gang: Gang, cluster: ClusterConfig) -> list[dict]:
    """Each host actor's `info()`; releases the gang when they do not all answer in time."""
    import ray

    try:
        return ray.get([a.info.remote() for a in gang.actors], timeout=cluster.reserve_timeout_s)
    except ray.exceptions.GetTimeoutError:
        gang.release()
        raise ReservationError(f"the {len(gang.actors)} host actors did not start within "
                               f"cluster.reserve_timeout_s={cluster.reserve_timeout_s:g}s") from None
    except BaseException:
        gang.release()
        raise


def reserve(cluster: ClusterConfig, name: str, exclude: frozenset[str] = frozenset()) -> Gang:
    """Reserves the whole gang for one attempt and starts one host actor per host (rank order),
    on none of the Ray nodes `exclude` names (quarantined hosts; for TPUs, none of their slices)."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    remote_host = ray.remote(max_restarts=0, max_concurrency=4)(HostActor)
    slice_handles, placements = [], []  # placements: (pg, bundle index, actor options, slice index)
    heads = []  # slice heads held here (released with the gang)
    if cluster.kind == "tpu":
        handle, heads = _reserve_slices(cluster, name, exclude)
        slice_handles.append(handle)
        pgs = handle.slice_placement_groups
        tpus = handle.bundle_resources.get("TPU", 0)
        per_slice = handle.num_bundles // cluster.num_slices
        for s, pg in enumerate(pgs):
            placements += [(pg, b, {"num_cpus": 0, "resources": {"TPU": tpus}}, s) for b in range(per_slice)]
        what = f"{cluster.num_slices} x {cluster.tpu_type} ({handle.num_hosts} hosts)"
    else:
        bundles, strategy, options = _bundles(cluster)
        selector = [{NODE_ID_LABEL: f"!in({','.join(sorted(exclude))})"}] * len(bundles) if exclude else None
        pgs = [placement_group(bundles, strategy=strategy, name=name, bundle_label_selector=selector)]
        placements = [(pgs[0], b, options, 0) for b in range(len(bundles))]
        what = f"{len(bundles)} bundles of {bundles[0]} ({strategy})"
    try:
        _wait_ready(pgs, cluster, what)
    except BaseException:
        for handle in slice_handles:
            handle.shutdown()
        for head in heads:
            remove_placement_group(head)
        raise
    actors = [
        remote_host.options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=b), **options
        ).remote(rank)
        for rank, (pg, b, options, _) in enumerate(placements)
    ]
    gang = Gang(actors, [*pgs, *heads], [], [], [pl[3] for pl in placements], slice_handles)
    gang.infos = _host_infos(gang, cluster)
    if cluster.kind == "tpu":  # ranks follow the TPU worker ids within each slice (worker 0 coordinates)
        order = sorted(range(len(actors)), key=lambda r: (
            gang.slices[r], int(gang.infos[r]["labels"].get("ray.io/tpu-worker-id", r))))
        gang.actors, gang.infos, gang.slices = ([xs[r] for r in order] for xs in (gang.actors, gang.infos, gang.slices))
    gang.host_env = [host_env(cluster, info, xla_flags=os.environ.get("XLA_FLAGS", "")) for info in gang.infos]
    return gang


def host_env(cluster: ClusterConfig, info: dict, xla_flags: str = "") -> dict[str, str]:
    """Environment for one host's worker: platform and device flags per kind, then `cluster.env`.

    A local host runs with `cluster.env.XLA_FLAGS` if set, else the driver's `xla_flags` (say,
    `--xla_dump_to`), and always with its own fake device count, `cluster.devices_per_host`.
    """
    env = {str(k): str(v) for k, v in cluster.env.items()}
    if cluster.kind == "local":
        env.setdefault("JAX_PLATFORMS", "cpu")
        flags = env.get("XLA_FLAGS", xla_flags).split()
        kept = [flag for flag in flags if not flag.startswith(f"--{DEVICE_COUNT_FLAG}")]
        env["XLA_FLAGS"] = " ".join([f"--{DEVICE_COUNT_FLAG}={cluster.devices_per_host}", *kept])
    elif cluster.kind == "gpu":
        # A missing CUDA plugin fails the worker instead of training on the CPU.
        env.setdefault("JAX_PLATFORMS", "cuda")
        env.setdefault("CUDA_VISIBLE_DEVICES", ",".join(map(str, info["gpu_ids"])))
        # Every visible GPU (indices within CUDA_VISIBLE_DEVICES). Unset, JAX's cluster detection
        # gives a process under Slurm or Open MPI (Ray started by srun, say) one GPU.
        env.setdefault(ENV_LOCAL_DEVICE_IDS, ",".join(map(str, range(cluster.gpus_per_node))))
    elif cluster.kind == "tpu":
        env.setdefault("JAX_PLATFORMS", "tpu")
    return env


def megascale_env(cluster: ClusterConfig, coordinator_ip: str, slice_index: int, port: int) -> dict[str, str]:
    """The multi-slice variables of one slice's hosts (only for `num_slices > 1`)."""
    if cluster.kind != "tpu" or cluster.num_slices == 1:
        return {}
    return {
        "MEGASCALE_COORDINATOR_ADDRESS": coordinator_ip,
        "MEGASCALE_PORT": str(port),
        "MEGASCALE_NUM_SLICES": str(cluster.num_slices),
        "MEGASCALE_SLICE_ID": str(slice_index),
    }
