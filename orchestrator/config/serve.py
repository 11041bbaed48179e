"""The `serve` section of the config schema: `podtrain serve`'s service and engine."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServeConfig:
    """`podtrain serve`: a Tinker-API training service holding the base model once and up to
    `max_adapters` LoRA adapters, each batch row on its own adapter.

    Attributes:
        host, port: where the HTTP service listens (port 0: any free port, written to the run
            directory's `serve.json`). Any host but loopback needs an API key.
        api_key: the key clients send (`X-API-Key`); empty: the environment variable
            PODTRAIN_SERVE_API_KEY, else none (loopback only).
        base: the base model's HF directory (None: the preset's model made from `seed`).
        seed: the seed the base model's weights are drawn from when there is no `base`.
        base_model: the name clients ask for (empty: the HF directory's name, else the preset's).
        tokenizer: what clients load as the tokenizer (`get_info`): an HF id or directory (None:
            `base`).
        max_adapters: adapter slots on the base model (on the devices).
        max_live_adapters: how many adapters may be alive at once (None: `max_adapters`). Beyond
            the device slots, the least recently used adapters wait in host memory, then on disk,
            and are brought into a slot when a request names them (see docs/serve.md, "Paging").
        host_adapters: how many adapters wait in host memory; beyond them, the least recently used
            go to the run directory's disk (None: all of them stay in host memory).
        max_rank: the largest LoRA rank; smaller ranks are masked within it.
        lora_alpha: every adapter's `alpha` (its update is scaled by `lora_alpha / rank`).
        max_seq_len: the longest training row (and the context length clients are told).
        max_sample_tokens: the longest sampled sequence, prompt plus new tokens: the length of the
            sampling KV cache (None: `max_seq_len`).
        max_rows: the most rows in one engine step (longer requests run in several).
        compile_ahead: when a forward/backward batch first uses a padded token count, compile the
            step for that count's other padded row counts in the background, so that a batch of
            another row count does not wait for a compile (false: each shape compiles at first use).
        loss_chunk: the head is applied to a step's rows a vocabulary slice at a time (losses,
            logprobs, prompt logprobs), each slice's logits as large as those of `loss_chunk`
            positions, so no (rows, tokens, vocab) logits are made (0: the whole logits at once).
        max_request_bytes: the largest request body accepted.
        autosave_every: every this many optimizer steps of an adapter, its whole state (weights
            and Adam moments) is saved; a new engine (after a restart, or its workers lost)
            brings each adapter back from its last save (0: only the clients' `save_state`).
        session_timeout_s: a session with no heartbeat for this long ends (the SDK sends one every
            10 s): its adapters' unsaved steps are saved, its slots freed (0: sessions end only
            when their clients close them).
        result_ttl_s: a request's answer is kept this long after the client first retrieves it (or
            after it is made, if never retrieved); a retrieve after that is a 410.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str = ""
    base: str | None = None
    seed: int = 0
    base_model: str = ""
    tokenizer: str | None = None
    max_adapters: int = 8
    max_live_adapters: int | None = None
    host_adapters: int | None = None
    max_rank: int = 32
    lora_alpha: float = 32.0
    max_seq_len: int = 1024
    max_sample_tokens: int | None = None
    max_rows: int = 16
    compile_ahead: bool = True
    loss_chunk: int = 256
    max_request_bytes: int = 64 * 2**20
    autosave_every: int = 10
    session_timeout_s: float = 600.0
    result_ttl_s: float = 3600.0

    def live_adapters(self) -> int:
        """How many adapters may be alive at once."""
        return self.max_adapters if self.max_live_adapters is None else self.max_live_adapters

    def sample_tokens(self) -> int:
        """The longest sampled sequence (prompt plus new tokens)."""
        return self.max_seq_len if self.max_sample_tokens is None else self.max_sample_tokens

    def validate(self, prefix: str = "serve") -> None:
        """Raises ValueError naming the key when a field is out of range."""
        if not 0 <= self.seed < 2**63:
            raise ValueError(f"{prefix}.seed: expected an integer in [0, 2**63), found {self.seed}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"{prefix}.port: expected 0 (any free port) to 65535, found {self.port}")
        for key in ("max_adapters", "max_rank", "max_seq_len", "max_rows", "max_request_bytes", "max_sample_tokens"):
            if getattr(self, key) is not None and getattr(self, key) < 1:
                raise ValueError(f"{prefix}.{key}: expected a positive integer, found {getattr(self, key)}")
        if self.max_live_adapters is not None and self.max_live_adapters < self.max_adapters:
            raise ValueError(f"{prefix}.max_live_adapters: expected at least {prefix}.max_adapters "
                             f"({self.max_adapters}) or null, found {self.max_live_adapters}")
        if self.host_adapters is not None and self.host_adapters < 0:
            raise ValueError(f"{prefix}.host_adapters: expected 0 or more adapters (null: no limit), found "
                             f"{self.host_adapters}")
        if self.autosave_every < 0:
            raise ValueError(f"{prefix}.autosave_every: expected 0 (never) or a positive number of optimizer steps, "
                             f"found {self.autosave_every}")
        if self.session_timeout_s < 0:
            raise ValueError(f"{prefix}.session_timeout_s: expected 0 (never) or a number of seconds > 0, found "
                             f"{self.session_timeout_s}")
        if not self.result_ttl_s > 0:
            raise ValueError(f"{prefix}.result_ttl_s: expected a number of seconds > 0, found {self.result_ttl_s}")
        if self.loss_chunk < 0:
            raise ValueError(f"{prefix}.loss_chunk: expected 0 (the whole logits) or a positive number of positions, "
                             f"found {self.loss_chunk}")
        if not self.lora_alpha > 0:
            raise ValueError(f"{prefix}.lora_alpha: expected a number > 0, found {self.lora_alpha}")
