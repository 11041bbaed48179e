"""The typed config schema: one frozen dataclass per section; a section with rules of its own
checks them (`validate`).

`config.compose` merges these with a preset and the command line's overrides, and `config.validate`
checks what spans sections; the schema itself holds data only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from podtrain.models.config import ModelConfig
from podtrain.models.generate import Sampling
from podtrain.models.lora import LoRAConfig
from podtrain.orchestrator.config.cluster import ClusterConfig
from podtrain.orchestrator.config.serve import ServeConfig
from podtrain.orchestrator.config.trackers import MetricsConfig, MlflowConfig, WandbConfig  # noqa: F401 (the schema's)
from podtrain.sharding.rules import DEFAULT_RULES, check_rules


@dataclass(frozen=True)
class MeshConfig:
    """Mesh axis sizes; exactly one may be -1 (= the devices that remain)."""

    dp: int = 1
    fsdp: int = -1
    ep: int = 1
    cp: int = 1  # context parallelism: each sequence split over this many devices
    tp: int = 1


@dataclass(frozen=True)
class ShardingConfig:
    """`rules` maps each logical axis name to a mesh axis, a list of mesh axes, or null."""

    rules: dict[str, Any] = field(default_factory=lambda: dict(DEFAULT_RULES))

    def validate(self, prefix: str = "sharding") -> None:
        check_rules(self.rules, f"{prefix}.rules")


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

    def validate(self, prefix: str = "optimizer") -> None:
        """Raises ValueError naming the key when a field is out of range."""
        for name, value, valid in (("name", self.name, OPTIMIZERS), ("schedule", self.schedule, SCHEDULES)):
            if value not in valid:
                raise ValueError(f"{prefix}.{name}: expected one of {list(valid)}, found {value!r}")
        for name in ("learning_rate", "eps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{prefix}.{name}: expected a number > 0, found {getattr(self, name)}")
        if not self.weight_decay >= 0:
            raise ValueError(f"{prefix}.weight_decay: expected a number >= 0 (0: no decay), found {self.weight_decay}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"{prefix}.min_lr_ratio: expected the final share of {prefix}.learning_rate, in [0, 1], "
                             f"found {self.min_lr_ratio}")
        for name in ("b1", "b2", "momentum"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{prefix}.{name}: expected a decay rate in [0, 1), found {getattr(self, name)}")
        if self.grad_clip < 0:
            raise ValueError(f"{prefix}.grad_clip: expected a global gradient norm > 0, or 0 for no clipping, "
                             f"found {self.grad_clip}")


@dataclass(frozen=True)
class TrainConfig:
    """Batch geometry and seed; `loss_chunk` > 0 computes the loss without materialising the full
    logits, over `seq_len / loss_chunk` vocabulary slices each as large as the logits of
    `loss_chunk` positions (it must divide `seq_len`).

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

    def validate(self, prefix: str = "train") -> None:
        """Raises ValueError naming the key when a field is out of range."""
        for name in ("batch_size", "seq_len", "steps", "sample_tokens", "eval_batches"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{prefix}.{name}: expected a positive integer, found {getattr(self, name)}")
        if self.eval_every < 0:
            raise ValueError(f"{prefix}.eval_every: expected a number of steps >= 0 (0: no evals), "
                             f"found {self.eval_every}")
        if not 0 <= self.seed < 2**63:
            raise ValueError(f"{prefix}.seed: expected an integer in [0, 2**63), found {self.seed}")
        if not self.peak_flops_per_device >= 0:
            raise ValueError(f"{prefix}.peak_flops_per_device: expected FLOP/s > 0, or 0 to look the device kind up, "
                             f"found {self.peak_flops_per_device}")
        if self.sample_prompt == "":
            raise ValueError(f"{prefix}.sample_prompt: expected a non-empty prompt or null (no samples), found ''")
        if self.sample_prompt and not self.eval_every:
            raise ValueError(f"{prefix}.sample_prompt: samples are taken at evals, but {prefix}.eval_every=0; "
                             f"set {prefix}.eval_every > 0 or unset {prefix}.sample_prompt")
        if self.grad_accum < 1 or self.batch_size % self.grad_accum:
            raise ValueError(f"{prefix}.grad_accum={self.grad_accum} must be >= 1 and divide "
                             f"{prefix}.batch_size={self.batch_size}")
        if self.loss_chunk < 0 or (self.loss_chunk and self.seq_len % self.loss_chunk):
            raise ValueError(f"{prefix}.loss_chunk={self.loss_chunk} must be 0 (off) or divide "
                             f"{prefix}.seq_len={self.seq_len}")


DATA_SOURCES = ("stdlib", "text", "jsonl", "parquet", "array_record", "tokens", "chat")
LOSS_ON = ("assistant", "all", "last_assistant")
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
            `eos_token`) or "chat" (JSONL or Parquet rows of `messages`, or `prompt` and `completion`,
            rendered with the chat template and packed whole: see `data.chat`). A file that is not UTF-8 text is
            an error naming it (the "stdlib" source
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
        tokenizer: "byte" (`ByteTokenizer`, vocabulary 259) or a `tokenizer.json` path (or its directory).
        chat_template: a Jinja chat template file for "chat" rows, instead of the tokenizer's own.
        loss_on: which tokens the loss trains on: "all", or for "chat" rows "assistant" (the default
            there: every assistant turn) or "last_assistant"; None: the default of the source.
        packing: pack several "chat" rows into one row of seq_len tokens (false: one conversation a
            row, the rest padding).
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
    chat_template: str | None = None
    loss_on: str | None = None
    packing: bool = True
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
        if self.loss_on is not None and self.loss_on not in LOSS_ON:
            raise ValueError(f"{prefix}.loss_on: expected one of {list(LOSS_ON)}, found {self.loss_on!r}")
        if self.source != "chat" and self.loss_on not in (None, "all"):
            raise ValueError(f"{prefix}.loss_on={self.loss_on!r}: only {prefix}.source='chat' rows have turns to "
                             f"choose; {prefix}.source={self.source!r} trains on all tokens: unset it")
        if self.source != "chat" and self.chat_template is not None:
            raise ValueError(f"{prefix}.chat_template: only {prefix}.source='chat' rows are rendered with a template, "
                             f"found {prefix}.source={self.source!r}: unset it or set {prefix}.source=chat")
        if not self.packing and self.source != "chat":
            raise ValueError(f"{prefix}.packing=false: only {prefix}.source='chat' rows can go one to a row; "
                             f"{prefix}.source={self.source!r} is packed: unset it")
        if self.add_bos and self.source == "chat":
            raise ValueError(f"{prefix}.add_bos: chat rows get BOS from the chat template ({prefix}.source='chat'); "
                             "unset it")
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
    `host_gb` > 0 bounds how many GB of the state a save or a restore holds in host memory at once
    (0: Orbax's defaults: a save stages the whole of this host's part, a restore reads up to 96 GB
    at once). An array moves whole, so the bound is at least the largest array's part.
    """

    dir: str = "checkpoints"
    every_steps: int = 1000
    keep: int = 3
    async_save: bool = True
    resume: str = "auto"
    host_gb: int = 0

    def validate(self, prefix: str = "checkpoint") -> None:
        """Raises ValueError naming the key when a field is out of range."""
        for name in ("every_steps", "keep"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{prefix}.{name}: expected a positive integer, found {getattr(self, name)}")
        if self.host_gb < 0:
            raise ValueError(f"{prefix}.host_gb: expected 0 (no bound) or a positive number of GB, "
                             f"found {self.host_gb}")
        if self.resume not in RESUME_MODES and not self.resume.isdigit():
            raise ValueError(f"{prefix}.resume: expected 'auto', 'none' or a step number, found {self.resume!r}")


@dataclass(frozen=True)
class RunConfig:
    """Where a run writes: `<dir>/<name>` (name defaults to the preset's name)."""

    dir: str = "runs"
    name: str = ""


@dataclass(frozen=True)
class PlanConfig:
    """What `podtrain plan --target` and the check before a launch do.

    With `check_before_launch`, `podtrain train` and `podtrain submit` of `cluster.kind=tpu|gpu`
    compile the train step for the reservation's target (`cluster.tpu_type` x `cluster.num_slices`,
    or `cluster.num_nodes` nodes of `cluster.gpus_per_node` `cluster.gpu_type` GPUs) before anything
    is reserved, and refuse a step that does not fit the devices' memory. It needs the `aot` extra
    (without it the check is skipped with a warning), and is skipped when `cluster.env` sets
    JAX_PLATFORMS (the workers use other devices than the target's). When a step does not fit, at
    most `max_fit_compiles` changes are compiled to find one that does.
    """

    check_before_launch: bool = True
    max_fit_compiles: int = 6

    def validate(self, prefix: str = "plan") -> None:
        if self.max_fit_compiles < 0:
            raise ValueError(f"{prefix}.max_fit_compiles: expected a number of compiles >= 0, "
                             f"found {self.max_fit_compiles}")


@dataclass(frozen=True)
class GenerateConfig:
    """What `podtrain generate` continues, and how (its `checkpoint=`, `prompt=`, ... are short for these).

    Attributes:
        checkpoint: a podtrain run, checkpoint or step directory, or a Hugging Face directory.
        step: the checkpoint step to load (None: the newest committed one).
        adapter: a PEFT LoRA adapter directory to apply to the checkpoint's model.
        prompts: the texts to continue, batched into one `models.generate.generate` call.
        prompts_file: a text file adding one prompt per non-blank line.
        max_new_tokens: the most tokens generated per prompt.
        temperature, top_k, top_p: sampling, as `models.generate.Sampling` (temperature 0: greedy).
        seed: the sampling seed.
        stop: the token ids that end a sequence; None: the tokenizer's EOS ids; []: none.
    """

    checkpoint: str | None = None
    step: int | None = None
    adapter: str | None = None
    prompts: list[str] = field(default_factory=list)
    prompts_file: str | None = None
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop: list[int] | None = None

    def sampling(self) -> Sampling:
        """How `generate` picks each next token, from `temperature`, `top_k` and `top_p`."""
        return Sampling(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)

    def validate(self, prefix: str = "generate") -> None:
        """Raises ValueError naming the key when a field is out of range (the sampling fields as
        `Sampling.validate` checks them)."""
        if self.step is not None and self.step < 0:
            raise ValueError(f"{prefix}.step: expects a step number >= 0 or null (the newest), found {self.step}")
        if "" in self.prompts:
            raise ValueError(f"{prefix}.prompts: expects a non-empty prompt, found an empty one "
                             f"(prompt {self.prompts.index('') + 1} of {len(self.prompts)})")
        if self.max_new_tokens < 1:
            raise ValueError(f"{prefix}.max_new_tokens: expects a positive integer, found {self.max_new_tokens}")
        self.sampling().validate(prefix)
        if not -(2**63) <= self.seed < 2**63:
            raise ValueError(f"{prefix}.seed: expects an integer in [-2**63, 2**63), found {self.seed}")
        if self.stop is not None and any(token < 0 for token in self.stop):
            raise ValueError(f"{prefix}.stop: expects token ids >= 0, found {self.stop}")


@dataclass(frozen=True)
class ExportConfig:
    """What `podtrain export` writes (its `checkpoint=`, `out=` and `step=` are short for these).

    Attributes:
        checkpoint: a podtrain run, checkpoint or step directory.
        out: the new (or empty) directory the HF files go to.
        step: the checkpoint step to export (None: the newest committed one).
        adapter: for a LoRA run, write its adapters in the PEFT format (adapter_model.safetensors
            and adapter_config.json) instead of the base with the adapters merged into it.
    """

    checkpoint: str | None = None
    out: str | None = None
    step: int | None = None
    adapter: bool = False

    def validate(self, prefix: str = "export") -> None:
        """Raises ValueError naming the key when a field is out of range."""
        if self.step is not None and self.step < 0:
            raise ValueError(f"{prefix}.step: expects a step number >= 0 or null (the newest), found {self.step}")


@dataclass(frozen=True)
class Config:
    """Everything a run needs, as plain data (runtime objects are built from it, never stored in it)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    sharding: ShardingConfig = field(default_factory=ShardingConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    run: RunConfig = field(default_factory=RunConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    generate: GenerateConfig = field(default_factory=GenerateConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)
