"""From a Config to the runtime objects of training: mesh, sharded model, optimizer, jitted step."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from podtrain.models import ARCHITECTURES, ModelConfig
from podtrain.models.kernels.attention import check_backend, resolve_backend
from podtrain.models.kernels.exchange import resolve_exchange
from podtrain.models.kernels.grouped_matmul import resolve_grouped_matmul
from podtrain.models.lora import LoRAConfig, LoRAParam, apply_lora, with_base
from podtrain.models.runner import only_layer
from podtrain.orchestrator.common.errors import ConfigError
from podtrain.orchestrator.config.schema import Config
from podtrain.orchestrator.config.validate import validate
from podtrain.orchestrator.train.optimizer import make_optimizer, make_schedule
from podtrain.orchestrator.train.sharded_step import ShardedStep
from podtrain.orchestrator.train.step import TrainState, make_train_step
from podtrain.sharding.mesh import build_mesh
from podtrain.sharding.place import abstract_model, create_sharded_state, state_shardings
from podtrain.sharding.state import batch_sharding, optimizer_state_shardings, replicated


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


def split_trained(params: nnx.State, lora: LoRAConfig) -> tuple[nnx.State, nnx.State | None]:
    """(trained, frozen) parts of the model's parameters; frozen is None without LoRA."""
    return nnx.split_state(params, trainable_filter(lora), ...) if lora.rank else (params, None)


@dataclass
class PlacedModel:
    """A run's model placed on its mesh without being made: its graph, every parameter as a
    ShapeDtypeStruct with its sharding, and for a LoRA run the split into trained adapters and the
    frozen base. What loading for generation needs, without an optimizer or a step."""

    config: Config
    mesh: Mesh
    graphdef: nnx.GraphDef
    abstract_params: nnx.State  # every parameter of the model

    @property
    def trainable(self):
        return trainable_filter(self.config.lora)

    def split(self, params: nnx.State) -> tuple[nnx.State, nnx.State | None]:
        return split_trained(params, self.config.lora)

    def model(self, params: nnx.State, frozen: nnx.State | None) -> nnx.Module:
        """The model of the trained `params` and the `frozen` base."""
        return nnx.merge(self.graphdef, params, *(() if frozen is None else (frozen,)))

    @property
    def frozen_shardings(self) -> nnx.State | None:
        """The shardings of a LoRA run's frozen base (None: nothing is frozen)."""
        frozen = self.split(self.abstract_params)[1]
        return None if frozen is None else state_shardings(frozen, self.mesh, self.config.sharding.rules)

    def abstract_trained(self) -> nnx.State:
        """The trained params as ShapeDtypeStructs with shardings (what a checkpoint's params restore into)."""
        return self.split(self.abstract_params)[0]

    def abstract_frozen(self) -> nnx.State | None:
        """The frozen base as ShapeDtypeStructs with shardings (None without LoRA)."""
        return self.split(self.abstract_params)[1]

    def _create(self, keep) -> nnx.State:
        """The variables `keep` matches, born sharded from `train.seed` (no others are made)."""
        return create_sharded_state(model_factory(self.config.model, self.config.train.seed, self.config.lora),
                                    self.mesh, self.config.sharding.rules, layer_slice=only_layer, keep=keep)

    def _from_base(self, base: nnx.State, keep) -> nnx.State:
        """The variables `keep` matches of the model with adapters, from `base`, the parameters of
        the model without them (a LoRA run's loaded base)."""
        return with_base(nnx.merge(self.graphdef, self.abstract_params), base, keep)

    def init_frozen(self, base: nnx.State | None = None) -> nnx.State | None:
        """The frozen base of a LoRA run: the frozen leaves of a loaded `base`, else born sharded
        from `train.seed` (None without LoRA)."""
        if not self.config.lora.rank:
            return None
        frozen = nnx.Not(self.trainable)
        return self._create(frozen) if base is None else self._from_base(base, frozen)


@dataclass
class Training(PlacedModel):
    """The runtime pieces of a training run (built from data, never stored in the config): the
    placed model, the optimizer, the shardings of the state and the batch, the compiled step."""

    tx: optax.GradientTransformation
    state_shardings: TrainState
    batch_sharding: NamedSharding
    step: ShardedStep

    def abstract_state(self) -> TrainState:
        """The TrainState as ShapeDtypeStructs with shardings (for lowering and restoring)."""
        shapes = jax.eval_shape(
            lambda p: TrainState(step=jnp.zeros((), jnp.int32), params=p, opt_state=self.tx.init(p)),
            self.abstract_trained(),
        )
        return jax.tree.map(
            lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, self.state_shardings
        )

    def abstract_batch(self) -> dict:
        t = self.config.train
        ids = jax.ShapeDtypeStruct((t.batch_size, t.seq_len), jnp.int32, sharding=self.batch_sharding)
        weights = jax.ShapeDtypeStruct((t.batch_size, t.seq_len), jnp.float32, sharding=self.batch_sharding)
        return {"inputs": ids, "targets": ids, "weights": weights, "positions": ids, "segment_ids": ids}

    def init_state(self, base: nnx.State | None = None) -> TrainState:
        """Creates the trained params born sharded from `train.seed` (a LoRA run's adapters; with
        a loaded `base` (parameters of the model without adapters), its trained leaves, DeepSeek-V3's
        router biases, come from it), then the optimizer state."""

        def init(params):  # the optimizer state is born sharded, as the params are
            return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=self.tx.init(params))

        if base is None:
            params = self._create(self.trainable if self.config.lora.rank else None)
        else:
            routers = nnx.All(self.trainable, nnx.Not(LoRAParam))
            params = nnx.merge_state(self._create(LoRAParam), self._from_base(base, routers))
        return jax.jit(init, in_shardings=(self.state_shardings.params,), out_shardings=self.state_shardings)(params)

def make_mesh(config: Config, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Validates `config` against the devices (all of JAX's by default), then builds its mesh."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = validate(config, len(devices))
    try:
        return build_mesh(sizes, devices, num_slices=config.cluster.num_slices)
    except ValueError as e:  # a mesh the devices' topology cannot hold, or dp not spanning the slices
        raise ConfigError(str(e)) from None


def resolve_kernels(config: Config, platform: str) -> Config:
    """`config` with its kernels resolved for devices of `platform` (the one place "auto" is
    decided for a run, and the only question asked of the platform): `model.attention`,
    `model.moe.grouped_matmul`, `model.moe.exchange`, and `model.interpret_kernels` (Pallas
    kernels interpreted on CPU devices). A ConfigError when the chosen attention cannot run there."""
    m = config.model
    try:
        check_backend(m.attention, platform, m.dtype, config.train.seq_len)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    moe = dataclasses.replace(m.moe, grouped_matmul=resolve_grouped_matmul(m.moe.grouped_matmul, platform),
                              exchange=resolve_exchange(m.moe.exchange, platform))
    model = dataclasses.replace(m, attention=resolve_backend(m.attention, platform, m.dtype, config.train.seq_len),
                                moe=moe, interpret_kernels=m.interpret_kernels or platform == "cpu")
    return dataclasses.replace(config, model=model)


def place_model(config: Config, devices: Sequence[jax.Device] | None = None) -> PlacedModel:
    """Validates `config` against the devices, resolves its kernels for them, then places its
    model (with a LoRA run's adapters) on its mesh; nothing is made."""
    mesh = make_mesh(config, devices)
    config = resolve_kernels(config, mesh.devices.flat[0].platform)
    factory = model_factory(config.model, config.train.seed, config.lora)
    return PlacedModel(config, mesh, *abstract_model(factory, mesh, config.sharding.rules))


def build_training(config: Config, devices: Sequence[jax.Device] | None = None) -> Training:
    """Validates `config` against the devices, then builds mesh, abstract model, optimizer and step."""
    placed = place_model(config, devices)
    config, mesh, graphdef, rules = placed.config, placed.mesh, placed.graphdef, placed.config.sharding.rules
    trained = placed.abstract_trained()
    params = state_shardings(trained, mesh, rules)
    schedule = make_schedule(config.optimizer, config.train.steps)
    tx = make_optimizer(config.optimizer, schedule)
    shardings = TrainState(step=replicated(mesh), params=params,
                           opt_state=optimizer_state_shardings(tx, trained, params, mesh))
    batch = batch_sharding(mesh, rules, config.train.batch_size)
    step_fn = make_train_step(graphdef, tx, loss_chunk=config.train.loss_chunk, grad_accum=config.train.grad_accum,
                              schedule=schedule, expert_bias_rate=config.model.moe.bias_update_rate,
                              trainable=trainable_filter(config.lora),
                              dropout_seed=config.train.seed if config.lora.rank and config.lora.dropout else None)
    step = ShardedStep(step_fn, mesh, rules, shardings, batch, placed.frozen_shardings)
    return Training(config, mesh, graphdef, placed.abstract_params, tx, shardings, batch, step)
