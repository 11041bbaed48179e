"""What the service's store costs per request: one future added and completed in `serve.sqlite`.

    PYTHONPATH=. .venv/bin/python bench/serve_store.py [--futures N]

Every Tinker request the service answers makes a future row and completes it (two commits). The
store runs SQLite in WAL mode; this times those commits with SQLite's default `synchronous=FULL`
(the log synced at every commit) and with the store's own setting, `NORMAL` (synced at
checkpoints; a killed service still loses nothing). Prints one JSON object: ms per future.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

from podtrain.orchestrator.serve.store import Store


def ms_per_future(futures: int, synchronous: str | None) -> float:
    with tempfile.TemporaryDirectory() as directory:
        store = Store(directory)
        if synchronous is not None:
            store._db.execute(f"PRAGMA synchronous={synchronous}")
        start = time.perf_counter()
        for _ in range(futures):
            request_id, _ = store.add_future("forward_backward", None, None)
            store.complete_future(request_id, b"x" * 200, "application/json")
        seconds = time.perf_counter() - start
        store.close()
    return seconds / futures * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--futures", type=int, default=500)
    args = parser.parse_args()
    print(json.dumps({"full_ms": round(ms_per_future(args.futures, "FULL"), 3),
                      "store_ms": round(ms_per_future(args.futures, None), 3)}))


if __name__ == "__main__":
    main()
