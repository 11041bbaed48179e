"""Orbax checkpoints of a training run: async saves, the last K kept, resume that skips corrupt steps.

A `Checkpointer` wraps one `ocp.CheckpointManager`. Every process calls `save` at every step and
Orbax decides whether the step is saved (every `every_steps` steps, or when JAX reports a
preemption). Each process writes only the shards it holds; JSON metadata is written by process 0.

Directory layout (Orbax builds a step in `<step>.orbax-checkpoint-tmp/` and renames it to `<step>/`
once every process has finished, so a folder named by a bare integer is a committed step)::

    <dir>/
      <step>/
        _CHECKPOINT_METADATA            Orbax: the items and their handlers, commit time
        state/                          the TrainState (step, params, opt_state), via StandardSave
          _METADATA                     tree structure, shapes and dtypes
          _sharding                     the shardings it was saved with (the restore target decides)
          manifest.ocdbt, d/<hash>      the OCDBT database that each process's shards are merged into
          ocdbt.process_<i>/            the shards process i wrote
          array_metadatas/process_<i>
        meta/metadata                   JSON: step, seed, config_yaml, mesh, and the caller's extras
        data_position/metadata          JSON: the input pipeline's position, merged from every process's
                                        part (the training loop saves each global batch row's stream
                                        state, so a run resumes on any number of processes)
      <step>.orbax-checkpoint-tmp/      a save in flight or interrupted: never listed, never restored

Resuming (`checkpoint.resume`): `auto` restores the newest step that restores; a step that fails
(a truncated or missing array file, broken metadata, or a state that no longer matches the model)
is logged and the step before it is tried. Nothing is ever deleted by a restore; once an older step
restored, the damaged newer ones are renamed `<step>.damaged` (Orbax then ignores them, so the run
checkpoints those step numbers again instead of skipping every save up to them). With no checkpoint
the run starts fresh; when checkpoints exist but none restores, `NoRestorableCheckpointError` lists
every step with its error, because silently starting over would throw away a run. `none` starts
fresh and refuses a directory that already holds checkpoints (Orbax would silently skip saving any
step not newer than the ones there); a step number restores exactly that step and, once every
process restored it, renames the newer steps `<step>.superseded` (kept, never deleted): the run
writes its own steps under those numbers, and a later `auto` continues the new run, not the one it
replaced. A `.damaged` or `.superseded` name already taken gets `.2`, `.3`... Both mistakes (`none`
on checkpoints, a step that is not there) are `ConfigError`s.

With several processes the directory must be one that every process sees (a shared filesystem
or a URL such as gs://): each process writes its own shards into it. A `Checkpointer` checks this
when it opens the directory and raises `ConfigError` naming the processes that cannot see a file
process 0 wrote there.

A local directory is created when a `Checkpointer` opens it, and `resume` (what a training run
calls before its first step; readers such as `export` never do) writes and removes a probe file:
a file in the path or a read-only directory is a `ConfigError` naming `checkpoint.dir`, at start
rather than at the first save. A save that fails anyway (a full disk) raises `CheckpointWriteError`
naming the step, the directory and the cause in one line; the steps committed before it are kept
(Orbax deletes old steps only after a new one commits). Orbax's threads still log their own
tracebacks of the failure first.

Every process tries the same steps, newest first, and a damaged step normally fails on all of them
(the files under a step are shared). Damage that only some processes read would let them restore
different steps; the processes compare the step they restored and raise rather than train on a mix.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import uuid
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
import yaml
from etils import epath
from jax.experimental import multihost_utils
from jax.sharding import Mesh
from orbax.checkpoint import multihost

from orchestrator.config import CheckpointConfig, Config, ConfigError, flatten_keys, to_yaml
from sharding.mesh import describe_mesh

logger = logging.getLogger(__name__)

# What a damaged step raises: tensorstore reports DATA_LOSS, OUT_OF_RANGE and NOT_FOUND as
# ValueError, a broken JSON file is a ValueError, a missing file an OSError, a missing item a KeyError.
_DAMAGED_STEP_ERRORS = (ValueError, OSError, KeyError)
# What a save raises when writing fails: tensorstore reports RESOURCE_EXHAUSTED (a full disk) and
# OUT_OF_RANGE (past a file size limit) as ValueError; files written by Python raise OSError.
_WRITE_ERRORS = (ValueError, OSError)


class NoRestorableCheckpointError(RuntimeError):
    """Checkpoints exist but none of them restores.

    Attributes:
        failures: each step tried (newest first) and the error its restore raised.
    """

    def __init__(self, directory: str, failures: Mapping[int, Exception]):
        self.failures = dict(failures)
        listed = "; ".join(f"step {step}: {_describe(error)}" for step, error in self.failures.items())
        super().__init__(
            f"no checkpoint in {directory} can be restored ({listed}). Nothing was deleted: move the "
            "broken step folders away to resume from an older one, or start over with a new checkpoint.dir"
        )


class CheckpointWriteError(RuntimeError):
    """A step could not be written (a full disk, lost permissions, a storage error); the steps
    committed before it are kept, and the failed one stays an uncommitted `<step>.orbax-checkpoint-tmp`.

    Attributes:
        step: the step whose save failed (None if it is not known).
    """

    def __init__(self, step: int | None, directory: str, error: Exception):
        self.step = step
        which = "a checkpoint step" if step is None else f"checkpoint step {step}"
        super().__init__(f"{which} could not be written to {directory} ({_describe(error, max_chars=1000)}); the "
                         "steps committed before it are kept: free space or fix the storage, then resume")


def _describe(error: Exception, max_chars: int = 300) -> str:
    """The error's type and first line, cut short (tensorstore appends its whole spec as JSON)."""
    text = (str(error).splitlines() or [""])[0]
    if len(text) > max_chars:
        text = text[:max_chars] + "..."
    return f"{type(error).__name__}: {text}"


# Model keys that change how the model runs, is initialised or is trained, not what its weights
# are: a run may resume with other values (DeepSeek-V3 stops its router-bias updates late in
# training), and export and generate take any.
RUNTIME_MODEL_KEYS = frozenset({"dtype", "remat", "scan_layers", "initializer_range", "moe.bias_update_rate",
                                "moe.capacity_factor"})


def model_differences(meta: Mapping, model: Any, shown: int = 3) -> str:
    """How the model keys a step was saved with (its `meta["config_yaml"]`) differ from `model` (a
    `ModelConfig`), apart from `RUNTIME_MODEL_KEYS`: the first `shown`, then how many more; "" when
    they are equal (or the step records no config)."""
    saved = (yaml.safe_load(meta.get("config_yaml", "")) or {}).get("model")
    if saved is None:
        return ""
    saved, current = flatten_keys(saved), flatten_keys(dataclasses.asdict(model))
    differences = [f"model.{key}: checkpoint has {saved.get(key)!r}, config has {current.get(key)!r}"
                   for key in sorted((set(saved) | set(current)) - RUNTIME_MODEL_KEYS)
                   if saved.get(key) != current.get(key)]
    more = f"; and {len(differences) - shown} more" if len(differences) > shown else ""
    return "; ".join(differences[:shown]) + more


def run_metadata(config: Config, mesh: Mesh) -> dict[str, Any]:
    """What every checkpoint of a run records about it: seed, resolved config YAML, mesh."""
    mesh_description = describe_mesh(mesh, config.cluster.num_slices)
    return {"seed": config.train.seed, "config_yaml": to_yaml(config), "mesh": mesh_description}


def _manager_options(config: CheckpointConfig) -> ocp.CheckpointManagerOptions:
    policies = ocp.checkpoint_managers
    return ocp.CheckpointManagerOptions(
        save_decision_policy=policies.AnySavePolicy(
            [policies.FixedIntervalPolicy(config.every_steps), policies.PreemptionCheckpointingPolicy()]
        ),
        preservation_policy=policies.LatestN(n=config.keep),
        enable_async_checkpointing=config.async_save,
    )


class Checkpointer:
    """Saves and restores a run's TrainState, metadata and (optionally) its input pipeline's position.

    Args:
        directory: where the step folders live (a local path or any path Orbax accepts).
        config: interval, how many steps to keep, async or not, the resume mode.
        run_meta: JSON-able facts written into every step's `meta` (see `run_metadata`).
    """

    def __init__(self, directory: str | os.PathLike, config: CheckpointConfig, *, run_meta: Mapping | None = None):
        config.validate()
        self.config = config
        self._is_local = "://" not in str(directory)  # URLs such as gs:// stay as they are, checked by Orbax
        # Orbax rejects relative paths (only after creating a tmp folder).
        self.directory = os.path.abspath(directory) if self._is_local else directory
        self._run_meta = dict(run_meta or {})
        self._writing: int | None = None  # the step of the save in flight (async_save), if any
        if self._is_local:
            _check_writable(self.directory, probe=False)  # reading (export, generate) needs no write access
        self._manager = ocp.CheckpointManager(self.directory, options=_manager_options(config))
        if jax.process_count() > 1:
            _check_shared(self.directory)

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def all_steps(self) -> list[int]:
        """Every step on disk or being saved, oldest first."""
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        """The newest step on disk or being saved (`wait()` first for a committed one); None if none."""
        return self._manager.latest_step()

    def save(
        self,
        step: int,
        state: Any,
        *,
        data_position: Callable[[], Mapping] | None = None,
        meta: Mapping | None = None,
        force: bool = False,
    ) -> bool:
        """Saves `state` at `step` if `every_steps` or a preemption notice asks for it, or if `force`.

        Call it on every process at every step (the preemption check is a collective). With
        `async_save` it returns once the arrays are copied to host memory, so the caller may donate
        `state` right away; the write finishes in the background.

        Args:
            step: the step `state` is at.
            state: a pytree of (sharded) arrays, normally the TrainState.
            data_position: called only when the step is saved: this process's part of the input
                pipeline's position (JSON-able, keyed so that the processes' parts merge into one
                mapping; processes that share a key must give the same value). `restore` returns the
                merged mapping as `meta["data_position"]`.
            meta: JSON-able extras for this step's `meta` (e.g. a data position shared by all processes).
            force: save regardless of the interval (final step, preemption handled by the caller).

        Returns:
            True if a save was started; False if not due or `step` is already saved.

        Raises:
            CheckpointWriteError: this save, or the one still in flight before it, failed.
        """
        if step in self._manager.all_steps() or not (force or self._manager.should_save(step)):
            return False
        self.wait()  # Orbax's save waits for the previous one too; waiting here names that step if it failed
        items = {
            "state": ocp.args.StandardSave(state),
            "meta": ocp.args.JsonSave({**self._run_meta, **(meta or {}), "step": step}),
        }
        if data_position is not None:
            merged = {}
            for part in _gather_json(dict(data_position())):
                merged.update(part)
            items["data_position"] = ocp.args.JsonSave(merged)
        try:
            started = self._manager.save(step, args=ocp.args.Composite(**items), force=True)
        except _WRITE_ERRORS as error:
            raise CheckpointWriteError(step, self.directory, error) from error
        self._writing = step if started else None
        return started

    def wait(self) -> None:
        """Blocks until every save started so far is committed.

        Raises:
            CheckpointWriteError: a save in flight failed (whatever its background threads raised).
        """
        step, self._writing = self._writing, None
        try:
            self._manager.wait_until_finished()
        except Exception as error:
            raise CheckpointWriteError(step, self.directory, error) from error

    def _committed_step(self, step: int | None) -> int:
        """Waits for saves in flight, then returns `step` (the newest if None) or raises FileNotFoundError."""
        self.wait()
        step = self.latest_step() if step is None else step
        if step not in self.all_steps():
            raise FileNotFoundError(f"no checkpoint of step {step} in {self.directory} (steps: {self.all_steps()})")
        return step

    def restore(self, abstract_state: Any, *, step: int | None = None) -> tuple[Any, dict, int]:
        """Restores one step onto the shardings `abstract_state` asks for (any mesh).

        Args:
            abstract_state: the state's tree of `jax.ShapeDtypeStruct`s with concrete NamedShardings
                (`Training.abstract_state()`); arrays are read shard by shard onto that layout.
            step: the step to restore; the newest one if None.

        Returns:
            (state, meta, step); `meta["data_position"]` is the merged data position when the step
            was saved with one.

        Raises:
            FileNotFoundError: the step (or, with `step=None`, any step) is not in the directory.
            ValueError, OSError, KeyError: the step is damaged or does not match `abstract_state`.
        """
        step = self._committed_step(step)
        items = {"state": ocp.args.StandardRestore(abstract_state), "meta": ocp.args.JsonRestore()}
        has_position = (epath.Path(self.directory) / str(step) / "data_position").exists()
        if has_position:
            items["data_position"] = ocp.args.JsonRestore()
        restored = self._manager.restore(step, args=ocp.args.Composite(**items))
        meta = dict(restored.meta)
        if has_position:
            meta["data_position"] = dict(restored.data_position)
        return restored.state, meta, step

    def meta(self, step: int) -> dict:
        """The JSON metadata of one step (its `config_yaml`, mesh, seed...), without reading any array."""
        self._committed_step(step)
        return dict(self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta)

    def restore_params(self, abstract_state: Any, *, step: int | None = None) -> tuple[Any, dict, int]:
        """Restores only `params` (and the step counter) of one step; the optimizer state is never read.

        Args:
            abstract_state: as for `restore`; its `opt_state` only gives the tree structure.
            step: the step to restore; the newest one if None.

        Returns:
            (params, meta, step).
        """
        step = self._committed_step(step)
        target = dataclasses.replace(
            abstract_state, opt_state=jax.tree.map(lambda _: ocp.PLACEHOLDER, abstract_state.opt_state)
        )
        # StandardRestore refuses placeholders; PyTreeRestore reads the same files and skips them.
        restore_args = ocp.checkpoint_utils.construct_restore_args(target)
        items = {"state": ocp.args.PyTreeRestore(target, restore_args=restore_args), "meta": ocp.args.JsonRestore()}
        restored = self._manager.restore(step, args=ocp.args.Composite(**items))
        return restored.state.params, dict(restored.meta), step

    def restore_latest(self, abstract_state: Any) -> tuple[Any, dict, int] | None:
        """Restores the newest step that restores, falling back past damaged ones (logged, kept on disk).

        Returns:
            (state, meta, step), or None when the directory holds no checkpoint.

        Raises:
            NoRestorableCheckpointError: checkpoints exist but every one of them fails.
            RuntimeError: the processes restored different steps (damage only some of them read).
        """
        failures = {}
        for step in reversed(self.all_steps()):
            try:
                restored = self.restore(abstract_state, step=step)
            except _DAMAGED_STEP_ERRORS as error:
                failures[step] = error
                _warn("checkpoint step %d in %s cannot be restored (%s); falling back to an older step",
                      step, self.directory, _describe(error))
                continue
            _check_same_step_everywhere(step, self.directory, failures)
            self._set_aside(failures, "damaged", "they cannot be restored; kept for inspection")
            return restored
        if failures:
            raise NoRestorableCheckpointError(str(self.directory), failures)
        return None

    def _set_aside(self, steps: Iterable[int], suffix: str, why: str) -> None:
        """Renames step folders to `<step>.<suffix>` (process 0, once every process restored), so that
        Orbax no longer lists them and saves those step numbers again; a name already taken gets `.2`, `.3`..."""
        steps = sorted(steps)
        if not steps:
            return
        if jax.process_index() == 0:
            renamed = []
            for step in steps:
                folder = epath.Path(self.directory) / str(step)
                target, n = folder.parent / f"{step}.{suffix}", 1
                while target.exists():
                    n += 1
                    target = folder.parent / f"{step}.{suffix}.{n}"
                folder.rename(target)
                renamed.append(target.name)
            _warn("checkpoint steps %s in %s renamed to %s (%s)", steps, self.directory, ", ".join(renamed), why)
        if jax.process_count() > 1:
            multihost.sync_global_processes(f"podtrain_steps_set_aside_{suffix}_{steps[-1]}")
        self._manager.reload()

    def check_model(self, model: Any) -> None:
        """Raises ConfigError when the step `resume` would start from was saved with other model keys
        than `model` (a `ModelConfig`): restoring it would fail on every step, each reported as damaged."""
        steps = self.all_steps()
        if self.config.resume == "none" or not steps:
            return
        step = steps[-1] if self.config.resume == "auto" else int(self.config.resume)
        if step not in steps:
            return  # `resume` names the missing step
        try:
            differences = model_differences(self.meta(step), model)
        except _DAMAGED_STEP_ERRORS:
            return  # a damaged step: `resume` falls back past it
        if differences:
            raise ConfigError(f"checkpoint step {step} in {self.directory} was trained with a different model: "
                              f"{differences}. Resume with the model it was trained with, or start a new run "
                              "(run.name or checkpoint.dir)")

    def resume(self, abstract_state: Any) -> tuple[Any, dict, int] | None:
        """Restores what `config.resume` asks for.

        A step number restores that step and renames the newer ones `<step>.superseded` (logged):
        Orbax would otherwise skip every save up to the newest of them, and `auto` would later
        continue the old run. A training run calls this before its first step (readers such as
        `export` never do), so a local directory is checked here to take a file: a read-only one
        fails now, not at the first save.

        Returns:
            (state, meta, step), or None for a fresh start.

        Raises:
            ConfigError: the directory cannot be written, `resume` is `none` but the directory
                already holds checkpoints, or a step number that is not there.
        """
        if self._is_local:
            _check_writable(self.directory, probe=True)
        if self.config.resume == "auto":
            return self.restore_latest(abstract_state)
        if self.config.resume == "none":
            if self.all_steps():
                raise ConfigError(
                    f"checkpoint.resume=none, but {self.directory} already holds steps {self.all_steps()}: "
                    "use resume=auto to continue that run, or a new checkpoint.dir to start over"
                )
            return None
        step = int(self.config.resume)
        if step not in self.all_steps():
            raise ConfigError(f"checkpoint.resume={step}: no such step in {self.directory} (steps: {self.all_steps()})")
        restored = self.restore(abstract_state, step=step)
        newer = [s for s in self.all_steps() if s > step]
        if newer and jax.process_count() > 1:
            multihost.sync_global_processes(f"podtrain_restored_step_{step}")  # rename only once all restored it
        self._set_aside(newer, "superseded", f"newer than checkpoint.resume={step}, which the run continues from; "
                                             "kept, never deleted")
        return restored

    def close(self) -> None:
        """Waits for pending saves, then releases Orbax's threads (also when a save failed).

        Raises:
            CheckpointWriteError: a save in flight failed.
        """
        try:
            self.wait()
        finally:
            self._manager.close()


def _gather_json(value: Any) -> list:
    """`value` (JSON-able) of every process, in process order, through two allgathers of bytes."""
    if jax.process_count() == 1:
        return [value]
    data = np.frombuffer(json.dumps(value).encode(), np.uint8)
    sizes = multihost_utils.process_allgather(np.int32(data.size)).tolist()
    padded = np.zeros(max(sizes), np.uint8)
    padded[: data.size] = data
    rows = multihost_utils.process_allgather(padded)
    return [json.loads(bytes(row[:size])) for row, size in zip(rows, sizes, strict=True)]


def _check_writable(directory: str, *, probe: bool) -> None:
    """Raises ConfigError unless this process can create the local `directory` and, with `probe`,
    write a file into it (removed again)."""
    try:
        os.makedirs(directory, exist_ok=True)
        if probe:
            path = os.path.join(directory, f".podtrain-writable-{uuid.uuid4().hex}")
            with open(path, "xb") as f:
                f.write(b"written by podtrain to check that checkpoints can be written here\n")
            os.unlink(path)
        return
    except FileExistsError:  # from makedirs: `directory` is a file
        reason = os.strerror(errno.ENOTDIR)
    except OSError as error:
        reason = error.strerror or str(error)
    raise ConfigError(f"checkpoint.dir={directory}: cannot create or write the checkpoint directory ({reason}): "
                      "expected a directory podtrain can create and write; fix the path or its permissions, or "
                      "set another checkpoint.dir")


def _check_shared(directory: str) -> None:
    """Raises ConfigError unless every process sees a file that process 0 writes into `directory`.

    When process 0 cannot write there, nothing is checked (a reader such as `export` may read a
    read-only directory; a training run's `resume` then reports the directory as unwritable)."""
    token = _gather_json(uuid.uuid4().hex if jax.process_index() == 0 else "")[0]
    probe = epath.Path(directory) / f".podtrain-shared-{token}"
    written = True
    if jax.process_index() == 0:
        try:
            probe.parent.mkdir(parents=True, exist_ok=True)
            probe.write_text("written by process 0 to check that every process sees this directory\n")
        except OSError:
            written = False
    if not _gather_json(written)[0]:  # a collective: every process learns it and none waits alone
        return
    seen = _gather_json(probe.exists())  # a collective: every process has looked once it returns
    if jax.process_index() == 0:
        probe.unlink()
    blind = [i for i, ok in enumerate(seen) if not ok]
    if blind:
        raise ConfigError(f"checkpoint.dir={directory}: processes {blind} do not see the file process 0 wrote "
                          f"there; with several hosts it must be a shared filesystem or a URL such as gs://")


def _check_same_step_everywhere(step: int, directory: str, failures: Mapping[int, Exception]) -> None:
    """Raises unless every process restored `step` (a scalar per process is gathered, never an array)."""
    if jax.process_count() == 1:
        return
    steps = multihost_utils.process_allgather(np.int32(step)).tolist()
    if len(set(steps)) > 1:
        failed_here = "; ".join(f"step {s}: {_describe(e)}" for s, e in failures.items()) or "none"
        raise RuntimeError(
            f"the processes restored different steps from {directory} (by process: {steps}; failures on this "
            f"process: {failed_here}): a newer step is damaged where only some processes read it; move it away"
        )


def _warn(msg: str, *args) -> None:
    if jax.process_index() == 0:
        logger.warning(msg, *args)
