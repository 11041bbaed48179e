"""Elastic multi-slice training (`cluster.elastic`).

A job of `cluster.num_slices` TPU slices that loses a host (a lost node, a preemption) first waits
up to `cluster.elastic_wait_s` for the slices it had; then it restarts from the last checkpoint on
the complete free slices that remain, down to `cluster.min_slices`. The global batch and the data
order stay the same: the data-parallel axis (which spans the slices) shrinks by the slices lost and
gradient accumulation rises as much, so each device's micro-batch is the one it had. A batch that
cannot be split that way is one line, and the job waits for its slices instead. While it runs on
fewer slices the driver looks for free ones; when enough are back, the gang saves together at the
step it agrees on (JAX's preemption sync point, no step lost) and restarts on all of them.
"""

from __future__ import annotations

import dataclasses
import time

from podtrain.orchestrator.cluster.reserve import ReservationError, pod_type, slice_nodes
from podtrain.orchestrator.config.cluster import ClusterConfig
from podtrain.orchestrator.config.schema import Config

GROW_CHECK_S = 5.0  # how often a job on fewer slices looks for free ones


def resized(config: Config, slices: int) -> Config | str:
    """`config` (written for `cluster.num_slices`) on `slices` of them: `mesh.dp` and
    `train.grad_accum` scaled so that the global batch and each device's micro-batch stay; or the
    line saying why the batch cannot be split so."""
    full = config.cluster.num_slices
    if slices == full:
        return config
    train = config.train
    if (train.grad_accum * full) % slices or train.batch_size % (train.grad_accum * full // slices):
        return (f"train.batch_size={train.batch_size} with train.grad_accum={train.grad_accum} cannot be split "
                f"over {slices} of cluster.num_slices={full} slices: gradient accumulation would have to be "
                f"{train.grad_accum * full}/{slices} micro-batches")
    mesh = config.mesh
    dp = mesh.dp * slices // full if mesh.dp > 0 else mesh.dp  # -1 fills what the other axes leave
    return dataclasses.replace(
        config, cluster=dataclasses.replace(config.cluster, num_slices=slices),
        mesh=dataclasses.replace(mesh, dp=dp),
        train=dataclasses.replace(train, grad_accum=train.grad_accum * full // slices))


def whole_slices(cluster: ClusterConfig, hosts_per_slice: int) -> int:
    """Slices of `cluster.tpu_type` whose hosts are all alive (held or not)."""
    return sum(1 for nodes in slice_nodes(cluster).values() if len(nodes) >= hosts_per_slice)


def free_slices(cluster: ClusterConfig, hosts_per_slice: int) -> int:
    """Whole slices whose head nobody holds (Ray frees a released slice's head a little later)."""
    import ray

    free_heads = int(ray.available_resources().get(f"TPU-{pod_type(cluster)}-head", 0))
    return min(whole_slices(cluster, hosts_per_slice), free_heads)


@dataclasses.dataclass
class Elastic:
    """The slices of each attempt of a job; elastic for TPU jobs of several slices with
    `cluster.elastic` (`enabled`), else always `cluster.num_slices`."""

    cluster: ClusterConfig
    enabled: bool
    slices: int  # the current attempt's
    lost: bool = False  # the last attempt lost a host or was preempted
    growing: bool = False  # the gang was told to save and stop, to grow
    hosts_per_slice: int = 0  # learnt from the first gang
    looked_at: float = 0.0

    @classmethod
    def of(cls, cluster: ClusterConfig, *, service: bool) -> Elastic:
        return cls(cluster, cluster.elastic and not service and cluster.kind == "tpu" and cluster.num_slices > 1,
                   cluster.num_slices)

    def reserve(self, config: Config, name: str, reserve, say) -> tuple:
        """The attempt's gang (`reserve(cluster, name)`) and `config` resized to its slices."""
        if not self.enabled:
            return reserve(self.cluster, name), config
        full = self.cluster.num_slices
        if self.growing or self.hosts_per_slice and free_slices(self.cluster, self.hosts_per_slice) >= full:
            self.slices = full  # (after a grow, the slice it held may show as held a moment longer)
        lost, self.lost, self.growing = self.lost, False, False
        if lost:
            waiting = dataclasses.replace(self.cluster, num_slices=self.slices,
                                          reserve_timeout_s=self.cluster.elastic_wait_s)
            try:
                return self._learn(reserve(waiting, name)), resized(config, self.slices)
            except ReservationError:
                self._shrink(config, say)
        gang = reserve(dataclasses.replace(self.cluster, num_slices=self.slices), name)
        return self._learn(gang), resized(config, self.slices)

    def _shrink(self, config: Config, say) -> None:
        full, least = self.cluster.num_slices, self.cluster.min_slices
        # The job holds none now; a slice its last reservation held may show as held a moment longer.
        remaining = min(self.slices - 1, whole_slices(self.cluster, self.hosts_per_slice))
        shaped = resized(config, remaining) if remaining >= least else \
            f"{remaining} whole slices left, fewer than cluster.min_slices={least}"
        if isinstance(shaped, str):
            say(f"the lost slice is not back within cluster.elastic_wait_s={self.cluster.elastic_wait_s:g}s and "
                f"{shaped}: waiting for {self.slices} slices")
            return
        say(f"the lost slice is not back within cluster.elastic_wait_s={self.cluster.elastic_wait_s:g}s: restarting "
            f"on {remaining} of {full} slices, mesh.dp={shaped.mesh.dp}, train.grad_accum={shaped.train.grad_accum} "
            f"(the same global batch of {config.train.batch_size})")
        self.slices = remaining

    def _learn(self, gang):
        self.hosts_per_slice = self.hosts_per_slice or len(gang.actors) // self.slices
        return gang

    def should_grow(self, stepping: bool) -> bool:
        """Whether enough slices are free for the job to grow back to all of them (looked at every
        `GROW_CHECK_S` once the gang is `stepping`: it saves before it stops)."""
        if not self.enabled or not stepping or self.growing or self.slices == self.cluster.num_slices:
            return False
        now = time.monotonic()
        if now - self.looked_at < GROW_CHECK_S:
            return False
        self.looked_at = now
        self.growing = free_slices(self.cluster, self.hosts_per_slice) >= self.cluster.num_slices - self.slices
        return self.growing
