"""From a Config to the runtime objects of training: mesh, sharded model, optimizer, jitted step."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from podtrain.models import ARCHITECTURES, ModelConfig
from podtrain.models.runner import only_layer
from podtrain.orchestrator.config import ConfigError, validate
from podtrain.orchestrator.schema import Config
from podtrain.orchestrator.step import (
    ShardedStep,
    TrainState,
    batch_shardings,
    init_train_state,
    make_optimizer,
    make_schedule,
    make_train_step,
    train_state_shardings,
)
from podtrain.sharding.mesh import build_mesh
from podtrain.sharding.place import abstract_model, create_sharded


def model_factory(config: ModelConfig, seed: int = 0) -> Callable[[], nnx.Module]:
    return lambda: ARCHITECTURES[config.model_type](config, rngs=nnx.Rngs(seed))


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
        return init_train_state(nnx.state(model), self.tx, self.state_shardings)

    def random_batch(self, seed: int = 0) -> dict:
        """A batch of uniformly random tokens (one document per row), placed with the batch sharding."""
        t, vocab = self.config.train, self.config.model.vocab_size
        tokens = np.random.default_rng(seed).integers(0, vocab, (t.batch_size, t.seq_len + 1), dtype=np.int32)
        batch = {
            "inputs": tokens[:, :-1],
            "targets": tokens[:, 1:],
            "weights": np.ones((t.batch_size, t.seq_len), np.float32),
            "positions": np.broadcast_to(np.arange(t.seq_len, dtype=np.int32), (t.batch_size, t.seq_len)),
            "segment_ids": np.ones((t.batch_size, t.seq_len), np.int32),
        }
        # Each process places only the rows its devices hold (multi-process correct).
        return {
            k: jax.make_array_from_callback(v.shape, self.batch_sharding, lambda index, v=v: v[index])
            for k, v in batch.items()
        }


def build_training(config: Config, devices: Sequence[jax.Device] | None = None) -> Training:
    """Validates `config` against the devices, then builds mesh, abstract model, optimizer and step."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = validate(config, len(devices))
    try:
        mesh = build_mesh(sizes, devices, num_slices=config.cluster.num_slices)
    except ValueError as e:  # a mesh the devices' topology cannot hold, or dp not spanning the slices
        raise ConfigError(str(e)) from None
    rules = config.sharding.rules
    graphdef, abstract = abstract_model(model_factory(config.model, config.train.seed), mesh, rules)
    param_shardings = jax.tree.map(
        lambda v: v.replace(v.get_value().sharding), abstract, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )
    schedule = make_schedule(config.optimizer, config.train.steps)
    tx = make_optimizer(config.optimizer, schedule)
    state_shardings = train_state_shardings(param_shardings, abstract, tx, mesh)
    batch_sharding = batch_shardings(mesh, rules, config.train.batch_size)
    step_fn = make_train_step(graphdef, tx, loss_chunk=config.train.loss_chunk, grad_accum=config.train.grad_accum,
                              schedule=schedule, expert_bias_rate=config.model.moe.bias_update_rate)
    step = ShardedStep(step_fn, mesh, rules, state_shardings, batch_sharding)
    return Training(config, mesh, graphdef, abstract, tx, state_shardings, batch_sharding, step)


def with_model(config: Config, **changes) -> Config:
    """A copy of `config` with some model fields changed (benchmarks and tests sweep these)."""
    return dataclasses.replace(config, model=config.model.replace(**changes))
