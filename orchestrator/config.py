"""The typed config: schema dataclasses, preset YAML + `key=value` overrides, one validation pass.

`load_config("llama3-tiny", ["model.num_layers=4"])` merges the schema defaults, the preset
file and the overrides (in that order) and returns a frozen `Config`. Every mistake in user input
raises `ConfigError` with one line that names the key or file, what was expected and what was found.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import typing
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from models.config import ModelConfig
from sharding.mesh import resolve_axis_sizes
from sharding.rules import DEFAULT_RULES, check_rules, logical_to_spec, sharded_over

CONFIG_DIR = Path(os.environ.get("PODTRAIN_CONFIG_DIR", Path(__file__).resolve().parent.parent / "configs"))


class ConfigError(ValueError):
    """A mistake in a preset file or an override; the message is meant for the user as is."""


def checkpoint_directory(directory: str, run_dir: str | os.PathLike) -> str:
    """`checkpoint.dir` as Orbax takes it: a URL (gs://...) as is, an absolute path as is, a relative
    path under `run_dir`."""
    if "://" in directory:
        return directory
    return os.path.abspath(Path(run_dir) / Path(directory).expanduser())


@dataclass(frozen=True)
class MeshConfig:
    """Mesh axis sizes; exactly one may be -1 (= the devices that remain)."""

    dp: int = 1
    fsdp: int = -1
    ep: int = 1
    tp: int = 1


@dataclass(frozen=True)
class ShardingConfig:
    """`rules` maps each logical axis name to a mesh axis, a list of mesh axes, or null."""

    rules: dict[str, Any] = field(default_factory=lambda: dict(DEFAULT_RULES))


OPTIMIZERS = ("adamw", "sgd", "adafactor")
SCHEDULES = ("constant", "cosine", "linear")


@dataclass(frozen=True)
class OptimizerConfig:
    """Optimizer (adamw, sgd with momentum, adafactor) and learning-rate schedule (constant, or
    `warmup_steps` of linear warmup then cosine or linear decay to `learning_rate * min_lr_ratio`).
    Gradients are clipped to a global norm of `grad_clip` first (0: no clipping)."""

    name: str = "adamw"
    schedule: str = "cosine"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1
    momentum: float = 0.9
    learning_rate: float = 3e-4
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    grad_clip: float = 1.0


@dataclass(frozen=True)
class TrainConfig:
    """Batch geometry and seed; `loss_chunk` > 0 computes the loss over sequence chunks of that
    length without materialising the full logits (it must divide `seq_len`).

    `compilation_cache_dir` is JAX's persistent compilation cache (relative to the run directory
    unless absolute; empty turns it off): a restarted or resumed run loads its compiled step
    instead of compiling it again. `JAX_COMPILATION_CACHE_DIR` in the environment takes precedence.

    Every `eval_every` steps the loop computes the loss of `eval_batches` eval batches and, when
    `sample_prompt` is set, greedily continues that prompt by up to `sample_tokens` tokens with the
    current params (logged, and written to metrics.jsonl as "sample").
    """

    seed: int = 0
    batch_size: int = 8
    seq_len: int = 256
    steps: int = 100
    loss_chunk: int = 0
    grad_accum: int = 1
    eval_every: int = 0
    eval_batches: int = 4
    sample_prompt: str | None = None
    sample_tokens: int = 32
    peak_flops_per_device: float = 0.0
    compilation_cache_dir: str = "compilation_cache"


DATA_SOURCES = ("stdlib", "text", "jsonl", "parquet", "array_record", "tokens")
DOCUMENT_MODES = ("auto", "file", "paragraphs", "windows")


@dataclass(frozen=True)
class DataConfig:
    """Where the documents come from and how they are tokenised, split, shuffled and read.

    Attributes:
        source: "stdlib" (the running Python's standard library `*.py` files; needs no path), "text"
            (UTF-8 text files, cut into documents as `documents` says), "jsonl" (one per line),
            "parquet" (one per row), "array_record" (one UTF-8 document per record) or "tokens"
            (`.npy` arrays of pre-tokenised ids, 1-D or one stream per row of a 2-D array, cut into
            rows of seq_len+1 ids; a document ends at each occurrence of the tokeniser's EOS id,
            `eos_token`). A file that is not UTF-8 text is an error naming it (the "stdlib" source
            alone reads undecodable bytes as U+FFFD: a few of its test files use other encodings).
        path: a file, a directory (searched recursively for the source's suffix, hidden entries
            skipped; any file for "text") or a glob.
        documents: how "text" files become documents: "file" (one per file), "paragraphs" (cut at
            blank lines, i.e. empty or whitespace-only ones), "windows" (pieces of at most
            `window_bytes` bytes, each ending after its last newline, else at a character boundary)
            or "auto": a corpus of one file is cut into paragraphs when it has more than one, else
            into windows; a corpus of several files has one document per file.
        window_bytes: the longest piece of `documents="windows"`, in bytes (at least 4, the longest
            UTF-8 character).
        text_field: the JSON key ("jsonl") or column ("parquet") holding the text.
        tokenizer: "byte" (`ByteTokenizer`, vocabulary 259) or a `tokenizer.json` path.
        eos_token: the EOS token of a `tokenizer.json` tokeniser (e.g. "<|end_of_text|>").
        bos_token: its BOS token; required with `add_bos`.
        add_bos: start every text document with BOS.
        seed: the seed of the per-epoch document shuffle (>= 0).
        eval_fraction: the share of documents held out for eval, spread evenly over the corpus order;
            0 holds none out (no evals). An eval split of fewer documents than `train.batch_size`
            rows is shared by the rows (row r reads eval document r mod n).
        epochs: passes over the training documents; None repeats forever.
        read_threads: threads reading and tokenising documents in parallel (0: the prefetch thread does it).
        prefetch: batches prepared ahead on a background thread (0: on the caller's thread).
    """

    source: str = "stdlib"
    path: str | None = None
    documents: str = "auto"
    window_bytes: int = 4096
    text_field: str = "text"
    tokenizer: str = "byte"
    eos_token: str | None = None
    bos_token: str | None = None
    add_bos: bool = False
    seed: int = 0
    eval_fraction: float = 0.01
    epochs: int | None = None
    read_threads: int = 0
    prefetch: int = 2

    def validate(self, prefix: str = "data") -> None:
        """Raises ValueError naming the key when a field is out of range or fields contradict."""
        if self.source not in DATA_SOURCES:
            raise ValueError(f"{prefix}.source: expected one of {list(DATA_SOURCES)}, found {self.source!r}")
        if (self.path is None) != (self.source == "stdlib"):
            need = "no path" if self.source == "stdlib" else "a file, directory or glob"
            raise ValueError(f"{prefix}.path: {prefix}.source={self.source!r} takes {need}, found {self.path!r}")
        if self.documents not in DOCUMENT_MODES:
            raise ValueError(f"{prefix}.documents: expected one of {list(DOCUMENT_MODES)}, found {self.documents!r}")
        for name in ("documents", "window_bytes"):
            if self.source != "text" and getattr(self, name) != getattr(DataConfig, name):
                raise ValueError(f"{prefix}.{name}={getattr(self, name)!r}: only {prefix}.source='text' files are cut "
                                 f"into documents, {prefix}.source={self.source!r} has its own; unset {prefix}.{name}")
        if self.window_bytes < 4:
            raise ValueError(f"{prefix}.window_bytes: expected at least 4 bytes (the longest UTF-8 character), "
                             f"found {self.window_bytes}")
        if self.seed < 0:
            raise ValueError(f"{prefix}.seed: expected an integer >= 0, found {self.seed}")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ValueError(f"{prefix}.eval_fraction: expected a number in [0, 1), found {self.eval_fraction}")
        if self.epochs is not None and self.epochs <= 0:
            raise ValueError(f"{prefix}.epochs: expected a positive integer or null (forever), found {self.epochs}")
        for name in ("read_threads", "prefetch"):
            if getattr(self, name) < 0:
                raise ValueError(f"{prefix}.{name}: expected an integer >= 0, found {getattr(self, name)}")
        if self.tokenizer == "byte" and (self.eos_token or self.bos_token):
            raise ValueError(f"{prefix}.eos_token/bos_token: the byte tokenizer has fixed special tokens; unset them")
        if self.add_bos and self.source == "tokens":
            raise ValueError(f"{prefix}.add_bos: pre-tokenised data ({prefix}.source='tokens') is used as is; unset it")
        if self.add_bos and self.tokenizer != "byte" and self.bos_token is None:
            raise ValueError(f"{prefix}.bos_token: required with {prefix}.add_bos=true and a tokenizer.json tokenizer")


RESUME_MODES = ("auto", "none")


@dataclass(frozen=True)
class CheckpointConfig:
    """Where and how often to checkpoint, how many steps to keep, what to resume from.

    `dir` is relative to the run directory unless absolute. `resume` is `auto` (the newest step
    that restores, else a fresh start), `none` (a fresh start into an empty `dir`) or a step number.
    """

    dir: str = "checkpoints"
    every_steps: int = 1000
    keep: int = 3
    async_save: bool = True
    resume: str = "auto"

    def validate(self, prefix: str = "checkpoint") -> None:
        """Raises ValueError naming the key when a field is out of range."""
        for name in ("every_steps", "keep"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{prefix}.{name}: expected a positive integer, found {getattr(self, name)}")
        if self.resume not in RESUME_MODES and not self.resume.isdigit():
            raise ValueError(f"{prefix}.resume: expected 'auto', 'none' or a step number, found {self.resume!r}")


@dataclass(frozen=True)
class RunConfig:
    """Where a run writes: `<dir>/<name>` (name defaults to the preset's name)."""

    dir: str = "runs"
    name: str = ""


CLUSTER_KINDS = ("local", "tpu", "gpu", "none")


@dataclass(frozen=True)
class ClusterConfig:
    """Where the processes of a run go (`orchestrator/cluster/`); `cluster=<kind>` sets `kind`.

    - `local`: `num_hosts` simulated hosts on this machine, each its own process with
      `devices_per_host` CPU devices (the default, and the test path).
    - `tpu`: `num_slices` whole pod slices of `tpu_type` (e.g. v5p-64), one process per TPU VM.
    - `gpu`: `num_nodes` nodes of `gpus_per_node` GPUs, one process per node owning all its GPUs.
    - `none`: no orchestrator: train in this process on its own devices (what each worker runs).

    `address` is the Ray cluster to use: empty means the one the job runs in (`ray job submit`,
    `RAY_ADDRESS`), or else an embedded Ray on loopback. Preemptions and lost nodes draw on
    `max_preemptions`, and so does a gang not reserved in time right after one of them (capacity
    coming back); crashes, exceptions, hangs and other reservation timeouts on `max_failures`
    (details in `orchestrator/cluster/driver.py`). A process that finishes no
    step for `hang_timeout_s` (`startup_timeout_s` before its first step, which compiles) is hung.
    """

    kind: str = "local"
    address: str = ""
    num_hosts: int = 1
    devices_per_host: int = 1
    tpu_type: str = ""
    tpu_topology: str = ""
    num_slices: int = 1
    num_nodes: int = 1
    gpus_per_node: int = 8
    cpus_per_host: float = 1.0
    max_failures: int = 3
    max_preemptions: int = 100
    hang_timeout_s: float = 600.0
    startup_timeout_s: float = 1800.0
    stop_grace_s: float = 120.0
    reserve_timeout_s: float = 600.0
    init_timeout_s: int = 300
    heartbeat_timeout_s: int = 100
    coordinator_port: int = 0
    env: dict[str, str] = field(default_factory=dict)

    def validate(self, prefix: str = "cluster") -> None:
        """Raises ValueError naming the key when a field is out of range."""
        if self.kind not in CLUSTER_KINDS:
            raise ValueError(f"{prefix}.kind: expected one of {list(CLUSTER_KINDS)}, found {self.kind!r}")
        for name in ("num_hosts", "devices_per_host", "num_slices", "num_nodes", "gpus_per_node"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{prefix}.{name}: expected a positive integer, found {getattr(self, name)}")
        for name in ("max_failures", "max_preemptions", "coordinator_port"):
            if getattr(self, name) < 0:
                raise ValueError(f"{prefix}.{name}: expected an integer >= 0, found {getattr(self, name)}")
        for name in ("hang_timeout_s", "startup_timeout_s", "stop_grace_s", "reserve_timeout_s", "init_timeout_s",
                     "heartbeat_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{prefix}.{name}: expected a positive number of seconds, found {getattr(self, name)}")
        if self.kind == "tpu":
            version, _, chips = self.tpu_type.partition("-")
            if not (version.startswith("v") and chips.isdigit()):
                raise ValueError(f"{prefix}.tpu_type: expected a TPU type such as 'v5p-64' or 'v6e-16', "
                                 f"found {self.tpu_type!r}")


@dataclass(frozen=True)
class Config:
    """Everything a run needs, as plain data (runtime objects are built from it, never stored in it)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    sharding: ShardingConfig = field(default_factory=ShardingConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    run: RunConfig = field(default_factory=RunConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)


def list_presets() -> list[str]:
    return sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))


def resolve_preset(preset: str) -> Path:
    """A preset name (`configs/<name>.yaml`) or a path to a YAML file."""
    path = Path(preset)
    if path.suffix in (".yaml", ".yml") or os.sep in preset:
        if path.is_dir():
            raise ConfigError(f"-c {preset}: is a directory; expected a preset name or a YAML file")
        if not path.is_file():
            raise ConfigError(f"config file {preset}: not found")
        return path
    path = CONFIG_DIR / f"{preset}.yaml"
    if not path.is_file():
        if Path(preset).is_dir():
            raise ConfigError(f"-c {preset}: is a directory, not a preset in {CONFIG_DIR}; expected a preset name "
                              "or a YAML file")
        near = difflib.get_close_matches(preset, list_presets(), n=1)
        hint = f"; did you mean {near[0]!r}?" if near else ""
        raise ConfigError(f"-c {preset}: no such preset in {CONFIG_DIR} (available: {', '.join(list_presets())}){hint}")
    return path


def _schema_keys(cls, prefix: str = "") -> dict[str, Any]:
    """Every full key of the schema with its declared type; Dict fields accept any sub-key."""
    keys = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key, tp = f"{prefix}{f.name}", hints[f.name]
        keys[key] = tp
        if dataclasses.is_dataclass(tp):
            keys.update(_schema_keys(tp, key + "."))
    return keys


def _initials(name: str) -> str:
    return "".join(part[0] for part in name.split("_") if part)


def _leaf_score(leaf: str, candidate: str) -> float:
    """How likely the last part `leaf` of a mistyped key means `candidate`'s last part (0 to 1)."""
    name = candidate.rpartition(".")[2]
    if "_" in name and len(leaf) > 1 and leaf == _initials(name):  # lr -> learning_rate
        return 1.0
    if name.startswith(leaf + "_"):  # warmup -> warmup_steps
        return 0.9
    return difflib.SequenceMatcher(None, leaf, name).ratio()


def closest_key(key: str, candidates: Iterable[str]) -> str | None:
    """The candidate that a mistyped `key` most likely means, or None when none is close.

    The last part of `key` is matched (by spelling, by the initials of a name's parts or as its
    first part) against the keys of its own section first (`optimizer.lr` ->
    `optimizer.learning_rate`), then against the keys of the other sections (`train.learning_rate`
    -> `optimizer.learning_rate`); then `key` is matched as a whole (`model.rope_theta` ->
    `model.rope.theta`).
    """
    candidates = list(candidates)
    parent, _, leaf = key.rpartition(".")
    scored = [(_leaf_score(leaf, c), c) for c in candidates]
    siblings = [(score, c) for score, c in scored if c.rpartition(".")[0] == parent and score >= 0.6]
    if siblings:
        return max(siblings)[1]
    others = [(score, difflib.SequenceMatcher(None, parent, c.rpartition(".")[0]).ratio(), c)
              for score, c in scored if score >= 0.8]
    if others:
        return max(others)[2]
    near = difflib.get_close_matches(key, candidates, n=1, cutoff=0.8)
    return near[0] if near else None


def _check_key(key: str, keys: dict[str, Any], where: str, hint_keys: Iterable[str] = ()) -> None:
    if key in keys:
        return
    parent = key.rsplit(".", 1)[0] if "." in key else ""
    if typing.get_origin(keys.get(parent)) is dict:
        return
    near = closest_key(key, [*keys, *hint_keys])
    hint = f"; did you mean {near!r}?" if near else ""
    raise ConfigError(f"{where}: unknown key {key!r}{hint}")


def flatten_keys(tree: dict, prefix: str = "") -> dict[str, Any]:
    """Nested dicts as one level of dotted keys ({"moe": {"top_k": 8}} -> {"moe.top_k": 8}).

    An empty dict stays a value, and so does `sharding.rules` (its keys are logical axis
    names, not config keys)."""
    out = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v and not key.startswith("sharding.rules"):
            out.update(flatten_keys(v, key + "."))
        else:
            out[key] = v
    return out


def _type_name(tp) -> str:
    return getattr(tp, "__name__", str(tp))


def _merge(base, layer: dict, keys: dict[str, Any], where: str, hint_keys: Iterable[str] = ()):
    for key, value in flatten_keys(layer).items():
        _check_key(key, keys, where, hint_keys)
        tp = keys.get(key)
        if (dataclasses.is_dataclass(tp) or typing.get_origin(tp) is dict) and not isinstance(value, dict):
            example = next((k for k in keys if k.startswith(key + ".")), f"{key}.<name>")
            raise ConfigError(f"{where}: key {key!r} is a section: expected a mapping of its keys "
                              f"(such as {example!r}), found {value!r}")
    try:
        return OmegaConf.merge(base, OmegaConf.create(layer))
    except ConfigKeyError as e:
        raise ConfigError(f"{where}: unknown key {e.full_key!r}") from None
    except OmegaConfBaseException as e:
        expected = _type_name(keys.get(e.full_key, getattr(e, "ref_type_str", None) or "another type"))
        raise ConfigError(f"{where}: key {e.full_key!r} expects {expected}, found {getattr(e, 'value', None)!r}"
                          ) from None


def parse_overrides(overrides: list[str]) -> dict:
    """`["a.b=1", "c=x"]` -> nested dict; values parsed as YAML. A key given twice is an error."""
    nested: dict = {}
    seen = set()
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"override {item!r}: expected key=value")
        if key == "cluster":  # `cluster=tpu` is short for `cluster.kind=tpu`
            key = "cluster.kind"
        if key in seen:
            raise ConfigError(f"override {key!r} is given twice; give each key once")
        seen.add(key)
        try:
            value = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError:
            value = raw
        node = nested
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {key!r} conflicts with another override of {part!r}")
        node[leaf] = value
    return nested


def override_keys(overrides: list[str]) -> list[str]:
    """The dotted keys `overrides` set, as `load_config` applies them (`model={dtype: bfloat16}`
    sets `model.dtype`, `cluster=tpu` sets `cluster.kind`)."""
    return list(flatten_keys(parse_overrides(list(overrides))))


def _yaml_problem(e: yaml.YAMLError) -> str:
    """A parser error in one line: where it is and what the parser found."""
    if not isinstance(e, yaml.MarkedYAMLError) or e.problem_mark is None:
        return ": " + " ".join(str(e).split())
    mark, start = e.problem_mark, e.context_mark
    context = ""
    if e.context:
        context = f" ({e.context} at line {start.line + 1}, column {start.column + 1})" if start else f" ({e.context})"
    return f" at line {mark.line + 1}, column {mark.column + 1}: {e.problem}{context}"


def load_config(preset: str | None, overrides: list[str] = (), *, hint_keys: Iterable[str] = ()) -> Config:
    """Schema defaults, then the preset YAML, then the overrides; then `validate` (without devices).

    `hint_keys` are a command's own `key=` arguments (taken out of the overrides before): an unknown
    key may be suggested as one of them.
    """
    keys = _schema_keys(Config)
    merged = OmegaConf.structured(Config)
    if preset is not None:
        path = resolve_preset(preset)
        try:
            layer = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path}: not valid YAML{_yaml_problem(e)}") from None
        if not isinstance(layer, dict):
            raise ConfigError(f"config file {path}: expected a mapping of keys, found {type(layer).__name__}")
        merged = _merge(merged, layer, keys, f"config file {path}")
    merged = _merge(merged, parse_overrides(list(overrides)), keys, "override", hint_keys)
    config = OmegaConf.to_object(merged)
    validate(config)
    return config


def validate(config: Config, num_devices: int | None = None) -> dict[str, int] | None:
    """Cross-field rules; with `num_devices`, also the mesh against the devices present.

    Returns:
        The resolved mesh axis sizes when `num_devices` is given.
    """
    try:
        config.model.validate()
        config.data.validate()
        config.checkpoint.validate()
        config.cluster.validate()
        check_rules(config.sharding.rules)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    m, mesh = config.model, config.mesh
    if mesh.tp > 0:
        for name in ("num_heads", "num_kv_heads"):
            if getattr(m, name) % mesh.tp:
                raise ConfigError(
                    f"model.{name}={getattr(m, name)} is not divisible by mesh.tp={mesh.tp}; "
                    f"choose mesh.tp dividing {getattr(m, name)}"
                )
    train = config.train
    for name in ("batch_size", "seq_len", "steps", "sample_tokens", "eval_batches"):
        if getattr(train, name) <= 0:
            raise ConfigError(f"train.{name}: expected a positive integer, found {getattr(train, name)}")
    if train.eval_every < 0:
        raise ConfigError(f"train.eval_every: expected a number of steps >= 0 (0: no evals), found {train.eval_every}")
    if not 0 <= train.seed < 2**63:
        raise ConfigError(f"train.seed: expected an integer in [0, 2**63), found {train.seed}")
    if not train.peak_flops_per_device >= 0:
        raise ConfigError(f"train.peak_flops_per_device: expected FLOP/s > 0, or 0 to look the device kind up, "
                          f"found {train.peak_flops_per_device}")
    if train.seq_len > m.max_position_embeddings:
        raise ConfigError(f"train.seq_len={train.seq_len} is longer than model.max_position_embeddings="
                          f"{m.max_position_embeddings}, the positions the model is made for; raise "
                          "model.max_position_embeddings (and its RoPE scaling) to train longer sequences")
    if train.sample_prompt == "":
        raise ConfigError("train.sample_prompt: expected a non-empty prompt or null (no samples), found ''")
    if train.sample_prompt and not train.eval_every:
        raise ConfigError("train.sample_prompt: samples are taken at evals, but train.eval_every=0; "
                          "set train.eval_every > 0 or unset train.sample_prompt")
    opt = config.optimizer
    for name, value, valid in (("name", opt.name, OPTIMIZERS), ("schedule", opt.schedule, SCHEDULES)):
        if value not in valid:
            raise ConfigError(f"optimizer.{name}: expected one of {list(valid)}, found {value!r}")
    for name in ("learning_rate", "eps"):
        if not getattr(opt, name) > 0:
            raise ConfigError(f"optimizer.{name}: expected a number > 0, found {getattr(opt, name)}")
    if not opt.weight_decay >= 0:
        raise ConfigError(f"optimizer.weight_decay: expected a number >= 0 (0: no decay), found {opt.weight_decay}")
    if not 0 <= opt.min_lr_ratio <= 1:
        raise ConfigError(f"optimizer.min_lr_ratio: expected the final share of optimizer.learning_rate, in [0, 1], "
                          f"found {opt.min_lr_ratio}")
    for name in ("b1", "b2", "momentum"):
        if not 0 <= getattr(opt, name) < 1:
            raise ConfigError(f"optimizer.{name}: expected a decay rate in [0, 1), found {getattr(opt, name)}")
    if opt.grad_clip < 0:
        raise ConfigError(f"optimizer.grad_clip: expected a global gradient norm > 0, or 0 for no clipping, "
                          f"found {opt.grad_clip}")
    if opt.warmup_steps < 0 or opt.warmup_steps > config.train.steps:
        raise ConfigError(f"optimizer.warmup_steps={opt.warmup_steps} must be in [0, train.steps={config.train.steps}]")
    accum = config.train.grad_accum
    if accum < 1 or config.train.batch_size % accum:
        raise ConfigError(
            f"train.grad_accum={accum} must be >= 1 and divide train.batch_size={config.train.batch_size}"
        )
    chunk = config.train.loss_chunk
    if chunk < 0 or (chunk and config.train.seq_len % chunk):
        raise ConfigError(f"train.loss_chunk={chunk} must be 0 (off) or divide train.seq_len={config.train.seq_len}")
    if num_devices is None:
        return None
    try:
        sizes = resolve_axis_sizes(dataclasses.asdict(mesh), num_devices)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    try:
        logical_to_spec(("batch",), sizes, shape=(config.train.batch_size,), rules=config.sharding.rules,
                        what="train.batch_size")
        if config.train.grad_accum > 1:  # each micro-batch is sharded as the batch is
            micro = config.train.batch_size // config.train.grad_accum
            logical_to_spec(("batch",), sizes, shape=(micro,), rules=config.sharding.rules,
                            what=f"the micro-batch of train.batch_size / train.grad_accum={config.train.grad_accum}")
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if m.model_type == "deepseek_v3" and m.num_moe_layers:
        axes, shards = sharded_over(("experts",), sizes, config.sharding.rules)
        token_axes, _ = sharded_over(("batch", "seq"), sizes, config.sharding.rules)
        if len(axes) > 1 or not set(axes) <= set(token_axes):
            raise ConfigError(
                f"sharding.rules: experts are sharded over {list(axes)}; expected one mesh axis that the tokens "
                f"('batch' or 'seq' rules, now over {list(token_axes)}) are sharded over too"
            )
        if m.moe.num_experts % shards:
            raise ConfigError(
                f"model.moe.num_experts={m.moe.num_experts} is not divisible by the {shards} expert shards "
                f"(mesh axes {list(axes)}); choose mesh.ep dividing {m.moe.num_experts}"
            )
    return sizes


def to_yaml(config: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(config))
