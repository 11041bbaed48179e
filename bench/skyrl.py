"""SkyRL's Tinker API server (JAX backend, CPU) as the reference for `podtrain serve`.

    PYTHONPATH=. .venv/bin/python bench/skyrl.py [--venv DIR] [--adapters 1 4 16] [--steps N]

SkyRL needs Python 3.12, so it gets a virtualenv of its own; its `[tinker]` extra pins an older
`tinker` than the SDK the client loop uses, so the server's dependencies are installed by name.
Its API process starts the engine as a second process with `uv run`, repeating the `uv run` flags
it was started with: `uv run --no-project --python <venv python>` keeps both in that virtualenv
and off the network. SkyRL answers samples without the sequence ids that SDKs from 0.26 on
require, so sampling is measured with an older SDK (`--sample-python`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

PYTHON_VERSION = "3.12"
# skyrl 0.4.0 with its `jax` extra and its Tinker server's dependencies, as resolved and run here.
SKYRL_REQUIREMENTS = [
    "skyrl==0.4.0",
    "jax==0.12.0.1",
    "jaxlib==0.12.0.1",
    "flax==0.12.12",
    "optax==0.2.8",
    "transformers==5.16.1",
    "tinker==0.38.0",
    "fastapi[standard]==0.165.0",
    "uvicorn==0.55.0",
    "sqlmodel==0.0.50",
    "sqlalchemy[asyncio]==2.1.9",
    "aiosqlite==0.22.1",
    "aiohttp==3.14.5",
    "psutil==7.2.2",
    "uv==0.13.9",
]
STARTUP_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 30.0


def find_python312() -> Path:
    """A Python 3.12 that runs: `python3.12` on PATH (a pyenv shim may not), else pyenv's newest 3.12."""
    candidates = [shutil.which(f"python{PYTHON_VERSION}")]
    if pyenv := shutil.which("pyenv"):
        root = subprocess.run([pyenv, "root"], capture_output=True, text=True, check=True).stdout.strip()
        versions = sorted(Path(root, "versions").glob(f"{PYTHON_VERSION}.*"), reverse=True)
        candidates += [str(version / "bin" / f"python{PYTHON_VERSION}") for version in versions]
    for candidate in filter(None, candidates):
        if subprocess.run([candidate, "--version"], capture_output=True).returncode == 0:
            return Path(candidate)
    raise FileNotFoundError(f"no Python {PYTHON_VERSION} runs here: install one, e.g. `pyenv install {PYTHON_VERSION}`")


def ensure_skyrl_venv(path: Path) -> Path:
    """Creates a Python 3.12 virtualenv with SkyRL's Tinker server at `path` unless one is there."""
    path = Path(path)
    python = path / "bin" / "python"
    if not (path / "bin" / "uv").exists():
        subprocess.run([str(find_python312()), "-m", "venv", str(path)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", *SKYRL_REQUIREMENTS], check=True)
    return path


MODEL_SIZES = {
    # name: (layers, hidden, intermediate, heads, kv heads, head dim)
    "tiny": (2, 64, 128, 4, 2, 16),
    "mid": (8, 512, 1536, 8, 4, 64),
}


def make_qwen3_dir(path: Path, size: str = "tiny") -> Path:
    """Writes a random float32 Qwen3 of `size` (`MODEL_SIZES`; vocab 512, untied head) and a
    512-word tokenizer."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    path = Path(path)
    vocab_size = 512
    layers, hidden, intermediate, heads, kv_heads, head_dim = MODEL_SIZES[size]
    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).to(torch.float32).save_pretrained(path)
    words = ["<pad>", "<s>", "</s>", "<unk>"] + [f"w{i}" for i in range(4, vocab_size)]
    tokenizer = Tokenizer(models.WordLevel({word: i for i, word in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    ).save_pretrained(path)
    return path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until_healthy(url: str, server: subprocess.Popen, timeout_s: float) -> None:
    """Polls `url` until it answers 200; fails early if the server process exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"SkyRL's server exited with code {server.returncode} before answering {url}")
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=5) as response:
            if response.status == 200:
                return
        time.sleep(1.0)
    raise TimeoutError(f"SkyRL's server did not answer {url} within {timeout_s:.0f} s")


@contextlib.contextmanager
def skyrl_server(
    venv: Path, model_dir: Path, port: int, *, max_lora_adapters: int = 32, max_lora_rank: int = 32
) -> Iterator[tuple[str, str]]:
    """Runs SkyRL's Tinker API server (JAX backend) on 127.0.0.1:`port` over the model in `model_dir`.

    Yields (base URL, base model name for clients). The API process starts the engine through
    `uv run`, repeating its own `uv run` flags; the server's database and checkpoints go to a
    temporary directory that is removed with it.
    """
    venv, model_dir = Path(venv).resolve(), Path(model_dir).resolve()
    base_model = str(model_dir)
    backend_config = {"max_lora_adapters": max_lora_adapters, "max_lora_rank": max_lora_rank}
    env = {
        **os.environ,
        "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
        "UV_OFFLINE": "1",
        "JAX_PLATFORMS": "cpu",
        "HF_HUB_OFFLINE": "1",
    }
    with tempfile.TemporaryDirectory(prefix="skyrl-server-") as workdir:
        command = [
            str(venv / "bin" / "uv"), "run", "--no-project", "--python", str(venv / "bin" / "python"),
            "-m", "skyrl.tinker.api",
            "--host", "127.0.0.1", "--port", str(port),
            "--base-model", base_model,
            "--backend", "jax",
            "--backend-config", json.dumps(backend_config),
            "--database-url", f"sqlite:///{workdir}/tinker.db",
            "--checkpoints-base", f"{workdir}/checkpoints",
        ]  # fmt: skip
        log = open(Path(workdir) / "server.log", "wb")  # noqa: SIM115 - lives as long as the server
        server = subprocess.Popen(command, env=env, cwd=workdir, stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True)  # fmt: skip
        try:
            url = f"http://127.0.0.1:{port}"
            wait_until_healthy(f"{url}/api/v1/healthz", server, STARTUP_TIMEOUT_S)
            yield url, base_model
        except BaseException:
            log.flush()
            sys.stderr.write((Path(workdir) / "server.log").read_text(errors="replace")[-4000:])
            raise
        finally:
            stop(server)
            log.close()


def stop(server: subprocess.Popen) -> None:
    """Stops the server's process group (API, `uv` and engine), with SIGKILL if SIGTERM is not enough."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.pid, signal.SIGTERM)
    try:
        server.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGKILL)
        server.wait()


def sample_in(python: Path, url: str, base_model: str, prompts: int, max_tokens: int, rank: int) -> dict:
    """Runs `serve_loop.py sample` with `python`, whose `tinker` SDK may differ from this one's."""
    loop = Path(__file__).with_name("serve_loop.py")
    command = [str(python), str(loop), "sample", url, base_model, "--prompts", str(prompts),
               "--max-tokens", str(max_tokens), "--rank", str(rank)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1]}
    return json.loads(done.stdout)


def main(argv: list[str] | None = None) -> None:
    """Measures SkyRL's server with `bench/serve_loop.py`: a fresh server per adapter count, then sampling."""
    if __package__ in (None, ""):
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from bench.serve_loop import run_loop

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--venv", type=Path, default=Path.home() / ".cache" / "podtrain" / "skyrl-venv")
    parser.add_argument("--adapters", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    sdk_help = "a Python with the tinker SDK to sample with: SkyRL's sampling answers only SDKs before 0.26"
    parser.add_argument("--sample-python", type=Path, default=Path(sys.executable), help=sdk_help)
    args = parser.parse_args(argv)
    venv = ensure_skyrl_venv(args.venv)
    results = {}
    # The base model's name is its path, and the SDK reads a name with exactly two slashes (such as
    # /tmp/model) as "org/model/variant" when it looks for the tokenizer; this one has three.
    with tempfile.TemporaryDirectory(prefix="skyrl-bench-") as tmp:
        model_dir = make_qwen3_dir(Path(tmp) / "qwen3-tiny")
        for adapters in args.adapters:
            # Adapter slot 0 is SkyRL's base model, so `adapters` clients need one slot more.
            server = skyrl_server(venv, model_dir, free_port(), max_lora_adapters=adapters + 1, max_lora_rank=args.rank)
            with server as (url, base_model):
                results[f"train_adapters_{adapters}"] = run_loop(
                    url, base_model, adapters=adapters, steps=args.steps, warmup=args.warmup, rank=args.rank
                )
            print(json.dumps(results[f"train_adapters_{adapters}"]), file=sys.stderr, flush=True)
        with skyrl_server(venv, model_dir, free_port(), max_lora_adapters=2, max_lora_rank=args.rank) as server:
            results["sample"] = sample_in(args.sample_python, *server, args.prompts, args.max_tokens, args.rank)
    json.dump(results, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
