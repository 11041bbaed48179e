"""What the service tests share: a tiny HF Llama directory with its own tokenizer (the base model
clients name by the directory's name), and `podtrain serve` processes started on it."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

from cluster_fixtures import env
from hf_fixtures import SHAPES, save_hf_model
from train_fixtures import ROOT

KEY = "tml-podtrain-test"
# Small enough to compile quickly, large enough for a few clients' batches.
SERVE = ["serve.port=0", "serve.max_adapters=8", "serve.max_rank=8", "serve.max_seq_len=64", "serve.max_rows=8",
         "serve.compile_ahead=false"]


def hf_base(directory: Path) -> Path:
    """A tiny random Llama (untied head) with a word-level tokenizer over its whole vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    directory.mkdir(parents=True, exist_ok=True)
    save_hf_model("llama", directory)
    words = ["<unk>", "</s>", *(f"w{i}" for i in range(2, SHAPES["vocab_size"]))]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>", "eos_token": "</s>"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


class Service:
    """A `podtrain serve` process; `url` once it listens."""

    def __init__(self, tmp_path: Path, base: Path, run_dir: Path, *extra: str, devices: int = 2, name: str = "serve"):
        self.run_dir = run_dir
        self.log_path = tmp_path / f"{name}.log"
        (run_dir / "serve.json").unlink(missing_ok=True)
        given = {o.split("=", 1)[0] for o in extra}
        serve = [o for o in SERVE if o.split("=", 1)[0] not in given]
        command = [sys.executable, "-m", "podtrain.launch.cli", "serve", "-c", str(base), *serve,
                   f"run.dir={run_dir.parent}", f"run.name={run_dir.name}", *extra]
        self.log = open(self.log_path, "w+")  # noqa: SIM115 (closed by stop)
        # Without JAX's persistent compilation cache: on CPU, a two-device engine whose programs are
        # loaded from it deadlocks in XLA's in-process collectives (docs/known-gaps.md).
        uncached = {k: v for k, v in env(tmp_path, devices).items() if k != "JAX_COMPILATION_CACHE_DIR"}
        self.proc = subprocess.Popen(command, cwd=ROOT, env=dict(uncached, JAX_ENABLE_COMPILATION_CACHE="false"),
                                     stdout=self.log, stderr=subprocess.STDOUT, text=True)
        self.url = self._wait_url(timeout=240)

    def _wait_url(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if (self.run_dir / "serve.json").exists():
                return json.loads((self.run_dir / "serve.json").read_text())["url"]
            if self.proc.poll() is not None:
                raise AssertionError(f"podtrain serve exited with {self.proc.returncode}:\n{self.output()}")
            time.sleep(0.2)
        raise AssertionError(f"podtrain serve did not listen within {timeout}s:\n{self.output()}")

    def output(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return self.log_path.read_text()

    def stop(self, timeout: float = 120) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout=timeout)
        self.log.close()
        return code
