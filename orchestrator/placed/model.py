"""A model laid out on its mesh without being made: its graph and every parameter as a
ShapeDtypeStruct with its sharding, and the split of a LoRA model into trained adapters and the
frozen base. Variables are made only when asked for, each born sharded."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from flax import nnx
from jax.sharding import Mesh

from podtrain.models import ARCHITECTURES, ModelConfig
from podtrain.models.lora import LoRAConfig, LoRAParam, apply_lora, with_base
from podtrain.models.runner import only_layer
from podtrain.orchestrator.config.schema import Config
from podtrain.orchestrator.placed.kernels import resolve_kernels
from podtrain.sharding.place import abstract_model, create_sharded_state, state_shardings
from podtrain.sharding.rules import Rules, sharded_over


def model_factory(config: ModelConfig, seed: int = 0, lora: LoRAConfig | None = None, *,
                  slots: int = 0) -> Callable[[], nnx.Module]:
    """The model's constructor; with `lora` (rank > 0) the built model gets its adapters
    (`models.lora.apply_lora`, with `slots` adapter slots), inside the same traced factory, so they
    are born sharded too."""
    model_class = ARCHITECTURES[config.model_type].model_class

    def make() -> nnx.Module:
        model = model_class(config, rngs=nnx.Rngs(seed))
        return model if lora is None else apply_lora(model, lora, seed, slots=slots)

    return make


def trainable_filter(lora: LoRAConfig):
    """What a run trains and checkpoints: every parameter; with LoRA the adapters only, and the
    MoE routers' balancing biases, which the step moves itself (the base weights stay frozen)."""
    return nnx.Any(LoRAParam, nnx.PathContains("router_bias")) if lora.rank else nnx.Param


@dataclass(frozen=True)
class ModelSpec:
    """What is placed: the model (its kernels resolved), its adapters (`lora.rank` 0: none; `slots`
    adapter slots for a service) and the seed new weights are drawn from."""

    model: ModelConfig
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    seed: int = 0
    slots: int = 0

    def factory(self) -> Callable[[], nnx.Module]:
        return model_factory(self.model, self.seed, self.lora if self.lora.rank else None, slots=self.slots)


@dataclass
class PlacedModel:
    """A model placed on its mesh without being made: its graph, every parameter as a
    ShapeDtypeStruct with its sharding, and for a LoRA model the split into trained adapters and
    the frozen base."""

    spec: ModelSpec
    mesh: Mesh
    rules: Rules
    graphdef: nnx.GraphDef
    abstract_params: nnx.State  # every parameter of the model

    @property
    def trainable(self):
        return trainable_filter(self.spec.lora)

    def split(self, params: nnx.State) -> tuple[nnx.State, nnx.State | None]:
        """(trained, frozen) parts of the model's parameters; frozen is None without LoRA."""
        return nnx.split_state(params, self.trainable, ...) if self.spec.lora.rank else (params, None)

    def model(self, params: nnx.State, frozen: nnx.State | None) -> nnx.Module:
        """The model of the trained `params` and the `frozen` base."""
        return nnx.merge(self.graphdef, params, *(() if frozen is None else (frozen,)))

    @property
    def frozen_shardings(self) -> nnx.State | None:
        """The shardings of a LoRA model's frozen base (None: nothing is frozen)."""
        frozen = self.abstract_frozen()
        return None if frozen is None else state_shardings(frozen, self.mesh, self.rules)

    def abstract_trained(self) -> nnx.State:
        """The trained params as ShapeDtypeStructs with shardings (what a checkpoint's params restore into)."""
        return self.split(self.abstract_params)[0]

    def abstract_frozen(self) -> nnx.State | None:
        """The frozen base as ShapeDtypeStructs with shardings (None without LoRA)."""
        return self.split(self.abstract_params)[1]

    def create(self, keep=None) -> nnx.State:
        """The variables `keep` matches (None: all), born sharded from the spec's seed (no others
        are made)."""
        return create_sharded_state(self.spec.factory(), self.mesh, self.rules, layer_slice=only_layer, keep=keep)

    def from_base(self, base: nnx.State, keep=None) -> nnx.State:
        """The variables `keep` matches (None: all but the adapters) of the model with adapters,
        from `base`, the parameters of the model without them (a LoRA model's loaded base)."""
        return with_base(nnx.merge(self.graphdef, self.abstract_params), base, keep)

    def init_frozen(self, base: nnx.State | None = None) -> nnx.State | None:
        """The frozen base of a LoRA model: the frozen leaves of a loaded `base`, else born sharded
        from the spec's seed (None without LoRA)."""
        if not self.spec.lora.rank:
            return None
        frozen = nnx.Not(self.trainable)
        return self.create(frozen) if base is None else self.from_base(base, frozen)


def place(spec: ModelSpec, mesh: Mesh, rules: Rules) -> PlacedModel:
    """`spec`'s model placed on `mesh` by `rules`; nothing is made."""
    return PlacedModel(spec, mesh, rules, *abstract_model(spec.factory(), mesh, rules))


def place_model(config: Config, mesh: Mesh) -> PlacedModel:
    """The model of a training run's config (its `model`, `lora` and `train.seed`) placed on
    `mesh` (`make_mesh`), its kernels resolved for the mesh's devices and `train.seq_len`; nothing
    is made."""
    _, context = sharded_over(("seq",), dict(mesh.shape), config.sharding.rules)
    model = resolve_kernels(config.model, mesh.devices.flat[0].platform, config.train.seq_len, context=context)
    return place(ModelSpec(model, config.lora, config.train.seed), mesh, config.sharding.rules)
