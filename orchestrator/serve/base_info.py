"""What the service's clients see of its base model (`BaseInfo`), the same in the driver and on
every worker, and the tokenizer they load."""

from __future__ import annotations

from podtrain.orchestrator.common.errors import ConfigError
from podtrain.orchestrator.data.tokenizers import Tokenizer, checkpoint_tokenizer
from podtrain.orchestrator.serve.checks import slot_targets
from podtrain.orchestrator.serve.work import BaseInfo


def serve_info(config, eos_token_ids: tuple[int, ...] | None = None) -> tuple[BaseInfo, tuple[str, ...]]:
    """(what clients see of the base model, every adapter target the service holds) of a serve
    config; the same in the driver and on every worker. `eos_token_ids`: those of
    `service_tokenizer`, when the caller has loaded it already."""
    s, m = config.serve, config.model
    targets = slot_targets(m)
    eos = service_tokenizer(config)[1] if eos_token_ids is None else eos_token_ids
    info = BaseInfo(base_model=s.base_model, tokenizer_id=s.tokenizer or "", model_type=m.model_type,
                    vocab_size=m.vocab_size, max_seq_len=s.max_seq_len, max_rank=s.max_rank,
                    max_adapters=s.max_adapters, eos_token_ids=eos,
                    max_sample_tokens=s.sample_tokens(), max_live_adapters=s.live_adapters())
    return info, targets


def service_tokenizer(config) -> tuple[Tokenizer | None, tuple[int, ...]]:
    """(tokenizer, its EOS ids): the one clients load (an HF directory's), else `data.tokenizer`;
    (None, ()) if neither can be read."""
    try:
        tokenizer, stop, _ = checkpoint_tokenizer(config.serve.tokenizer or "", config.data)
    except ConfigError:
        return None, ()
    return tokenizer, tuple(int(i) for i in stop if i is not None)
