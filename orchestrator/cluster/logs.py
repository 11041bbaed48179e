"""What the driver echoes of its workers' logs: rank 0's lines, every rank's errors and tracebacks."""

from __future__ import annotations

import re

_ERROR_LINE = re.compile(r"Traceback|Error|error:|FATAL|Fatal|Check failed|Aborted|Segmentation fault")

# A library's INFO record in a worker's log ("<date> <time> INFO absl: ..."): kept in the rank log, not echoed.
_LIBRARY_INFO = re.compile(r"^\d{4}-\d\d-\d\d [\d:,]+ INFO (?!podtrain)\S+: ")


# A worker's one line for a mistake in the input: the driver reports it as the job's error instead.
_CONFIG_ERROR_PREFIX = "podtrain: error: "


class LogFilter:
    """Prints rank 0's lines (but the libraries' INFO records) and other ranks' error lines and
    tracebacks, each with a rank prefix."""

    def __init__(self, out):
        self.out = out
        self.in_traceback: dict[int, bool] = {}

    def feed(self, rank: int, lines: list[str]) -> None:
        for line in lines:
            show = rank == 0 and not _LIBRARY_INFO.match(line)
            if line.startswith("Traceback"):
                self.in_traceback[rank] = True
            if self.in_traceback.get(rank):
                show = True
                if line and not line.startswith((" ", "Traceback")):
                    self.in_traceback[rank] = False  # the exception line ends the block
            show = (show or bool(_ERROR_LINE.search(line))) and not line.startswith(_CONFIG_ERROR_PREFIX)
            if show:
                print(f"[rank {rank}] {line}", file=self.out, flush=True)
