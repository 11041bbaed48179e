"""Files other processes read while this one writes them."""

from __future__ import annotations

import os
from pathlib import Path


def write_atomic(path: str | os.PathLike, text: str) -> None:
    """Writes `text` to `path` so that a reader sees the old file or the new one, never an empty
    or half-written one: the text goes to a file beside it, which then replaces it."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
