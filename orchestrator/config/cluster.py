"""The `cluster` section of the config schema: where a run's processes go, and the bound of every
wait."""

from __future__ import annotations

from dataclasses import dataclass, field

from podtrain.orchestrator.common.chips import CHIPS

CLUSTER_KINDS = ("local", "tpu", "gpu", "none")
GPU_TYPES = tuple(name for name, chip in CHIPS.items() if chip.platform == "cuda")


@dataclass(frozen=True)
class ClusterConfig:
    """Where the processes of a run go (`orchestrator/cluster/`); `cluster=<kind>` sets `kind`.

    - `local`: `num_hosts` simulated hosts on this machine, each its own process with
      `devices_per_host` CPU devices (the default, and the test path).
    - `tpu`: `num_slices` whole pod slices of `tpu_type` (e.g. v5p-64), one process per TPU VM.
    - `gpu`: `num_nodes` nodes of `gpus_per_node` GPUs, one process per node owning all its GPUs;
      `gpu_type` (a GPU of `common.chips`: h100, h200, a100-80gb, a100-40gb) names them for the plan
      check before launch (`plan`).
    - `none`: no orchestrator: train in this process on its own devices (what each worker runs).

    `address` is the Ray cluster to use: empty means the one the job runs in (`ray job submit`,
    `RAY_ADDRESS`), or else an embedded Ray on loopback. Preemptions and lost nodes draw on
    `max_preemptions`, and so does a gang not reserved in time right after one of them (capacity
    coming back); crashes, exceptions, hangs and other reservation timeouts on `max_failures`
    (details in `orchestrator/cluster/driver.py`).

    Every wait has its own bound: a worker's heartbeat names the phase it is in
    (`common.protocol.PHASES`), and a rank that stays in one past its timeout is a hang of that
    phase: `start_timeout_s` (process start to its first heartbeat), `init_timeout_s`
    (`jax.distributed`), `restore_timeout_s` (building, loading a base, restoring),
    `compile_timeout_s` (a first compile and the barrier after it), `hang_timeout_s` (between
    training steps, and a serve worker's engine step), `save_timeout_s` (a save's blocking part),
    `commit_timeout_s` (waiting for an async save to commit), `stop_grace_s` (from a stop or a
    preemption notice to the workers' exit), `reserve_timeout_s` (the gang's reservation).

    A host (Ray node) blamed for two failures (crash, exception, hang, lost) within
    `quarantine_window_s` is left out of the run's next reservations for `quarantine_s` (0: never);
    with no spare host the reservation waits for one, up to `reserve_timeout_s`, then takes the
    quarantined hosts again. An embedded Ray's one node is never left out.

    `elastic` (TPU, `num_slices` > 1): a job that loses a slice waits `elastic_wait_s` for it, then
    goes on with the slices that remain (at least `min_slices`) and the same global batch, and grows
    back when they are free again (`orchestrator/cluster/elastic.py`).
    """

    kind: str = "local"
    address: str = ""
    num_hosts: int = 1
    devices_per_host: int = 1
    tpu_type: str = ""
    tpu_topology: str = ""
    num_slices: int = 1
    num_nodes: int = 1
    gpus_per_node: int = 8
    gpu_type: str = ""
    cpus_per_host: float = 1.0
    max_failures: int = 3
    max_preemptions: int = 100
    hang_timeout_s: float = 600.0
    start_timeout_s: float = 600.0
    restore_timeout_s: float = 1800.0
    compile_timeout_s: float = 3600.0
    save_timeout_s: float = 1800.0
    commit_timeout_s: float = 1800.0
    stop_grace_s: float = 120.0
    reserve_timeout_s: float = 600.0
    init_timeout_s: int = 300
    quarantine_window_s: float = 3600.0
    quarantine_s: float = 3600.0
    elastic: bool = False
    min_slices: int = 1
    elastic_wait_s: float = 300.0
    heartbeat_timeout_s: int = 100
    coordinator_port: int = 0
    env: dict[str, str] = field(default_factory=dict)

    def validate(self, prefix: str = "cluster") -> None:
        """Raises ValueError naming the key when a field is out of range."""
        if self.kind not in CLUSTER_KINDS:
            raise ValueError(f"{prefix}.kind: expected one of {list(CLUSTER_KINDS)}, found {self.kind!r}")
        for name in ("num_hosts", "devices_per_host", "num_slices", "num_nodes", "gpus_per_node"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{prefix}.{name}: expected a positive integer, found {getattr(self, name)}")
        for name in ("max_failures", "max_preemptions", "coordinator_port", "quarantine_window_s", "quarantine_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{prefix}.{name}: expected an integer >= 0, found {getattr(self, name)}")
        for name in ("hang_timeout_s", "start_timeout_s", "restore_timeout_s", "compile_timeout_s", "save_timeout_s",
                     "commit_timeout_s", "stop_grace_s", "reserve_timeout_s", "init_timeout_s", "heartbeat_timeout_s",
                     "elastic_wait_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{prefix}.{name}: expected a positive number of seconds, found {getattr(self, name)}")
        if self.elastic and (self.kind != "tpu" or self.num_slices < 2):
            raise ValueError(f"{prefix}.elastic: expected cluster.kind=tpu with cluster.num_slices > 1, found "
                             f"cluster.kind={self.kind} with cluster.num_slices={self.num_slices}")
        if not 1 <= self.min_slices <= self.num_slices:
            raise ValueError(f"{prefix}.min_slices: expected 1 to cluster.num_slices={self.num_slices}, "
                             f"found {self.min_slices}")
        if self.gpu_type and self.gpu_type not in GPU_TYPES:
            raise ValueError(f"{prefix}.gpu_type: expected one of {list(GPU_TYPES)} (or empty), "
                             f"found {self.gpu_type!r}")
        if self.kind == "tpu":
            version, _, chips = self.tpu_type.partition("-")
            if not (version.startswith("v") and chips.isdigit()):
                raise ValueError(f"{prefix}.tpu_type: expected a TPU type such as 'v5p-64' or 'v6e-16', "
                                 f"found {self.tpu_type!r}")
