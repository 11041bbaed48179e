"""A saved adapter is a directory: `adapter.safetensors` (the slot's A and B, and with the optimizer
its Adam moments, each cut to the adapter's rank) beside `adapter_state.json` (rank, alpha, targets,
Adam step); `save_weights_for_sampler` adds the PEFT files (`adapter_model.safetensors`,
`adapter_config.json`) where PEFT can name the targets.

A save is written into `<path>.partial` and renamed over `<path>`; the save it replaces stays
whole as `<path>.previous` until then, so a save stopped anywhere leaves one that loads."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import jax
import numpy as np
from safetensors.numpy import load_file, save_file

from podtrain.orchestrator.serve.slots import pad_rank
from podtrain.orchestrator.serve.work import ServeError

STATE_FILE, ARRAYS_FILE = "adapter_state.json", "adapter.safetensors"


def previous(path: Path) -> Path:
    """Where a save keeps the save it replaces until the new one is in place."""
    return path.with_name(path.name + ".previous")


def partial(final: Path) -> Path:
    """Where a save to `final` is written until it is whole."""
    return final.with_name(final.name + ".partial")


def start_save(final: Path, arrays: dict[str, np.ndarray], state: dict) -> Path:
    """The partial directory of a save to `final`, holding `arrays` and `state` (a save that stopped
    between its renames is put back first)."""
    written = partial(final)
    if previous(final).exists() and not final.exists():
        os.replace(previous(final), final)
    shutil.rmtree(written, ignore_errors=True)
    written.mkdir(parents=True)
    save_file(arrays, str(written / ARRAYS_FILE))
    (written / STATE_FILE).write_text(json.dumps(state, indent=2) + "\n")
    return written


def finish_save(final: Path) -> None:
    """The partial save renamed over `final`; the save it replaces is kept until then."""
    shutil.rmtree(previous(final), ignore_errors=True)
    if final.exists():
        os.replace(final, previous(final))
    os.replace(partial(final), final)
    shutil.rmtree(previous(final), ignore_errors=True)


def read_saved(where: str) -> tuple[dict, dict[str, np.ndarray]]:
    """(state, arrays) of the save at `where` (or of the save it was replacing, if it stopped
    between its renames)."""
    path = Path(where)
    if not path.exists() and previous(path).exists():
        path = previous(path)
    try:
        return json.loads((path / STATE_FILE).read_text()), load_file(str(path / ARRAYS_FILE))
    except (OSError, ValueError) as e:
        raise ServeError(f"path: no saved adapter state at {where} ({e})", status=404) from None


def saved_tree(arrays: dict[str, np.ndarray], prefix: str, like, names: list[str], axes: list[int], max_rank: int,
               where: str):
    """The tree of `like`'s structure (one slot: the adapter axis dropped) from the arrays named
    `<prefix>.<name>`, each padded from its saved rank to `max_rank`."""
    leaves = []
    for name, axis, x in zip(names, axes, jax.tree.leaves(like), strict=True):
        key, shape = f"{prefix}.{name}", x.shape[:axis] + x.shape[axis + 1:]
        if key not in arrays:
            raise ServeError(f"path: {where} lacks {key} ({ARRAYS_FILE})")
        try:
            leaves.append(pad_rank(arrays[key], name, axis, max_rank))
        except ValueError as e:
            raise ServeError(str(e)) from None
        if leaves[-1].shape != shape:
            raise ServeError(f"path: {where}: {key} has shape {arrays[key].shape}, this service's adapters {shape} "
                             f"(at rank {max_rank})")
    return jax.tree.unflatten(jax.tree.structure(like), leaves)
