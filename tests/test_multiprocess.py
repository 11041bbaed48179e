"""Two JAX processes x 2 devices give the same losses as one process with 4 devices."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).parent / "mp_worker.py"
ROOT = Path(__file__).parent.parent
OVERRIDES = ["mesh.fsdp=2", "mesh.tp=2", "model.num_layers=2", "train.batch_size=4", "train.seq_len=32"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_world(num_processes: int, devices_per_process: int) -> list[dict]:
    port = free_port()
    procs = []
    for pid in range(num_processes):
        env = dict(os.environ, NUM_PROCESSES=str(num_processes), PROCESS_ID=str(pid),
                   DEVICES_PER_PROCESS=str(devices_per_process), COORDINATOR=f"127.0.0.1:{port}",
                   PYTHONPATH=str(ROOT))
        procs.append(subprocess.Popen([sys.executable, str(WORKER), *OVERRIDES], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=240))
    finally:  # on a timeout or error, leave nothing running
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    results = []
    for proc, (out, err) in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_processes_match_one_process():
    single = run_world(1, 4)
    multi = run_world(2, 2)
    assert single[0]["devices"] == 4 and all(r["devices"] == 4 for r in multi)
    assert multi[0]["losses"] == multi[1]["losses"]
    for a, b in zip(multi[0]["losses"], single[0]["losses"], strict=True):
        assert abs(a - b) <= 1e-6, (multi[0]["losses"], single[0]["losses"])
