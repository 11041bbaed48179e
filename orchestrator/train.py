"""The training loop: a plain Python loop around the jitted step, with explicit hooks.

`run(config, run_dir)` builds everything from the config, resumes from the latest committed
checkpoint (`checkpoint.resume=auto`), trains to `train.steps`, and returns what happened. Every
process runs it (one per host); only process 0 writes the config, metrics and logs.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from orbax.checkpoint import multihost

from podtrain.models.generate import generate
from podtrain.orchestrator.build import Training, build_training
from podtrain.orchestrator.checkpoint import Checkpointer, run_metadata
from podtrain.orchestrator.cluster import protocol
from podtrain.orchestrator.config import ConfigError, checkpoint_directory, to_yaml
from podtrain.orchestrator.data import make_dataset, process_rows, row_positions, set_row_positions, to_global_batch
from podtrain.orchestrator.metrics import MetricsWriter, expert_metrics, peak_flops_per_device
from podtrain.orchestrator.plan import flops_per_token
from podtrain.orchestrator.preflight import Inputs, check_inputs, evals_enabled, sample_prompt_ids
from podtrain.orchestrator.schema import Config
from podtrain.orchestrator.step import make_eval_step
from podtrain.orchestrator.tokenizers import Tokenizer
from podtrain.sharding.mesh import describe_mesh
from podtrain.sharding.rules import use_rules

logger = logging.getLogger(__name__)

# Exit status of a run that stopped on a preemption notice after committing a checkpoint
# (EX_TEMPFAIL): the orchestrator restarts it without charging the failure budget.
EXIT_PREEMPTED = protocol.EXIT_PREEMPTED


@dataclasses.dataclass
class RunResult:
    """What a run did: steps, losses, throughput, where things are."""

    run_dir: Path
    start_step: int
    end_step: int
    first_loss: float | None
    last_loss: float | None
    tokens_per_s: float
    last_checkpoint: int | None
    preempted: bool
    data_ended: bool = False

    def summary(self) -> str:
        """What a user reads at the end of a run: steps, first and last loss, tokens/s, where things went."""
        if self.first_loss is None:
            lines = [f"nothing to do: the run is already at step {self.end_step} of train.steps"]
        else:
            lines = [f"steps {self.start_step} -> {self.end_step}; loss first {self.first_loss:.4f}, "
                     f"last {self.last_loss:.4f}; {self.tokens_per_s:,.0f} tokens/s"]
        lines.append(f"run directory {self.run_dir}: config.yaml, metrics.jsonl, tensorboard/, "
                     f"checkpoints/ (last committed step {self.last_checkpoint})")
        if self.preempted:
            lines.append(f"stopped on a preemption notice (SIGTERM, or Ctrl-C) after checkpointing step "
                         f"{self.last_checkpoint}; run the same command to resume")
        if self.data_ended:
            lines.append(f"stopped at step {self.end_step}: the training data ended (data.epochs)")
        return "\n".join(lines)


class PreemptionNotice:
    """Turns SIGTERM into a checkpoint at the next step boundary, agreed by every process.

    With several processes JAX's own notifier catches SIGTERM and `reached_preemption_sync_point`
    makes every process stop at the same step; alone, a handler sets a flag, and Ctrl-C (SIGINT)
    does the same the first time (the second one interrupts at once).
    """

    def __init__(self):
        self.received = False
        self.multi_process = jax.process_count() > 1
        self._previous = {}
        if not self.multi_process:
            for signum in (signal.SIGTERM, signal.SIGINT):
                self._previous[signum] = signal.signal(signum, self._handle)

    def restore(self) -> None:
        """Gives SIGTERM and SIGINT back the handlers they had before."""
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _handle(self, signum, frame):
        self.received = True
        if signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            print("\nCtrl-C: stopping after the next step and its checkpoint (Ctrl-C again to stop at once)",
                  file=sys.stderr, flush=True)

    def reached(self, step: int) -> bool:
        if self.multi_process:
            return multihost_utils.reached_preemption_sync_point(step)
        return self.received


def _datasets(config: Config, inputs: Inputs, rows: range):
    """This process's train and (when evals are on) eval batches, from the corpus the checks opened."""
    kwargs = dict(seq_len=config.train.seq_len, global_batch=config.train.batch_size, rows=rows,
                  corpus=inputs.corpus)
    try:
        train = make_dataset(config.data, inputs.tokenizer, **kwargs)
        evals = make_dataset(config.data, inputs.tokenizer, split="eval", **kwargs) if evals_enabled(config) else None
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return train, evals


def use_compilation_cache(directory: str, run_dir: Path) -> None:
    """Points JAX's persistent compilation cache at `directory` (relative to `run_dir`), unless it
    is empty or `JAX_COMPILATION_CACHE_DIR` already chose one, and caches every program however
    short its compile (JAX's default skips those under 1 s: the many small init programs then
    compile again at every restart) unless `JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS` is set."""
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    if not directory or os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return
    path = Path(directory) if Path(directory).is_absolute() else run_dir / directory
    jax.config.update("jax_compilation_cache_dir", str(path))


def compile_then_meet(step_fn, *args, timeout_s: float) -> None:
    """Compiles `step_fn` for `args` (the jitted call reuses it), then waits until every process
    has: a barrier of the coordination service, not a collective. On CPU, gloo gives a process
    30 s to join a collective's first run, and a process that loads its program from the
    persistent compilation cache (only process 0 writes it; on CPU its keys differ per process)
    would otherwise wait there for processes still compiling."""
    if jax.process_count() == 1:
        return
    step_fn.lower(*args).compile()
    multihost.get_barrier_sync_fn()(key="podtrain_train_step_compiled", timeout_ms=int(timeout_s * 1000))


def evaluate(training: Training, eval_step, eval_dataset, params, num_batches: int) -> float:
    """Mean loss over the first `num_batches` eval batches (the same ones every time)."""
    total = count = 0.0
    iterator = iter(eval_dataset)
    for _ in range(num_batches):
        batch = to_global_batch(next(iterator), training.batch_sharding, training.config.train.batch_size)
        with jax.set_mesh(training.mesh), use_rules(training.config.sharding.rules):  # as the train step
            loss_sum, (tokens, _) = eval_step(params, batch)
        total, count = total + float(loss_sum), count + float(tokens)
    return total / max(count, 1.0)


def sample(training: Training, params, tokenizer: Tokenizer, prompt_ids: list[int]) -> str:
    """The greedy continuation of `prompt_ids` by `params` (`train.sample_tokens` at most), as text.

    Every process takes part (the params are sharded over all of them) and gets the same text.
    """
    config = training.config
    with jax.set_mesh(training.mesh), use_rules(config.sharding.rules):
        [tokens] = generate(nnx.merge(training.graphdef, params), [prompt_ids],
                            max_new_tokens=config.train.sample_tokens, stop_tokens=(tokenizer.eos_id,),
                            pad_id=tokenizer.pad_id)
    return tokenizer.decode(tokens)


def _data_ended(ended_here: bool, *, finite: bool) -> bool:
    """Whether any process's training data ran out (finite epochs), so that every process stops at
    the same step; an infinite pipeline never ends, so no collective is needed then."""
    if not finite or jax.process_count() == 1:
        return ended_here
    return bool(multihost_utils.process_allgather(np.int32(ended_here)).any())


def _restore_data_position(iterator, rows: range, global_batch: int, meta: dict, where: str) -> None:
    """Moves the training data iterator to where the restored checkpoint `meta` says it was."""
    if "data_position" not in meta:
        raise ConfigError(f"checkpoint {where} holds no data position (written by an older podtrain, which kept "
                          "one per process): resume it with that version, or start over with a new checkpoint.dir")
    try:
        set_row_positions(iterator, rows, meta["data_position"], global_batch=global_batch)
    except ValueError as e:
        raise ConfigError(f"checkpoint {where}: {e}") from None


def run(config: Config, run_dir: Path, *, on_step: Callable[[int], None] | None = None,
        inputs: Inputs | None = None) -> RunResult:
    """Trains `config` to `train.steps`, resuming from `run_dir`'s checkpoints; see the module doc.

    `on_step(step)` is called with each completed step (its loss fetched): the worker's heartbeat.
    `inputs` are what `preflight.check_inputs` opened, when the caller ran it already. Nothing is
    written (checkpoint directory, compilation cache, config.yaml) until those checks passed; the
    resolved config.yaml is written once the run has restored or initialised its state.
    """
    notice = PreemptionNotice()  # first: a notice while the run builds and restores stops it at its first step
    try:
        return _run(config, Path(run_dir), notice, on_step, inputs)
    finally:
        notice.restore()


def _run(config: Config, run_dir: Path, notice: PreemptionNotice, on_step: Callable[[int], None] | None,
         inputs: Inputs | None) -> RunResult:
    is_main = jax.process_index() == 0
    inputs = inputs or check_inputs(config, run_dir)
    training = build_training(config)
    try:
        rows = process_rows(training.batch_sharding, config.train.batch_size)
    except ValueError as e:
        raise ConfigError(f"mesh: {e}") from None
    train_data, eval_data = _datasets(config, inputs, rows)
    tokenizer = inputs.tokenizer
    prompt_ids = sample_prompt_ids(config, tokenizer) if config.train.sample_prompt else None
    if config.train.eval_every and not evals_enabled(config) and is_main:
        logger.warning("data.eval_fraction=0 holds out no documents: no eval losses every train.eval_every=%d steps%s",
                       config.train.eval_every, " (samples still)" if prompt_ids else "")
    use_compilation_cache(config.train.compilation_cache_dir, run_dir)
    checkpointer = Checkpointer(checkpoint_directory(config.checkpoint.dir, run_dir), config.checkpoint,
                                run_meta=run_metadata(config, training.mesh))
    train_iter = iter(train_data)
    resumed = checkpointer.resume(training.abstract_state())
    if resumed:
        _restore_data_position(train_iter, rows, config.train.batch_size, resumed[1],
                               f"step {resumed[2]} in {checkpointer.directory}")
    state = resumed[0] if resumed else training.init_state()
    start = int(state.step)
    if is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(to_yaml(config))
    logger.info("starting at step %d (%s) on mesh %s; run directory %s", start,
                f"resumed from step {resumed[2]}" if resumed else "fresh",
                describe_mesh(training.mesh, config.cluster.num_slices), run_dir)

    eval_step = jax.jit(make_eval_step(training.graphdef, loss_chunk=config.train.loss_chunk),
                        in_shardings=(training.state_shardings.params, training.batch_sharding))
    peak, _ = peak_flops_per_device(config.train.peak_flops_per_device)
    tokens_per_step = config.train.batch_size * config.train.seq_len
    step_flops = flops_per_token(config.model, config.train.seq_len) * tokens_per_step
    writer = MetricsWriter(run_dir, enabled=is_main, total_steps=config.train.steps, start_step=start)
    losses, timed_tokens, timed_seconds, preempted = [], 0, 0.0, False
    # Metrics are read one step late: step s+1 is dispatched before step s's loss is fetched, so
    # the host builds the next batch and writes logs while the devices compute.
    pending, last_done = None, time.perf_counter()

    excluded = 0.0  # seconds of evals, samples and checkpoint saves since the last finished step

    def finish(record: dict, metrics: dict, timed: bool, *, write: bool = True) -> None:
        """Records a step's metrics (`emit` writes them; `write=False` leaves that to the caller); its
        time is the wall time since the previous step's, less evals, samples and saves (so step_s,
        tokens/s and MFU are the training's own)."""
        nonlocal last_done, timed_tokens, timed_seconds, excluded
        record.update(loss=float(metrics["loss"]), grad_norm=float(metrics["grad_norm"]), lr=float(metrics["lr"]))
        if "expert_load" in metrics:
            record.update(expert_metrics(np.asarray(metrics["expert_load"]), float(metrics["dropped_tokens"])))
        now = time.perf_counter()
        seconds, last_done, excluded = now - last_done - excluded, now, 0.0
        if timed:  # the first step of a process includes compilation
            timed_tokens, timed_seconds = timed_tokens + tokens_per_step, timed_seconds + seconds
        record.update(step_s=seconds, tokens_per_s=tokens_per_step / seconds,
                      mfu=step_flops / seconds / (peak * jax.device_count()))
        losses.append(record["loss"])
        if write:
            emit(record)

    def emit(record: dict) -> None:
        writer.write(record)
        if on_step is not None:
            on_step(record["step"])

    def data_position() -> dict:
        return row_positions(train_iter, rows)

    data_ended = False
    try:
        for step in range(start, config.train.steps):
            local_batch = next(train_iter, None)
            if _data_ended(local_batch is None, finite=config.data.epochs is not None):
                logger.warning("the training data ended after data.epochs=%s at step %d of train.steps=%d: stopping",
                               config.data.epochs, step, config.train.steps)
                checkpointer.save(step, state, data_position=data_position, force=True)
                data_ended = True
                break
            batch = to_global_batch(local_batch, training.batch_sharding, config.train.batch_size)
            if step == start:
                compile_then_meet(training.step, state, batch, timeout_s=config.cluster.startup_timeout_s)
            state, metrics = training.step(state, batch)
            if pending is not None:
                finish(*pending)
            record = {"step": step + 1}
            if config.train.eval_every and (step + 1) % config.train.eval_every == 0:
                jax.block_until_ready(state)  # the step's own time ends here
                eval_started = time.perf_counter()
                if eval_data is not None:
                    record["eval_loss"] = evaluate(training, eval_step, eval_data, state.params,
                                                   config.train.eval_batches)
                if prompt_ids is not None:
                    record["sample"] = sample(training, state.params, tokenizer, prompt_ids)
                    if is_main:
                        logger.info("sample at step %d: %r -> %r", step + 1, config.train.sample_prompt,
                                    record["sample"])
                excluded += time.perf_counter() - eval_started
            pending = (record, metrics, step > start)
            preempted = notice.reached(step + 1)
            final = preempted or step + 1 == config.train.steps
            save_due = final or (step + 1) % config.checkpoint.every_steps == 0
            if save_due:
                jax.block_until_ready(state)  # so that save_block_s is the save's own time, not the step's
                finish(*pending, write=False)
                pending = None
            save_started = time.perf_counter()
            if checkpointer.save(step + 1, state, data_position=data_position, force=final):
                record["save_block_s"] = time.perf_counter() - save_started  # the loop's share of an async save
                excluded += record["save_block_s"]
            if save_due:  # written now, not a step late: a resumed run finds every checkpointed step's record
                emit(record)
                writer.flush()
            if preempted:
                break
    except BaseException:
        if jax.process_count() == 1:  # an exception or a second Ctrl-C: a save in flight still completes
            checkpointer.close()
            writer.close()
        raise
    if pending is not None:
        finish(*pending)
    first_loss, last_loss = (losses[0], losses[-1]) if losses else (None, None)
    checkpointer.wait()
    last_checkpoint = checkpointer.latest_step()
    checkpointer.close()
    writer.close()
    return RunResult(run_dir, start, int(state.step), first_loss, last_loss,
                     timed_tokens / timed_seconds if timed_seconds else 0.0, last_checkpoint, preempted, data_ended)
