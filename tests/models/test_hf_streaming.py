"""Import and export of a model 8x larger than a host-memory bound, on two JAX processes: each
process's resident memory grows by its own parameter shards and at most the bound.

On CPU devices the parameters themselves live in host memory, so what is bounded is the memory
beyond them: the peak resident set (`VmHWM`, reset just before each phase) less the resident set
before it and, for the import, less the shards the process then holds. JAX has compiled once
before (its first compile sets up the compiler, whatever the model)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file
from xla_flags import xla_flags

from podtrain.models import config_to_hf
from podtrain.models.architectures import ARCHITECTURES
from podtrain.models.hf_mapping import hf_shape
from podtrain.models.hf_read import INDEX_FILE
from podtrain.orchestrator.config.compose import load_config
from podtrain.sharding.mesh import build_mesh
from podtrain.sharding.place import abstract_model

pytestmark = pytest.mark.slow
BOUND = 80 << 20
# DeepSeek-V3 in small: 14 MoE layers of 32 experts, f32; its stacked expert weights are 224 MiB each.
OVERRIDES = ["model.num_layers=15", "model.hidden_size=256", "model.moe.num_experts=32", "model.moe.n_group=4",
             "model.moe.moe_intermediate_size=512", "model.param_dtype=float32"]

PROBE = """
import json, re, resource, sys, time
import jax
jax.distributed.initialize(f"127.0.0.1:{sys.argv[1]}", num_processes=2, process_id=int(sys.argv[2]),
                           initialization_timeout=60)
from flax import nnx
from podtrain.models import from_hf, to_hf
from podtrain.sharding.mesh import build_mesh

def status(key):
    return int(re.search(rf"{key}:\\s+(\\d+) kB", open("/proc/self/status").read())[1]) * 1024

def phase(run):
    before = status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak (VmHWM) starts again from the current resident set
    start = time.perf_counter()
    result = run()
    return result, status("VmHWM") - before, time.perf_counter() - start

mesh = build_mesh({"fsdp": 2, "ep": 2}, jax.devices())
jax.jit(lambda: jax.numpy.zeros(4), out_shardings=jax.NamedSharding(mesh, jax.P()))().block_until_ready()  # JAX warm
(config, model), imported, import_s = phase(lambda: from_hf(sys.argv[3], mesh=mesh))
shards = sum(s.data.nbytes for _, v in nnx.to_flat_state(nnx.state(model)) for s in v.get_value().addressable_shards)
_, exported, export_s = phase(lambda: to_hf(model, config, sys.argv[4], max_shard_bytes=32 << 20))
print(json.dumps({"import_growth": imported, "shards": shards, "export_growth": exported, "import_s": import_s,
                  "export_s": export_s, "maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def write_source(directory: Path, config) -> dict[str, tuple]:
    """A random HF checkpoint of `config`, written a file (of at most 32 MiB) at a time."""
    mapping = ARCHITECTURES[config.model_type].hf_mapping
    _, abstract = abstract_model(lambda: ARCHITECTURES[config.model_type].model_class(config, rngs=nnx.Rngs(0)),
                                 build_mesh({}, __import__("jax").devices()[:1]))
    shapes = {}
    for path, var in nnx.to_flat_state(abstract):
        names, axes = mapping.names(".".join(map(str, path)), config, var.shape)
        shapes |= {name: hf_shape(var.shape[names.ndim:], axes) for name in names.flat}
    directory.mkdir()
    rng, weight_map, pending, number = np.random.default_rng(0), {}, {}, 0

    def flush():
        nonlocal pending, number
        number += 1
        save_file(pending, directory / f"part-{number}.safetensors", metadata={"format": "pt"})
        weight_map.update({name: f"part-{number}.safetensors" for name in pending})
        pending = {}

    for name, shape in shapes.items():
        pending[name] = rng.normal(scale=0.02, size=shape).astype(np.float32)
        if sum(t.nbytes for t in pending.values()) >= 32 << 20:
            flush()
    flush()
    (directory / INDEX_FILE).write_text(json.dumps({"weight_map": weight_map}))
    (directory / "config.json").write_text(json.dumps(config_to_hf(config)))
    return shapes


def run_probe(source: Path, exported: Path, timeout: int = 600) -> list[dict]:
    """Imports `source` and exports it to `exported` on two JAX processes; what each measured."""
    from podtrain.orchestrator.cluster.host import free_port

    port, root = free_port("127.0.0.1"), Path(__file__).parents[2]
    # A fixed mmap threshold makes glibc return freed large blocks at once: the resident set then
    # shows what is in use, not what the allocator keeps for reuse.
    env = dict(os.environ, PYTHONPATH=str(root), XLA_FLAGS=xla_flags(2), JAX_PLATFORMS="cpu",
               MALLOC_MMAP_THRESHOLD_="131072")
    procs = [subprocess.Popen([sys.executable, "-c", PROBE, str(port), str(i), str(source), str(exported)], cwd=root,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    outputs = [p.communicate(timeout=timeout) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-3000:] for _, err in outputs]
    return [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]


def test_import_and_export_of_a_model_8x_the_bound_stay_within_it_per_process(tmp_path):
    config = load_config("deepseek-v3-tiny", OVERRIDES).model
    source, exported = tmp_path / "source", tmp_path / "exported"
    shapes = write_source(source, config)
    model_bytes = sum(4 * int(np.prod(s)) for s in shapes.values())
    assert model_bytes >= 8 * BOUND, model_bytes
    for measured in run_probe(source, exported):
        assert measured["import_growth"] - measured["shards"] <= BOUND, measured
        assert measured["export_growth"] <= BOUND, measured
    index = json.loads((exported / INDEX_FILE).read_text())["weight_map"]
    assert sorted(index) == sorted(shapes)
    source_index = json.loads((source / INDEX_FILE).read_text())["weight_map"]
    for file in sorted(set(index.values())):
        with safe_open(exported / file, "numpy") as out:
            for name in out.keys():  # noqa: SIM118 (safe_open has no __iter__)
                with safe_open(source / source_index[name], "numpy") as src:
                    assert out.get_tensor(name).tobytes() == src.get_tensor(name).tobytes(), name
