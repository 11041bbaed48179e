"""`podtrain serve`'s bad input: one line naming the key, exit 2, before anything starts."""

from __future__ import annotations

import subprocess
import sys

import pytest
from train_fixtures import ROOT


@pytest.mark.parametrize("overrides, message", [
    (["serve.max_rank=0"], "serve.max_rank: expected a positive integer, found 0"),
    (["serve.port=70000"], "serve.port: expected 0 (any free port) to 65535, found 70000"),
    (["serve.host=0.0.0.0"], "serve.host: 0.0.0.0 is not a loopback address, so the service needs an API key"),
    (["serve.max_seq_len=100000"], "serve.max_seq_len: expected at most model.max_position_embeddings="),
    (["serve.lora_alpha=-1"], "serve.lora_alpha: expected a number > 0, found -1"),
    (["serve.autosave_every=-2"], "serve.autosave_every: expected 0 (never) or a positive number of optimizer steps, "
                                  "found -2"),
    (["cluster=tpu", "cluster.tpu_type=v4-16", "cluster.num_slices=2", "cluster.elastic=true"],
     "cluster.elastic: a service's engine runs on a fixed gang; expected false, found true"),
])
def test_bad_serve_settings_are_one_line_and_exit_2(overrides, message, tmp_path):
    done = subprocess.run([sys.executable, "-m", "podtrain.launch.cli", "serve", "-c", "llama3-tiny",
                           f"run.dir={tmp_path}", *overrides], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu"})
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("podtrain: error: ") and message in lines[-1], done.stderr
    assert not list(tmp_path.iterdir())  # nothing was written
