"""What the training loop reports: its metrics in TensorBoard's event files, and step times that
leave out evals and checkpoint saves."""

import json
import subprocess
import sys
import time

import pytest
from train_fixtures import ROOT, TINY, env, tensorboard_scalars


def test_metrics_reach_tensorboard_without_importing_torch(tmp_path):
    """The writer imports tensorboardX with torch hidden (seconds saved at every process start)."""
    script = (f"import sys\nfrom pathlib import Path\nfrom podtrain.orchestrator.train.metrics import MetricsWriter\n"
              f"w = MetricsWriter(Path({str(tmp_path)!r}), enabled=True, total_steps=3)\n"
              "for s in (1, 2, 3):\n    w.write({'step': s, 'loss': 4.0 - s, 'lr': 0.5, 'sample': 'text'})\n"
              "w.close()\nassert 'torch' not in sys.modules, 'torch was imported'\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env(), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    scalars = tensorboard_scalars(tmp_path / "tensorboard")
    assert scalars["loss"] == [(1, 3.0), (2, 2.0), (3, 1.0)] and scalars["lr"] == [(1, 0.5), (2, 0.5), (3, 0.5)]
    assert "sample" not in scalars and "step" not in scalars


@pytest.mark.slow
def test_step_times_leave_out_evals_and_saves(tmp_path, monkeypatch):
    """An eval (here made 3 s slower) and a checkpoint save are not the step's time: step_s,
    tokens/s and MFU measure training only."""
    import podtrain.orchestrator.train.loop as train_module
    from podtrain.orchestrator.config.compose import load_config

    real_evaluate = train_module.evaluate

    def slow_evaluate(*args, **kwargs):
        time.sleep(3.0)
        return real_evaluate(*args, **kwargs)

    real_save = train_module.Checkpointer.save
    on_disk_at_save = {}

    def save_after_its_record(self, step, *args, **kwargs):
        """An async save can commit before the loop goes on: a kill -9 then must not lose the record."""
        lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
        on_disk_at_save[step] = [json.loads(line)["step"] for line in lines]
        return real_save(self, step, *args, **kwargs)

    monkeypatch.setattr(train_module, "evaluate", slow_evaluate)
    monkeypatch.setattr(train_module.Checkpointer, "save", save_after_its_record)
    config = load_config("llama3-tiny", [*TINY, "mesh.fsdp=4", "mesh.tp=2", "train.steps=3", "train.eval_every=2",
                                         "train.eval_batches=1", "checkpoint.every_steps=2", "data.eval_fraction=0.05"])
    train_module.run(config, tmp_path / "run")  # gives SIGTERM and SIGINT their handlers back
    records = {r["step"]: r for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())}
    assert on_disk_at_save[2] == [1, 2] and on_disk_at_save[3] == [1, 2, 3], on_disk_at_save
    assert "eval_loss" in records[2] and "save_block_s" in records[3]  # the step after the save carries its time
    assert records[2]["step_s"] < 3.0 and records[3]["step_s"] < 3.0, records
