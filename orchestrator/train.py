"""The training loop: a plain Python loop around the jitted step, with explicit hooks.

`run(config, run_dir)` builds everything from the config, resumes from the latest committed
checkpoint (`checkpoint.resume=auto`), trains to `train.steps`, and returns what happened. Every
process runs it (one per host); only process 0 writes the config, metrics and logs.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import time
from pathlib import Path

import jax
from jax.experimental import multihost_utils

from orchestrator.build import Training, build_training
from orchestrator.checkpoint import Checkpointer, run_metadata
from orchestrator.config import Config, ConfigError, to_yaml
from orchestrator.data import make_dataset, to_global_batch
from orchestrator.metrics import MetricsWriter, peak_flops_per_device
from orchestrator.plan import flops_per_token
from orchestrator.step import make_eval_step
from orchestrator.tokenizers import check_vocab, load_tokenizer

logger = logging.getLogger(__name__)

# Exit status of a run that stopped on a preemption notice after committing a checkpoint
# (EX_TEMPFAIL): the orchestrator restarts it without charging the failure budget.
EXIT_PREEMPTED = 75


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


class PreemptionNotice:
    """Turns SIGTERM into a checkpoint at the next step boundary, agreed by every process.

    With several processes JAX's own notifier catches SIGTERM and `reached_preemption_sync_point`
    makes every process stop at the same step; alone, a handler sets a flag.
    """

    def __init__(self):
        self.received = False
        self.multi_process = jax.process_count() > 1
        if not self.multi_process:
            signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame):
        self.received = True

    def reached(self, step: int) -> bool:
        if self.multi_process:
            return multihost_utils.reached_preemption_sync_point(step)
        return self.received


def _datasets(config: Config):
    try:
        return _make_datasets(config)
    except ValueError as e:  # bad paths, empty corpora, vocab sizes: the user's input
        raise ConfigError(str(e)) from None


def _make_datasets(config: Config):
    tokenizer = load_tokenizer(config.data.tokenizer, eos_token=config.data.eos_token, bos_token=config.data.bos_token)
    check_vocab(tokenizer, config.model.vocab_size)
    kwargs = dict(seq_len=config.train.seq_len, global_batch=config.train.batch_size,
                  process_index=jax.process_index(), process_count=jax.process_count())
    return make_dataset(config.data, tokenizer, **kwargs), make_dataset(config.data, tokenizer, split="eval", **kwargs)


def evaluate(training: Training, eval_step, eval_dataset, params, num_batches: int) -> float:
    """Mean loss over the first `num_batches` eval batches (the same ones every time)."""
    total = count = 0.0
    iterator = iter(eval_dataset)
    for _ in range(num_batches):
        loss_sum, tokens = eval_step(params, to_global_batch(next(iterator), training.batch_sharding))
        total, count = total + float(loss_sum), count + float(tokens)
    return total / max(count, 1.0)


def run(config: Config, run_dir: Path) -> RunResult:
    """Trains `config` to `train.steps`, resuming from `run_dir`'s checkpoints; see the module doc."""
    run_dir = Path(run_dir)
    is_main = jax.process_index() == 0
    training = build_training(config)
    if is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(to_yaml(config))
    train_data, eval_data = _datasets(config)
    train_iter = iter(train_data)
    ckpt_dir = Path(config.checkpoint.dir)
    checkpointer = Checkpointer(ckpt_dir if ckpt_dir.is_absolute() else run_dir / ckpt_dir, config.checkpoint,
                                run_meta=run_metadata(config, training.mesh))
    resumed = checkpointer.resume(training.abstract_state(), data_iterator=train_iter)
    state = resumed[0] if resumed else training.init_state()
    start = int(state.step)
    logger.info("starting at step %d (%s)", start, f"resumed from step {resumed[2]}" if resumed else "fresh")

    eval_step = jax.jit(make_eval_step(training.graphdef, loss_chunk=config.train.loss_chunk),
                        in_shardings=(training.state_shardings.params, training.batch_sharding))
    peak, _ = peak_flops_per_device(config.train.peak_flops_per_device)
    tokens_per_step = config.train.batch_size * config.train.seq_len
    step_flops = flops_per_token(config.model, config.train.seq_len) * tokens_per_step
    writer = MetricsWriter(run_dir, enabled=is_main, total_steps=config.train.steps)
    notice = PreemptionNotice()
    first_loss = last_loss = None
    timed_tokens, timed_seconds, preempted = 0, 0.0, False
    for step in range(start, config.train.steps):
        started = time.perf_counter()
        batch = to_global_batch(next(train_iter), training.batch_sharding)
        state, metrics = training.step(state, batch)
        last_loss = float(metrics["loss"])
        seconds = time.perf_counter() - started
        first_loss = last_loss if first_loss is None else first_loss
        if step > start:  # the first step of a process includes compilation
            timed_tokens, timed_seconds = timed_tokens + tokens_per_step, timed_seconds + seconds
        record = {
            "step": step + 1, "loss": last_loss, "grad_norm": float(metrics["grad_norm"]),
            "lr": float(metrics["lr"]), "step_s": seconds, "tokens_per_s": tokens_per_step / seconds,
            "mfu": step_flops / seconds / (peak * jax.device_count()),
        }
        if config.train.eval_every and (step + 1) % config.train.eval_every == 0:
            record["eval_loss"] = evaluate(training, eval_step, eval_data, state.params, config.train.eval_batches)
        writer.write(record)
        preempted = notice.reached(step + 1)
        checkpointer.save(step + 1, state, data_iterator=train_iter,
                          force=preempted or step + 1 == config.train.steps)
        if preempted:
            break
    checkpointer.wait()
    last_checkpoint = checkpointer.latest_step()
    checkpointer.close()
    writer.close()
    return RunResult(run_dir, start, int(state.step), first_loss, last_loss,
                     timed_tokens / timed_seconds if timed_seconds else 0.0, last_checkpoint, preempted)
