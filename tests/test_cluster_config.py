"""The cluster config and reservation shapes, without starting Ray."""

import pytest

from orchestrator.cluster.driver import _normalise
from orchestrator.cluster.reserve import _bundles, host_env, megascale_env, tpu_topology
from orchestrator.config import ConfigError, load_config


@pytest.mark.parametrize("tpu_type, topology", [
    ("v4-8", "2x2x1"), ("v4-16", "2x2x2"), ("v5p-64", "2x4x4"), ("v5p-128", "4x4x4"), ("v6e-16", "4x4"),
    ("v6e-8", "2x4"), ("v5litepod-16", "4x4"),
])
def test_tpu_types_map_to_their_default_topology(tpu_type, topology):
    assert tpu_topology(tpu_type) == topology


def test_cluster_shorthand_and_kinds():
    config = load_config("llama3-tiny", ["cluster=gpu", "cluster.num_nodes=4", "cluster.gpus_per_node=8"])
    assert config.cluster.kind == "gpu"
    bundles, strategy, options = _bundles(config.cluster)
    assert bundles == [{"CPU": 1.0, "GPU": 8}] * 4 and strategy == "STRICT_SPREAD" and options["num_gpus"] == 8
    assert host_env(config.cluster, {"gpu_ids": [4, 5, 6, 7]}) == {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}
    local = load_config("llama3-tiny", ["cluster.num_hosts=3", "cluster.devices_per_host=2",
                                        "cluster.env.FOO=bar"]).cluster
    assert _bundles(local)[:2] == ([{"CPU": 1.0}] * 3, "PACK")
    assert host_env(local, {}) == {"JAX_PLATFORMS": "cpu", "FOO": "bar",
                                   "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    # The driver's other XLA flags reach the workers; its device count does not.
    inherited = "--xla_force_host_platform_device_count=8 --xla_dump_to=/tmp/hlo"
    assert host_env(local, {}, xla_flags=inherited)["XLA_FLAGS"] == (
        "--xla_force_host_platform_device_count=2 --xla_dump_to=/tmp/hlo")
    # cluster.env.XLA_FLAGS replaces the driver's flags, and the host still gets its device count.
    own = load_config("llama3-tiny", ["cluster.devices_per_host=2",
                                      "cluster.env.XLA_FLAGS=--xla_cpu_use_thunk_runtime=true"])
    assert host_env(own.cluster, {}, xla_flags=inherited)["XLA_FLAGS"] == (
        "--xla_force_host_platform_device_count=2 --xla_cpu_use_thunk_runtime=true")


def test_megascale_variables_only_for_several_tpu_slices():
    two = load_config("llama3-tiny", ["cluster=tpu", "cluster.tpu_type=v5p-64", "cluster.num_slices=2"]).cluster
    assert megascale_env(two, "10.0.0.2", 1, 8081) == {
        "MEGASCALE_COORDINATOR_ADDRESS": "10.0.0.2", "MEGASCALE_PORT": "8081", "MEGASCALE_NUM_SLICES": "2",
        "MEGASCALE_SLICE_ID": "1"}
    one = load_config("llama3-tiny", ["cluster=tpu", "cluster.tpu_type=v5p-64"]).cluster
    assert megascale_env(one, "10.0.0.2", 0, 8081) == {}


@pytest.mark.parametrize("override, needle", [
    ("cluster=slurm", "cluster.kind: expected one of ['local', 'tpu', 'gpu', 'none'], found 'slurm'"),
    ("cluster.num_hosts=0", "cluster.num_hosts: expected a positive integer, found 0"),
    ("cluster.hang_timeout_s=-1", "cluster.hang_timeout_s: expected a positive number of seconds"),
])
def test_bad_cluster_config_is_one_clear_line(override, needle):
    with pytest.raises(ConfigError) as info:
        load_config("llama3-tiny", [override])
    assert needle in str(info.value)


def test_a_tpu_cluster_needs_a_tpu_type():
    with pytest.raises(ConfigError, match="cluster.tpu_type: expected a TPU type such as 'v5p-64'"):
        load_config("llama3-tiny", ["cluster=tpu"])


def test_tracebacks_compare_without_addresses():
    a = "Traceback\n  File x, line 3\nValueError: <object at 0x7f00aa>"
    b = "Traceback\n  File x, line 3\nValueError: <object at 0x7f11bb>"
    assert _normalise(a) == _normalise(b) != _normalise(a.replace("line 3", "line 4"))
