"""Checks of a checkpoint directory before a run uses it: this process can create and write it,
and every process sees what process 0 writes there (a shared filesystem or a URL with several
hosts). Each failure is one ConfigError naming `checkpoint.dir`."""

from __future__ import annotations

import errno
import os
import uuid

import jax
from etils import epath

from podtrain.orchestrator.checkpoint.integrity import gather_json
from podtrain.orchestrator.common.errors import ConfigError


def check_writable(directory: str, *, probe: bool) -> None:
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


def check_shared(directory: str) -> None:
    """Raises ConfigError unless every process sees a file that process 0 writes into `directory`.

    When process 0 cannot write there, nothing is checked (a reader such as `export` may read a
    read-only directory; a training run's `resume` then reports the directory as unwritable)."""
    token = gather_json(uuid.uuid4().hex if jax.process_index() == 0 else "")[0]
    probe = epath.Path(directory) / f".podtrain-shared-{token}"
    written = True
    if jax.process_index() == 0:
        try:
            probe.parent.mkdir(parents=True, exist_ok=True)
            probe.write_text("written by process 0 to check that every process sees this directory\n")
        except OSError:
            written = False
    if not gather_json(written)[0]:  # a collective: every process learns it and none waits alone
        return
    seen = gather_json(probe.exists())  # a collective: every process has looked once it returns
    if jax.process_index() == 0:
        probe.unlink()
    blind = [i for i, ok in enumerate(seen) if not ok]
    if blind:
        raise ConfigError(f"checkpoint.dir={directory}: processes {blind} do not see the file process 0 wrote "
                          f"there; with several hosts it must be a shared filesystem or a URL such as gs://")
