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
(a truncated, garbled or missing array file, broken metadata, or a state that no longer matches the
model) is logged and the step before it is tried. Every process reads its own shards of a step, then
the processes share their outcomes and decide together: a step whose read failed on any process is
damaged for all of them, so they fall back to the same step. Nothing is ever deleted by a restore;
once an older step restored, process 0 renames the damaged newer ones `<step>.damaged` (Orbax then
ignores them, so the run checkpoints those step numbers again instead of skipping every save up to
them). With no checkpoint the run starts fresh; when checkpoints exist but none restores,
`NoRestorableCheckpointError` lists every step with its error, because silently starting over would
throw away a run. `none` starts fresh and refuses a directory that already holds checkpoints (Orbax
would silently skip saving any step not newer than the ones there); a step number restores exactly
that step and, once every process restored it, renames the newer steps `<step>.superseded` (kept,
never deleted): the run writes its own steps under those numbers, and a later `auto` continues the
new run, not the one it replaced. A `.damaged` or `.superseded` name already taken gets `.2`,
`.3`... Both mistakes (`none` on checkpoints, a step that is not there) are `ConfigError`s.

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
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath
from jax.sharding import Mesh
from orbax.checkpoint import multihost

from podtrain.orchestrator.checkpoint.directory import check_shared, check_writable
from podtrain.orchestrator.checkpoint.integrity import (
    DAMAGE_ERRORS,
    DamagedStepError,
    abandoned_reads_dropped,
    changed_leaves,
    damage_in,
    describe,
    drop_abandoned_reads,
    fingerprints,
    gather_json,
    raise_if_failed,
    verdict,
)
from podtrain.orchestrator.checkpoint.resume import has_item, read_item, resume_step
from podtrain.orchestrator.common.errors import ConfigError
from podtrain.orchestrator.config.compose import to_yaml
from podtrain.orchestrator.config.schema import CheckpointConfig, Config
from podtrain.sharding.mesh import describe_mesh

logger = logging.getLogger(__name__)

# What a save raises when writing fails: tensorstore reports RESOURCE_EXHAUSTED (a full disk) and
# OUT_OF_RANGE (past a file size limit) as ValueError; files written by Python raise OSError.
_WRITE_ERRORS = (ValueError, OSError)
ORBAX_RESTORE_GB = 96  # Orbax's default bound on the GB a restore reads at once


class NoRestorableCheckpointError(ConfigError):
    """Checkpoints exist but none of them restores: a restart would not help, the user must choose
    (the CLI prints it as one line, exit code 2).

    Attributes:
        failures: each step tried (newest first) and the error its restore raised.
    """

    def __init__(self, directory: str, failures: Mapping[int, Exception]):
        self.failures = dict(failures)
        listed = "; ".join(f"step {step}: {getattr(error, 'reason', None) or describe(error)}"
                           for step, error in self.failures.items())
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
        super().__init__(f"{which} could not be written to {directory} ({describe(error, max_chars=1000)}); the "
                         "steps committed before it are kept: free space or fix the storage, then resume")




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


def _item_handlers(config: CheckpointConfig) -> dict | None:
    """With `host_gb`, a state handler that holds at most that many GB in host memory at once:
    copied from the devices or being written (the same files; an async save then blocks until the
    rest is under the bound), or being read. None: Orbax's handlers for the items' args."""
    if not config.host_gb:
        return None
    bound = config.host_gb
    state = ocp.PyTreeCheckpointHandler(save_concurrent_gb=bound, save_device_host_concurrent_gb=bound,
                                        restore_concurrent_gb=bound)
    return {"state": state, **{item: ocp.JsonCheckpointHandler() for item in ("meta", "fingerprints", "data_position")}}


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
            check_writable(self.directory, probe=False)  # reading (export, generate) needs no write access
        self._manager = ocp.CheckpointManager(self.directory, options=_manager_options(config),
                                              item_handlers=_item_handlers(config))
        if jax.process_count() > 1:
            check_shared(self.directory)

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
            "state": ocp.args.PyTreeSave(state) if self.config.host_gb else ocp.args.StandardSave(state),
            "meta": ocp.args.JsonSave({**self._run_meta, **(meta or {}), "step": step}),
            "fingerprints": ocp.args.JsonSave(fingerprints(state)),
        }
        if data_position is not None:
            merged = {}
            for part in gather_json(dict(data_position())):
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

        Every process reads its own shards, then the processes agree on the outcome: when the read
        failed anywhere, it raises on every process (never some training and some not).

        Args:
            abstract_state: the state's tree of `jax.ShapeDtypeStruct`s with concrete NamedShardings
                (`Training.abstract_state()`); arrays are read shard by shard onto that layout.
            step: the step to restore; the newest one if None.

        Returns:
            (state, meta, step); `meta["data_position"]` is the merged data position when the step
            was saved with one.

        Raises:
            FileNotFoundError: the step (or, with `step=None`, any step) is not in the directory.
            DamagedStepError: the step's files are damaged (on this process or another one), or the
                step does not match `abstract_state`.
        """
        step = self._committed_step(step)
        restored, error = self._read_step(step, abstract_state)
        raise_if_failed(step, self.directory, error, gather_json(verdict(error)))
        self._check_fingerprints(step, restored[0])
        return restored

    def _read_step(self, step: int, abstract_state: Any) -> tuple[tuple[Any, dict, int] | None, Exception | None]:
        """(restored, None) or (None, the error) for one step, read by this process alone.

        Orbax's own restore ends in a barrier that a process whose read failed never reaches; its
        peers would then pair that barrier with whatever collective the failed process runs next.
        Reading with the item handlers directly has no collective, so the processes stay in step
        and can agree on the outcome afterwards."""
        folder = epath.Path(self.directory) / str(step)
        handler = ocp.StandardCheckpointHandler(restore_concurrent_gb=self.config.host_gb or ORBAX_RESTORE_GB)
        with abandoned_reads_dropped():
            try:
                state = handler.restore(folder / "state", args=ocp.args.StandardRestore(abstract_state))
                meta = read_item(self.directory, step, "meta")
                if has_item(self.directory, step, "data_position"):
                    meta["data_position"] = read_item(self.directory, step, "data_position")
            except Exception as error:  # judged with every process's outcome in `raise_if_failed`
                if damage_in(error) is not None:
                    drop_abandoned_reads(error)
                return None, error
            finally:
                handler.close()
        return (state, meta, step), None

    def _check_fingerprints(self, step: int, state: Any, *, within: str = "") -> None:
        """Raises DamagedStepError (on every process: the sums are global) when an array restored
        differs from the one saved; steps saved without fingerprints are taken as read. `within` is
        `state`'s path in the saved tree when only part of it was restored (".params")."""
        if not has_item(self.directory, step, "fingerprints"):
            return
        try:
            saved = read_item(self.directory, step, "fingerprints")
        except DAMAGE_ERRORS as error:
            raise DamagedStepError(step, self.directory, f"its fingerprints cannot be read: {describe(error)}"
                                   ) from error
        saved = {path.removeprefix(within): value for path, value in saved.items() if path.startswith(within)}
        changed = changed_leaves(saved, state)
        if changed:
            raise DamagedStepError(step, self.directory, f"arrays read differ from the ones saved: {changed}")

    def meta(self, step: int) -> dict:
        """The JSON metadata of one step (its `config_yaml`, mesh, seed...), without reading any array."""
        self._committed_step(step)
        return read_item(self.directory, step, "meta")

    def restore_params(self, abstract_params: Any, *, step: int | None = None) -> tuple[Any, dict, int]:
        """Restores only the `params` of one step's TrainState; the optimizer state is never read.

        Args:
            abstract_params: the params' tree of `jax.ShapeDtypeStruct`s with concrete NamedShardings
                (`sharding.place.abstract_model`); arrays are read shard by shard onto that layout.
            step: the step to restore; the newest one if None.

        Returns:
            (params, meta, step).

        Raises:
            FileNotFoundError: the step (or, with `step=None`, any step) is not in the directory.
            DamagedStepError: a params array read differs from the one saved.
        """
        step = self._committed_step(step)
        target = {"params": abstract_params}  # the saved TrainState's field; its other leaves are skipped
        restore_args = ocp.checkpoint_utils.construct_restore_args(target)
        state = ocp.args.PyTreeRestore(target, restore_args=restore_args, partial_restore=True)
        restored = self._manager.restore(step, args=ocp.args.Composite(state=state, meta=ocp.args.JsonRestore()))
        params = restored.state["params"]
        self._check_fingerprints(step, params, within=".params")
        return params, dict(restored.meta), step

    def restore_latest(self, abstract_state: Any) -> tuple[Any, dict, int] | None:
        """Restores the newest step that restores, falling back past damaged ones (logged, then renamed
        `<step>.damaged` once an older step restored; kept on disk).

        A step counts as damaged when its read fails on any process: the processes decide together,
        step by step, so they fall back to the same step.

        Returns:
            (state, meta, step), or None when the directory holds no checkpoint.

        Raises:
            NoRestorableCheckpointError: checkpoints exist but every one of them is damaged.
            RuntimeError: a read failed for another reason than damage (raised on every process).
        """
        failures = {}
        for step in reversed(self.all_steps()):
            restored, error = self._read_step(step, abstract_state)
            try:
                raise_if_failed(step, self.directory, error, gather_json(verdict(error)))
                self._check_fingerprints(step, restored[0])
            except DamagedStepError as damaged:
                failures[step] = damaged
                _warn("checkpoint step %d in %s cannot be restored (%s); falling back to an older step",
                      step, self.directory, damaged.reason)
                continue
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
            check_writable(self.directory, probe=True)
        step = resume_step(self.config.resume, self.directory, self.all_steps())
        if step is None:
            return None
        if self.config.resume == "auto":
            return self.restore_latest(abstract_state)
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


def _warn(msg: str, *args) -> None:
    if jax.process_index() == 0:
        logger.warning(msg, *args)
