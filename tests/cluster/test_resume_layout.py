"""Resuming on another process layout: the data position is kept per global batch row.

A run checkpointed by 2 hosts whose rows are split between them resumes on 2 hosts that both load
every row (`tp` spanning the hosts), then on one process, and sees the batches of an uninterrupted
one-process run (loopback only: real Ray, real worker processes, real checkpoints).
"""

import json

import pytest
from cluster_fixtures import TWO_HOSTS, finish, run_train, start, train_command
from train_fixtures import losses

pytestmark = [pytest.mark.ray, pytest.mark.slow]
CONSTANT = "optimizer.schedule=constant"  # so that the stages' steps equal the reference's
SPLIT_ROWS = ["mesh.fsdp=4", "mesh.tp=1"]  # 2 hosts: rows 0-1 on host 0, rows 2-3 on host 1
SHARED_ROWS = ["mesh.fsdp=1", "mesh.tp=4"]  # 2 hosts: both hold every row
# The stages compute on different meshes, so their losses may differ from the reference's by
# float32 summation order (about 1e-6 on a loss of 6); a batch read from the wrong position
# changes the loss by more than 1e-2.
TOLERANCE = 1e-5


def test_resume_on_two_then_one_process_with_other_meshes_reads_the_same_batches(tmp_path):
    reference = start(train_command(tmp_path / "reference", 6, "cluster=none", CONSTANT, *SPLIT_ROWS), tmp_path,
                      "reference", devices=4)
    run_dir = tmp_path / "moved"
    for steps, placement, mesh, devices in ((2, TWO_HOSTS, SPLIT_ROWS, 2), (4, TWO_HOSTS, SHARED_ROWS, 2),
                                            (6, ["cluster=none"], SPLIT_ROWS, 4)):
        done = run_train(tmp_path, run_dir, steps, *placement, CONSTANT, *mesh, devices=devices)
        assert done.returncode == 0, (steps, (done.stdout + done.stderr)[-4000:])
    out = finish(reference)
    assert reference.returncode == 0, out[-4000:]
    # Each stage resumed where the one before stopped: every step was trained once.
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    want = losses(tmp_path / "reference")
    for record in records:
        step, loss = record["step"], record["loss"]
        assert abs(loss - want[step]) <= TOLERANCE, (step, loss, want[step])
