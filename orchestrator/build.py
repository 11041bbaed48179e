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
from podtrain.models.attention import backend_for, check_backend
from podtrain.models.runner import only_layer
from podtrain.orchestrator.config import ConfigError, validate
from podtrain.orchestrator.optimizer import make_optimizer, make_schedule
from podtrain.orchestrator.schema import Config
from podtrain.orchestrator.sharded_step import ShardedStep
from podtrain.orchestrator.step import TrainState, make_train_step
from podtrain.sharding.mesh import build_mesh
from podtrain.sharding.place import abstract_model, create_sharded, state_shardings
from podtrain.sharding.state import batch_sharding, optimizer_state_shardings, replicated


def model_factory(config: ModelConfig, seed: int = 0) -> Callable[[], nnx.Module]:
    return lambda: ARCHITECTURES[config.model_type].model_class(config, rngs=nnx.Rngs(seed))


@dataclass
class Training:
    """The runtime pieces of a training run (built from data, never stored in the config)."""

    config: Config
    mesh: Mesh
    graphdef: nnx.GraphDef
    abstract_params: nnx.State
    tx: optax.GradientTransformation
    state_shardings: TrainState
    batch_sharding: NamedSharding
    step: ShardedStep

    def abstract_state(self) -> TrainState:
        """The TrainState as ShapeDtypeStructs with shardings (for lowering and restoring)."""
        shapes = jax.eval_shape(
            lambda p: TrainState(step=jnp.zeros((), jnp.int32), params=p, opt_state=self.tx.init(p)),
            self.abstract_params,
        )
        return jax.tree.map(
            lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, self.state_shardings
        )

    def abstract_batch(self) -> dict:
        t = self.config.train
        ids = jax.ShapeDtypeStruct((t.batch_size, t.seq_len), jnp.int32, sharding=self.batch_sharding)
        weights = jax.ShapeDtypeStruct((t.batch_size, t.seq_len), jnp.float32, sharding=self.batch_sharding)
        return {"inputs": ids, "targets": ids, "weights": weights, "positions": ids, "segment_ids": ids}

    def init_state(self) -> TrainState:
        """Creates params born sharded from `train.seed`, then the optimizer state."""
        model = create_sharded(model_factory(self.config.model, self.config.train.seed), self.mesh,
                               self.config.sharding.rules, layer_slice=only_layer)

        def init(params):  # the optimizer state is born sharded, as the params are
            return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=self.tx.init(params))

        return jax.jit(init, in_shardings=(self.state_shardings.params,), out_shardings=self.state_shardings)(
            nnx.state(model))


def make_mesh(config: Config, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Validates `config` against the devices (all of JAX's by default), then builds its mesh."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = validate(config, len(devices))
    try:
        return build_mesh(sizes, devices, num_slices=config.cluster.num_slices)
    except ValueError as e:  # a mesh the devices' topology cannot hold, or dp not spanning the slices
        raise ConfigError(str(e)) from None


def resolve_attention(config: Config, platform: str) -> Config:
    """`config` with `model.attention` resolved for devices of `platform` (the one place "auto" is
    decided for a run); a ConfigError when the chosen backend cannot run there."""
    m = config.model
    try:
        check_backend(m.attention, platform, m.dtype, config.train.seq_len)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    attention = backend_for(m.attention, platform, m.dtype, config.train.seq_len)
    return dataclasses.replace(config, model=dataclasses.replace(m, attention=attention))


def build_training(config: Config, devices: Sequence[jax.Device] | None = None) -> Training:
    """Validates `config` against the devices, then builds mesh, abstract model, optimizer and step."""
    mesh = make_mesh(config, devices)
    config = resolve_attention(config, mesh.devices.flat[0].platform)
    rules = config.sharding.rules
    graphdef, abstract = abstract_model(model_factory(config.model, config.train.seed), mesh, rules)
    params = state_shardings(abstract, mesh, rules)
    schedule = make_schedule(config.optimizer, config.train.steps)
    tx = make_optimizer(config.optimizer, schedule)
    shardings = TrainState(step=replicated(mesh), params=params,
                           opt_state=optimizer_state_shardings(tx, abstract, params, mesh))
    batch = batch_sharding(mesh, rules, config.train.batch_size)
    step_fn = make_train_step(graphdef, tx, loss_chunk=config.train.loss_chunk, grad_accum=config.train.grad_accum,
                              schedule=schedule, expert_bias_rate=config.model.moe.bias_update_rate)
    step = ShardedStep(step_fn, mesh, rules, shardings, batch)
    return Training(config, mesh, graphdef, abstract, tx, shardings, batch, step)
