"""What the engine holds, laid out but not allocated: the serve config's model with its adapter
slots on the mesh, every array as a `jax.ShapeDtypeStruct` with its sharding.

The engine allocates exactly this; `podtrain plan --serve` compiles the engine's programs on it for
a target without allocating anything.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from podtrain.models.lora import LoRAConfig, LoRAParam
from podtrain.orchestrator.placed.kernels import resolve_kernels
from podtrain.orchestrator.placed.mesh import make_mesh
from podtrain.orchestrator.placed.model import ModelSpec, PlacedModel, place
from podtrain.orchestrator.serve.checks import slot_targets
from podtrain.orchestrator.serve.programs import AdamState, Batch, SampleBatch, axes_tree, slot_axes
from podtrain.sharding.rules import Rules, axes_of, use_rules


@dataclasses.dataclass(frozen=True)
class EngineLayout:
    config: object  # the serve config
    placed: PlacedModel  # the base model with the slots' adapters (`serve.*`), its kernels resolved
    graphdef: nnx.GraphDef  # of (adapters, rest)
    adapters: nnx.State  # every slot's adapters, abstract
    rest: nnx.State  # the base weights, abstract
    axes: tuple[int, ...]  # each adapter leaf's adapter axis

    @property
    def mesh(self) -> Mesh:
        return self.placed.mesh

    def adam_shardings(self) -> AdamState:
        """The moments' shardings: each adapter leaf's, its adapter axis first; the counts replicated."""
        def moved(x, axis):
            spec = [*x.sharding.spec, *([None] * (x.ndim - len(x.sharding.spec)))]
            entry = spec.pop(axis)
            return NamedSharding(self.mesh, PartitionSpec(entry, *spec))

        moments = jax.tree.map(moved, self.adapters, axes_tree(self.adapters, self.axes))
        return AdamState(moments, moments, NamedSharding(self.mesh, PartitionSpec()))

    def adam(self) -> AdamState:
        """Every slot's Adam state, abstract (float32 moments, slot-major)."""
        shardings = self.adam_shardings()

        def moment(x, axis, sharding):
            shape = (x.shape[axis], *x.shape[:axis], *x.shape[axis + 1:])
            return jax.ShapeDtypeStruct(shape, jnp.float32, sharding=sharding)

        tree = axes_tree(self.adapters, self.axes)
        mu = jax.tree.map(moment, self.adapters, tree, shardings.mu)
        count = jax.ShapeDtypeStruct((self.config.serve.max_adapters,), jnp.int32, sharding=shardings.count)
        return AdamState(mu, mu, count)

    def _replicated(self, shape, dtype) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(self.mesh, PartitionSpec()))

    def batch(self, rows: int, tokens: int) -> Batch:
        """A training batch of `rows` x `tokens`, abstract."""
        fields = {f.name: f for f in dataclasses.fields(Batch)}
        ints = {"tokens", "targets", "slot", "rank", "loss"}
        per_token = {"tokens", "targets", "weights", "sampling_lp", "advantages", "real"}
        return Batch(**{name: self._replicated((rows, tokens) if name in per_token else (rows,),
                                               jnp.int32 if name in ints else jnp.float32) for name in fields})

    def sample_batch(self, rows: int, prompt: int, stops: int = 8) -> SampleBatch:
        """A sampling batch of `rows` prompts of up to `prompt` tokens, abstract."""
        ints = {"prompt", "length", "slot", "rank", "top_k", "seed", "stop", "max_tokens"}
        shapes = {"prompt": (rows, prompt), "stop": (rows, stops)}
        return SampleBatch(**{f.name: self._replicated(shapes.get(f.name, (rows,)),
                                                       jnp.int32 if f.name in ints else jnp.float32)
                              for f in dataclasses.fields(SampleBatch)})


def slot_rules(rules: Rules, sizes: dict[str, int], rank: int) -> dict:
    """`rules` with the slots' rank axis ("lora_slot_rank") on those of its mesh axes whose sizes
    multiply to a divisor of `rank`, taken in order: the slots' state is sharded over as many
    devices as the rank allows."""
    kept, product = [], 1
    for axis in axes_of(rules.get("lora_slot_rank")):
        size = sizes.get(axis, 1)
        if size > 1 and rank % (product * size) == 0:
            kept.append(axis)
            product *= size
    return {**rules, "lora_slot_rank": kept or None}


def engine_layout(config, devices=None) -> EngineLayout:
    """The engine of `config` (a serve config) on `devices` (default: all), laid out: the base
    model (`serve.base`, else drawn from `serve.seed`) with `serve.max_adapters` slots of rank
    `serve.max_rank` on every target the architecture offers, its kernels chosen for rows of
    `serve.max_seq_len` tokens."""
    s = config.serve
    mesh = make_mesh(config, devices)
    model = resolve_kernels(config.model, mesh.devices.flat[0].platform, s.max_seq_len, seq_key="serve.max_seq_len")
    lora = LoRAConfig(rank=s.max_rank, alpha=s.lora_alpha, targets=slot_targets(model), base=s.base)
    rules = slot_rules(config.sharding.rules, dict(mesh.shape), s.max_rank)
    with use_rules(rules):
        placed = place(ModelSpec(model, lora, s.seed, slots=s.max_adapters), mesh, rules)
    graphdef, adapters, rest = nnx.split(nnx.merge(placed.graphdef, placed.abstract_params), LoRAParam, ...)
    return EngineLayout(config, placed, graphdef, adapters, rest, slot_axes(adapters))
