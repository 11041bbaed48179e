"""Each host's RAM peak in the plan: what a checkpoint save and restore stage, HF import and export,
the data pipeline, against the host's RAM; a host peak over it is refused like an HBM peak."""

import jax
import pytest

from podtrain.orchestrator.common.chips import CHIPS
from podtrain.orchestrator.config.compose import load_config
from podtrain.orchestrator.plan.host_memory import fingerprint_bytes, host_memory, state_bytes_per_host
from podtrain.orchestrator.plan.targets import verdict_line
from podtrain.orchestrator.train.build import build_training

GiB = 2**30
# About 1.3 B parameters: a train state (float32 params and two AdamW moments) of about 16 GB,
# built as shapes and shardings only (nothing allocated).
LARGE = ["model.num_layers=8", "model.hidden_size=4096", "model.intermediate_size=11008", "model.num_heads=32",
         "model.num_kv_heads=8", "model.head_dim=128", "model.vocab_size=32000", "mesh.fsdp=4", "mesh.tp=2"]


def _state_bytes(training) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(training.abstract_state()))


@pytest.fixture(scope="module")
def large():
    return build_training(load_config("llama3-tiny", LARGE))


def test_a_save_stages_what_the_host_writes_and_a_restore_reads_every_shard_of_its_devices(large):
    leaves = jax.tree.leaves(large.abstract_state())
    state = _state_bytes(large)
    # One process holds all 8 devices: it writes every array once, whoever writes each shard.
    for parallel in (True, False):
        written = state_bytes_per_host(leaves, written=True, replica_parallel=parallel)
        assert written == {0: pytest.approx(state, abs=64)}
    # A restore reads each device's shard: a replicated array (the norms, the step) once per device.
    replicated = sum(x.size * x.dtype.itemsize for x in leaves if x.sharding.is_fully_replicated)
    assert state_bytes_per_host(leaves, written=False, replica_parallel=False) == {0: state + 7 * replicated}

    config = large.config
    host = host_memory(large, ram_bytes=CHIPS["v5p"].host_ram_bytes, platform="tpu")
    assert host["phases"]["checkpoint save"] == pytest.approx(state, abs=64)
    assert host["phases"]["checkpoint restore"] == state + 7 * replicated  # under Orbax's 96 GB bound
    hidden, vocab = config.model.hidden_size, config.model.vocab_size
    # The largest tensor is the embedding (a layer's MLP weight is 4096 x 11008): exported whole, and
    # imported as the shards of the 8 devices, which together are all of it; twice its bytes each.
    assert host["phases"]["HF export"] == host["phases"]["HF import"] == 2 * vocab * hidden * 4
    assert host["data_bytes"] == (config.data.prefetch + 2) * config.train.batch_size * config.train.seq_len * 20
    assert host["peak_of"] == "checkpoint restore" and host["fits"]
    assert host["peak_bytes"] == host["phases"]["checkpoint restore"] + host["data_bytes"]


def test_a_host_peak_over_the_hosts_ram_is_refused_and_the_bound_that_fits_is_named(large):
    ram = 12 * GiB
    host = host_memory(large, ram_bytes=ram, platform="tpu")
    assert not host["fits"] and host["peak_bytes"] > ram and host["headroom_bytes"] == ram - host["peak_bytes"]
    bound = host["host_gb"]
    assert bound == (ram - host["data_bytes"]) // 10**9 == 12
    report = {"target": "v5p-8", "fits": False, "hbm_fits": True, "peak_bytes": 10 * GiB, "hbm_bytes": 95 * GiB,
              "headroom_bytes": 85 * GiB, "host": host}
    over = (host["peak_bytes"] - ram) / GiB
    assert verdict_line(report) == (
        f"does not fit on v5p-8: host RAM peak {host['peak_bytes'] / GiB:.2f} GiB (checkpoint restore) of 12.00 GiB "
        f"per host (over by {over:.2f} GiB); fits with checkpoint.host_gb=12; peak 10.00 GiB of 95.00 GiB per device")

    # With the bound, a save and a restore hold at most that many GB: the same config fits.
    bounded = build_training(load_config("llama3-tiny", [*LARGE, f"checkpoint.host_gb={bound}"]))
    fits = host_memory(bounded, ram_bytes=ram, platform="tpu")
    assert fits["fits"] and fits["phases"]["checkpoint save"] == fits["phases"]["checkpoint restore"] == bound * 10**9
    # No bound helps when what is not a checkpoint (here the data pipeline) is over by itself.
    prefetching = build_training(load_config("llama3-tiny", [*LARGE, "data.prefetch=2000000"]))
    alone = host_memory(prefetching, ram_bytes=ram, platform="tpu")
    assert not alone["fits"] and "host_gb" not in alone and alone["data_bytes"] > ram


def test_on_cpu_devices_the_state_and_its_fingerprints_are_host_memory():
    training = build_training(load_config("llama3-tiny", ["model.num_layers=2", "mesh.fsdp=8"]))
    leaves = jax.tree.leaves(training.abstract_state())
    resident = state_bytes_per_host(leaves, written=False, replica_parallel=False)[0]
    fingerprints = fingerprint_bytes(leaves) * 8  # per device, 8 devices
    # XLA:CPU keeps some of the program's per-element temporaries: how many depends on its fusion.
    assert fingerprints > _state_bytes(training) // 2
    host = host_memory(training, ram_bytes=64 * GiB, platform="cpu", step_bytes=123)
    assert host["phases"]["checkpoint save"] == resident + max(host["orbax"]["save_staging_bytes"], fingerprints)
    assert host["phases"]["checkpoint restore"] == resident + fingerprints
    assert host["phases"]["train step"] == 123
