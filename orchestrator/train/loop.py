"""The training loop: a plain Python loop around the jitted step, made of a few named steps.

`run(config, run_dir)` checks the inputs, sets the run up (`_set_up`: build, restore the latest
committed checkpoint or initialise, write config.yaml), trains (`_train`: batch, step, eval and
sample when due, checkpoint when due) until `train.steps`, a preemption notice or the end of
finite data, and returns what happened. `StepRecords` turns each step's metrics into its record.
Every process runs it (one per host); only process 0 writes the config, metrics and logs.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from orbax.checkpoint import multihost

from podtrain.models import flops_per_token
from podtrain.models.generate import generate
from podtrain.orchestrator.checkpoint.checkpointer import Checkpointer, run_metadata
from podtrain.orchestrator.checkpoint.rundir import checkpoint_directory
from podtrain.orchestrator.common import protocol
from podtrain.orchestrator.common.errors import ConfigError
from podtrain.orchestrator.config.compose import to_yaml
from podtrain.orchestrator.config.schema import Config
from podtrain.orchestrator.data.pipeline import (
    SkippedRows,
    make_dataset,
    process_rows,
    row_positions,
    set_row_positions,
    to_global_batch,
)
from podtrain.orchestrator.data.tokenizers import Tokenizer
from podtrain.orchestrator.placed.restore import base_record, check_base, load_base
from podtrain.orchestrator.train.adapters import init_adapters
from podtrain.orchestrator.train.build import Training, build_training
from podtrain.orchestrator.train.goodput import Ledger
from podtrain.orchestrator.train.metrics import MetricsWriter, expert_metrics, peak_flops_per_device
from podtrain.orchestrator.train.preflight import Inputs, check_inputs, evals_enabled, sample_prompt_ids
from podtrain.orchestrator.train.step import make_eval_step
from podtrain.sharding.mesh import describe_mesh
from podtrain.sharding.rules import use_rules

logger = logging.getLogger(__name__)


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
    skipped_rows: int = 0

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
        if self.skipped_rows:
            lines.append(f"{self.skipped_rows} chat rows skipped by this process: no token to train on within "
                         "train.seq_len (a warning named the first)")
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


def _datasets(config: Config, inputs: Inputs, rows: range, skipped: SkippedRows):
    """This process's train and (when evals are on) eval batches, from the corpus the checks opened."""
    kwargs = dict(seq_len=config.train.seq_len, global_batch=config.train.batch_size, rows=rows,
                  corpus=inputs.corpus, skipped=skipped)
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


def next_batch(iterator) -> dict | None:
    """The next local batch, None at the end of the data; a document the pipeline cannot use (a
    ValueError naming its file and place) is the user's input, a ConfigError."""
    try:
        return next(iterator, None)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def evaluate(training: Training, eval_step, eval_dataset, params, num_batches: int, frozen=None) -> float:
    """Mean loss over the first `num_batches` eval batches (the same ones every time); `frozen`
    is a LoRA run's frozen base."""
    total = count = 0.0
    iterator = iter(eval_dataset)
    for _ in range(num_batches):
        batch = to_global_batch(next_batch(iterator), training.batch_sharding, training.config.train.batch_size)
        with jax.set_mesh(training.mesh), use_rules(training.config.sharding.rules):  # as the train step
            loss_sum, (tokens, _) = eval_step(params, batch, frozen)
        total, count = total + float(loss_sum), count + float(tokens)
    return total / max(count, 1.0)


def sample(training: Training, params, tokenizer: Tokenizer, prompt_ids: list[int], frozen=None) -> str:
    """The greedy continuation of `prompt_ids` by `params` (`train.sample_tokens` at most), as text.

    Every process takes part (the params are sharded over all of them) and gets the same text.
    """
    config = training.config
    with jax.set_mesh(training.mesh), use_rules(config.sharding.rules):
        [tokens] = generate(training.model(params, frozen), [prompt_ids],
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


def run(config: Config, run_dir: Path, *, heartbeat: protocol.Heartbeat | None = None,
        inputs: Inputs | None = None) -> RunResult:
    """Trains `config` to `train.steps`, resuming from `run_dir`'s checkpoints; see the module doc.

    `heartbeat` (the worker's) hears each phase as it begins (restore, compile, save, commit) and
    each completed step (its loss fetched).
    `inputs` are what `preflight.check_inputs` opened, when the caller ran it already. Nothing is
    written (checkpoint directory, compilation cache, config.yaml) until those checks passed; the
    resolved config.yaml is written once the run has restored or initialised its state.
    """
    notice = PreemptionNotice()  # first: a notice while the run builds and restores stops it at its first step
    try:
        return _run(config, Path(run_dir), notice, heartbeat or protocol.Heartbeat(None), inputs)
    finally:
        notice.restore()


@dataclasses.dataclass
class _Setup:
    """The runtime pieces of one run, built once its inputs passed the checks."""

    training: Training
    checkpointer: Checkpointer
    train_iter: Any  # a grain DatasetIterator of this process's rows
    eval_data: Any  # a grain IterDataset, or None without evals
    rows: range
    tokenizer: Tokenizer
    prompt_ids: list[int] | None
    state: Any  # the TrainState, restored or initialised
    start: int
    frozen: Any  # the frozen base of a LoRA run (None without)
    skipped: SkippedRows  # chat rows with no token to train on, train and eval
    ledger: Ledger  # where the attempt's time goes (process 0 writes it)
    heartbeat: protocol.Heartbeat

    def data_position(self) -> dict:
        return row_positions(self.train_iter, self.rows)


def _set_up(config: Config, run_dir: Path, inputs: Inputs, heartbeat: protocol.Heartbeat) -> _Setup:
    """Builds the run, restores its latest checkpoint (or initialises the params), then writes config.yaml."""
    is_main = jax.process_index() == 0
    heartbeat.phase("restore")
    training = build_training(config)
    try:
        rows = process_rows(training.batch_sharding, config.train.batch_size)
    except ValueError as e:
        raise ConfigError(f"mesh: {e}") from None
    skipped = SkippedRows()
    train_data, eval_data = _datasets(config, inputs, rows, skipped)
    prompt_ids = sample_prompt_ids(config, inputs.tokenizer) if config.train.sample_prompt else None
    if config.train.eval_every and not evals_enabled(config) and is_main:
        logger.warning("data.eval_fraction=0 holds out no documents: no eval losses every train.eval_every=%d steps%s",
                       config.train.eval_every, " (samples still)" if prompt_ids else "")
    use_compilation_cache(config.train.compilation_cache_dir, run_dir)
    base = load_base(training)
    frozen = training.init_frozen(base)
    run_meta = run_metadata(config, training.mesh)
    if frozen is not None:  # what a LoRA run's adapters are trained on
        run_meta["lora_base"] = base_record(config.lora, frozen)
    checkpointer = Checkpointer(checkpoint_directory(config.checkpoint.dir, run_dir), config.checkpoint,
                                run_meta=run_meta)
    train_iter = iter(train_data)
    restore_started = time.time()
    resumed = checkpointer.resume(training.abstract_state())
    if resumed:
        check_base(resumed[1], run_meta.get("lora_base"), f"checkpoint step {resumed[2]} in {checkpointer.directory}")
        _restore_data_position(train_iter, rows, config.train.batch_size, resumed[1],
                               f"step {resumed[2]} in {checkpointer.directory}")
    restoring_s = time.time() - restore_started
    state = resumed[0] if resumed else training.init_state(base)
    if not resumed and config.lora.rank and config.lora.init:
        state = init_adapters(training, state, frozen)
    del base
    start = int(state.step)
    heartbeat.step = start  # the last completed step, until the first one of this attempt
    if is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(to_yaml(config))
    attempt = os.environ.get(protocol.ENV_ATTEMPT)
    ledger = Ledger(run_dir, enabled=is_main, attempt=int(attempt) if attempt else None)
    ledger.setup_done(start, restoring_s)
    logger.info("starting at step %d (%s) on mesh %s; run directory %s", start,
                f"resumed from step {resumed[2]}" if resumed else "fresh",
                describe_mesh(training.mesh, config.cluster.num_slices), run_dir)
    return _Setup(training, checkpointer, train_iter, eval_data, rows, inputs.tokenizer, prompt_ids, state, start,
                  frozen, skipped, ledger, heartbeat)


class StepRecords:
    """Each step's record: loss, gradient norm, learning rate, time, tokens/s, MFU (and expert loads).

    Metrics are read one step late: step s+1 is dispatched before step s's loss is fetched, so the
    host builds the next batch and writes logs while the devices compute. A step's time is the wall
    time since the previous step's, less the evals, samples and saves in between (`exclude`), so
    step_s, tokens/s and MFU are the training's own. The heartbeat hears each step as its record is
    written: the worker's heartbeat.
    """

    def __init__(self, config: Config, writer: MetricsWriter, heartbeat: protocol.Heartbeat):
        self.writer, self.heartbeat = writer, heartbeat
        self.tokens_per_step = config.train.batch_size * config.train.seq_len
        self.step_flops = flops_per_token(config.model, config.train.seq_len) * self.tokens_per_step
        self.peak, _ = peak_flops_per_device(config.train.peak_flops_per_device)
        self.losses: list[float] = []
        self.timed_tokens, self.timed_seconds, self.excluded = 0, 0.0, 0.0
        self.pending: tuple[dict, dict, bool] | None = None
        self.carried: dict = {}
        self.last_done = time.perf_counter()

    def exclude(self, seconds: float) -> None:
        """Leaves `seconds` (an eval, a sample, a save) out of the next step's time."""
        self.excluded += seconds

    def carry(self, **fields) -> None:
        """Puts `fields` on the next step's record (what happened after this one was written)."""
        self.carried.update(fields)

    def step_done(self, record: dict, metrics: dict, *, timed: bool) -> None:
        """Writes the previous step's record, then holds this one until its metrics are read.
        `timed=False` for a process's first step, which includes compilation."""
        self.finish()
        record.update(self.carried)
        self.carried = {}
        self.pending = (record, metrics, timed)

    def finish(self, *, write: bool = True) -> None:
        """Reads the pending step's metrics into its record and (with `write`) writes it."""
        if self.pending is None:
            return
        (record, metrics, timed), self.pending = self.pending, None
        record.update(loss=float(metrics["loss"]), grad_norm=float(metrics["grad_norm"]), lr=float(metrics["lr"]),
                      loss_tokens=int(metrics["tokens"]))
        if "expert_load" in metrics:
            record.update(expert_metrics(np.asarray(metrics["expert_load"]), float(metrics["dropped_tokens"])))
        now = time.perf_counter()
        seconds, self.last_done, self.excluded = now - self.last_done - self.excluded, now, 0.0
        if timed:
            self.timed_tokens += self.tokens_per_step
            self.timed_seconds += seconds
        record.update(step_s=seconds, tokens_per_s=self.tokens_per_step / seconds,
                      mfu=self.step_flops / seconds / (self.peak * jax.device_count()))
        self.losses.append(record["loss"])
        if write:
            self.emit(record)

    def emit(self, record: dict) -> None:
        self.writer.write(record)
        self.heartbeat.stepped(record["step"])

    def tokens_per_s(self) -> float:
        return self.timed_tokens / self.timed_seconds if self.timed_seconds else 0.0


def _eval_and_sample(config: Config, run: _Setup, eval_step, state, record: dict) -> float:
    """Adds the eval loss (with an eval split) and the prompt's sample (with `train.sample_prompt`)
    to `record`; returns the seconds it took."""
    jax.block_until_ready(state)  # the step's own time ends here
    started = time.perf_counter()
    if run.eval_data is not None:
        record["eval_loss"] = evaluate(run.training, eval_step, run.eval_data, state.params, config.train.eval_batches,
                                       run.frozen)
    if run.prompt_ids is not None:
        record["sample"] = sample(run.training, state.params, run.tokenizer, run.prompt_ids, run.frozen)
        if jax.process_index() == 0:
            logger.info("sample at step %d: %r -> %r", record["step"], config.train.sample_prompt, record["sample"])
    return time.perf_counter() - started


def _checkpoint(config: Config, run: _Setup, records: StepRecords, state, record: dict, *, final: bool) -> None:
    """Saves the step when it is due (or `final`, or a preemption notice asks for it). A step that
    is checkpointed has its record written and flushed before its save starts, not a step late: an
    async save can commit before the loop goes on, and a resumed run must find the record of every
    step it resumes after. The save's blocking time goes on the next step's record."""
    save_due = final or record["step"] % config.checkpoint.every_steps == 0
    if save_due:
        jax.block_until_ready(state)  # so that save_block_s is the save's own time, not the step's
        records.finish(write=False)
        records.emit(record)
        records.writer.flush()
    if save_due:
        run.heartbeat.phase("save")
    started = time.perf_counter()
    if run.checkpointer.save(record["step"], state, data_position=run.data_position, force=final):
        blocked = time.perf_counter() - started  # the loop's share of an async save
        records.exclude(blocked)
        records.carry(save_block_s=blocked)
        run.ledger.add("checkpointing", blocked)
    if save_due:
        run.heartbeat.phase("step")


def _train(config: Config, run: _Setup, records: StepRecords, notice: PreemptionNotice) -> tuple[Any, bool, bool]:
    """The loop: batch, step, eval and sample when due, checkpoint when due; until `train.steps`,
    a preemption notice, or the end of finite data. Returns (state, preempted, data ended)."""
    training, state = run.training, run.state
    eval_step = jax.jit(make_eval_step(training.graphdef, loss_chunk=config.train.loss_chunk),
                        in_shardings=(training.state_shardings.params, training.batch_sharding,
                                      training.frozen_shardings))
    ledger = run.ledger
    for step in range(run.start, config.train.steps):
        waited = time.perf_counter()
        local_batch = next_batch(run.train_iter)
        ledger.add("data", time.perf_counter() - waited)
        if _data_ended(local_batch is None, finite=config.data.epochs is not None):
            logger.warning("the training data ended after data.epochs=%s at step %d of train.steps=%d: stopping",
                           config.data.epochs, step, config.train.steps)
            run.heartbeat.phase("save")
            run.checkpointer.save(step, state, data_position=run.data_position, force=True)
            return state, False, True
        batch = to_global_batch(local_batch, training.batch_sharding, config.train.batch_size)
        dispatched = time.perf_counter()
        if step == run.start:
            run.heartbeat.phase("compile")
            compile_then_meet(training.step, state, batch, run.frozen, timeout_s=config.cluster.compile_timeout_s)
        state, metrics = training.step(state, batch, run.frozen)
        if step == run.start:  # the first call compiles (or loads from the cache) before it dispatches
            ledger.add("compiling", time.perf_counter() - dispatched)
        record = {"step": step + 1}
        records.step_done(record, metrics, timed=step > run.start)
        if config.train.eval_every and (step + 1) % config.train.eval_every == 0:
            first_eval = step + 1 - config.train.eval_every < run.start + 1
            if first_eval:  # it compiles the eval step and the sampler
                run.heartbeat.phase("compile")
            evaluated = _eval_and_sample(config, run, eval_step, state, record)
            if first_eval:
                run.heartbeat.phase("step")
            records.exclude(evaluated)
            ledger.add("evaluating", evaluated)
        record["goodput"] = ledger.goodput()
        preempted = notice.reached(step + 1)
        _checkpoint(config, run, records, state, record, final=preempted or step + 1 == config.train.steps)
        ledger.step_done(step + 1)
        if preempted:
            return state, True, False
    return state, False, False


def _run(config: Config, run_dir: Path, notice: PreemptionNotice, heartbeat: protocol.Heartbeat,
         inputs: Inputs | None) -> RunResult:
    run = _set_up(config, run_dir, inputs or check_inputs(config, run_dir), heartbeat)
    writer = MetricsWriter(run_dir, enabled=jax.process_index() == 0, total_steps=config.train.steps,
                           start_step=run.start, metrics=config.metrics, run_config=dataclasses.asdict(config))
    records = StepRecords(config, writer, heartbeat)
    try:
        state, preempted, data_ended = _train(config, run, records, notice)
    except BaseException:
        if jax.process_count() == 1:  # an exception or a second Ctrl-C: a save in flight still completes
            run.checkpointer.close()
            writer.close()
        raise
    records.finish()
    waited = time.perf_counter()
    heartbeat.phase("commit")
    run.checkpointer.wait()
    run.ledger.add("checkpointing", time.perf_counter() - waited)
    last_checkpoint = run.checkpointer.latest_step()
    run.checkpointer.close()
    writer.close()
    run.ledger.step_done(int(state.step))
    losses = records.losses
    return RunResult(run_dir, run.start, int(state.step), losses[0] if losses else None,
                     losses[-1] if losses else None, records.tokens_per_s(), last_checkpoint, preempted, data_ended,
                     run.skipped.count)
