"""The one table of chip facts: per TPU chip or GPU, its memory, dense bf16 peak, bandwidths and
what XLA's compilers need of it, and the RAM of the host VM it comes in, each from its public
source. Targets (`plan.targets`) and MFU (`train.metrics`) read it.

Host RAM is that of the Google Cloud VM a multi-host slice or a GPU node is made of (Compute
Engine gives machine-type memory in GiB, labelled GB)."""

from __future__ import annotations

from dataclasses import dataclass

GiB = 2**30


@dataclass(frozen=True)
class Chip:
    """Per-chip (TPU) or per-GPU facts. Bandwidths are bytes/s one device can send: `ici` inside a
    slice or node (ICI over all its `ici_links` torus links together; NVLink through the node's
    switch, to any GPU), `dcn` across slices or nodes (data-centre network, InfiniBand)."""

    name: str
    platform: str  # "tpu" or "cuda"
    device_kind: str  # what JAX reports for the device
    hbm_bytes: int
    peak_flops: float  # dense bf16 FLOP/s
    hbm_bandwidth: float
    ici_bandwidth: float
    dcn_bandwidth: float
    chips_per_host: int
    host_ram_bytes: int  # the RAM of one host (VM) of `chips_per_host` chips
    # Other names JAX reports for the device, by version or form factor.
    device_kind_aliases: tuple[str, ...] = ()
    # TPU: the name libtpu gives the generation and its chip configuration; 3-D torus or 2-D.
    tpu_generation: str = ""
    chip_config: str = "default"
    torus_dims: int = 0
    ici_links: int = 0  # links per chip, two per torus dimension
    # CUDA: what XLA's GPU compiler needs of the device.
    compute_capability: tuple[int, int] = (0, 0)
    sm_count: int = 0
    clock_ghz: float = 0.0
    l2_bytes: int = 0
    shared_memory_per_sm: int = 0


CHIPS: dict[str, Chip] = {chip.name: chip for chip in (
    # cloud.google.com/tpu/docs/v4: 275 TFLOP/s bf16, 32 GiB HBM2 at 1200 GB/s; ICI: the pod's
    # all-reduce bandwidth, 1.1 PB/s over 4096 chips (~270 GB/s per chip), 6 links of a 3-D torus;
    # DCN taken as v5e's.
    # Host: ct4p-hightpu-4t, 240 vCPUs and 407 GiB (the GKE cluster autoscaler's machine-type table).
    Chip("v4", "tpu", "TPU v4", 32 * GiB, 275e12, 1200e9, 270e9, 25e9 / 4, 4, 407 * GiB,
         tpu_generation="v4", chip_config="megacore", torus_dims=3, ici_links=6),
    # cloud.google.com/tpu/docs/v5e: 197 TFLOP/s, 16 GiB HBM2 at 819 GB/s, ICI 400 GB/s bidirectional
    # per chip over 4 ports (2-D torus; the v6e page's table); 2 x 100 Gb/s NICs per host.
    # Host: the 4-chip VM, ct5lp-hightpu-4t, 112 vCPUs and 192 GB (cloud.google.com/tpu/docs/v5e).
    Chip("v5e", "tpu", "TPU v5 lite", 16 * GiB, 197e12, 819e9, 200e9, 25e9 / 4, 4, 192 * GiB, ("TPU v5e",),
         tpu_generation="v5e", torus_dims=2, ici_links=4),
    # cloud.google.com/tpu/docs/v5p: 459 TFLOP/s, 95 GiB HBM2e at 2765 GB/s, ICI 1200 GB/s
    # bidirectional per chip over the 6 links of its 3-D torus, DCN 50 Gb/s per chip.
    # Host: the 4-chip VM, ct5p-hightpu-4t, 208 vCPUs and 448 GB (cloud.google.com/tpu/docs/v5p-training).
    Chip("v5p", "tpu", "TPU v5", 95 * GiB, 459e12, 2765e9, 600e9, 50e9 / 8, 4, 448 * GiB, ("TPU v5p",),
         tpu_generation="v5p", chip_config="megacore", torus_dims=3, ici_links=6),
    # cloud.google.com/tpu/docs/v6e: 918 TFLOP/s, 32 GB HBM at 1638 GB/s, ICI 800 GB/s bidirectional
    # per chip over 4 ICI ports (the DCN share per chip taken as v5e's).
    # Host: the 4-chip VM of multi-host slices, ct6e-standard-4t, 180 vCPUs and 720 GiB
    # (cloud.google.com/kubernetes-engine/docs/concepts/plan-tpus).
    Chip("v6e", "tpu", "TPU v6 lite", 32 * GiB, 918e12, 1638e9, 400e9, 25e9 / 4, 4, 720 * GiB, ("TPU v6e",),
         tpu_generation="v6e", torus_dims=2, ici_links=4),
    # nvidia.com/en-us/data-center/h100: SXM5, 80 GB HBM3 at 3.35 TB/s, 989 TFLOP/s dense bf16, NVLink
    # 900 GB/s bidirectional; DGX H100: one 400 Gb/s InfiniBand NDR port per GPU. SM 9.0, 132 SMs.
    # Host: a3-highgpu-8g, 208 vCPUs and 1,872 GB (cloud.google.com/compute/docs/accelerator-optimized-machines).
    Chip("h100", "cuda", "NVIDIA H100 80GB HBM3", 80 * GiB, 989e12, 3350e9, 450e9, 50e9, 8, 1872 * GiB,
         ("NVIDIA H100",),
         compute_capability=(9, 0), sm_count=132, clock_ghz=1.98, l2_bytes=50 * 2**20,
         shared_memory_per_sm=228 * 2**10),
    # nvidia.com/en-us/data-center/h200: 141 GB HBM3e at 4.8 TB/s, otherwise an H100 (SXM).
    # Host: a3-ultragpu-8g, 224 vCPUs and 2,952 GB (the same page).
    Chip("h200", "cuda", "NVIDIA H200", 141 * 10**9, 989e12, 4800e9, 450e9, 50e9, 8, 2952 * GiB,
         compute_capability=(9, 0), sm_count=132, clock_ghz=1.98, l2_bytes=50 * 2**20,
         shared_memory_per_sm=228 * 2**10),
    # nvidia.com/en-us/data-center/a100: SXM 80 GB HBM2e at 2039 GB/s, 312 TFLOP/s bf16, NVLink
    # 600 GB/s bidirectional; DGX A100: one 200 Gb/s HDR port per GPU. SM 8.0, 108 SMs.
    # Host: a2-ultragpu-8g, 96 vCPUs and 1,360 GB (the same page).
    Chip("a100-80gb", "cuda", "NVIDIA A100-SXM4-80GB", 80 * GiB, 312e12, 2039e9, 300e9, 25e9, 8, 1360 * GiB,
         compute_capability=(8, 0), sm_count=108, clock_ghz=1.41, l2_bytes=40 * 2**20,
         shared_memory_per_sm=164 * 2**10),
    # nvidia.com/en-us/data-center/a100: SXM 40 GB HBM2 at 1555 GB/s, otherwise an A100 80 GB (SXM);
    # DGX A100 with 40 GB GPUs: one 200 Gb/s HDR port per GPU.
    # Host: a2-highgpu-8g, 96 vCPUs and 680 GB (the same page).
    Chip("a100-40gb", "cuda", "NVIDIA A100-SXM4-40GB", 40 * GiB, 312e12, 1555e9, 300e9, 25e9, 8, 680 * GiB,
         compute_capability=(8, 0), sm_count=108, clock_ghz=1.41, l2_bytes=40 * 2**20,
         shared_memory_per_sm=164 * 2**10),
)}


def chip_of_device_kind(device_kind: str) -> Chip | None:
    """The chip JAX reports as `device_kind` (its name or an alias), or None for a device not in the table."""
    return next((chip for chip in CHIPS.values() if device_kind in (chip.device_kind, *chip.device_kind_aliases)),
                None)
