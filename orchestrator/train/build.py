"""From a Config to the runtime objects of training: the placed model, optimizer, jitted step."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding

from podtrain.models.lora import LoRAParam
from podtrain.orchestrator.config.schema import Config
from podtrain.orchestrator.config.validate import check_batch, validate
from podtrain.orchestrator.placed.mesh import make_mesh
from podtrain.orchestrator.placed.model import PlacedModel, place_model, trainable_filter
from podtrain.orchestrator.train.optimizer import make_optimizer, make_schedule
from podtrain.orchestrator.train.sharded_step import ShardedStep
from podtrain.orchestrator.train.step import TrainState, make_train_step
from podtrain.sharding.place import state_shardings
from podtrain.sharding.state import batch_sharding, optimizer_state_shardings, replicated


@dataclass
class Training(PlacedModel):
    """The runtime pieces of a training run (built from data, never stored in the config): the
    placed model, the config (its kernels resolved), the optimizer, the shardings of the state and
    the batch, the compiled step."""

    config: Config
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
            params = self.create(self.trainable if self.spec.lora.rank else None)
        else:
            routers = nnx.All(self.trainable, nnx.Not(LoRAParam))
            params = nnx.merge_state(self.create(LoRAParam), self.from_base(base, routers))
        return jax.jit(init, in_shardings=(self.state_shardings.params,), out_shardings=self.state_shardings)(params)


def build_training(config: Config, devices: Sequence[jax.Device] | None = None) -> Training:
    """Validates `config` against the devices, then builds mesh, placed model, optimizer and step."""
    validate(config)
    mesh = make_mesh(config, devices)
    check_batch(config, dict(mesh.shape))
    placed = place_model(config, mesh)
    rules = placed.rules
    config = dataclasses.replace(config, model=placed.spec.model)  # its kernels resolved
    trained = placed.abstract_trained()
    params = state_shardings(trained, mesh, rules)
    schedule = make_schedule(config.optimizer, config.train.steps)
    tx = make_optimizer(config.optimizer, schedule)
    shardings = TrainState(step=replicated(mesh), params=params,
                           opt_state=optimizer_state_shardings(tx, trained, params, mesh))
    batch = batch_sharding(mesh, rules, config.train.batch_size)
    step_fn = make_train_step(placed.graphdef, tx, loss_chunk=config.train.loss_chunk,
                              grad_accum=config.train.grad_accum, schedule=schedule,
                              expert_bias_rate=config.model.moe.bias_update_rate,
                              trainable=trainable_filter(config.lora),
                              dropout_seed=config.train.seed if config.lora.rank and config.lora.dropout else None)
    step = ShardedStep(step_fn, mesh, rules, shardings, batch, placed.frozen_shardings)
    return Training(placed.spec, mesh, rules, placed.graphdef, placed.abstract_params, config, tx, shardings, batch,
                    step)
