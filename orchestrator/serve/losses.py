"""The service's losses, as Tinker defines them: each is a sum over a datum's tokens of an
elementwise loss of the target tokens' logprobs under the adapter (`lp`) and the datum's inputs.

- cross_entropy: `-w * lp` (inputs target_tokens, weights `w`, default 1);
- importance_sampling: `-r * A`, `r = exp(lp - q)` (target_tokens, logprobs `q`, advantages `A`);
- ppo: `-min(r * A, clip(r, lo, hi) * A)` (as above; clip_low_threshold 0.8, clip_high_threshold 1.2);
- cispo: `-sg(clip(r, lo, hi)) * lp * A` (as ppo; `sg` stops the gradient);
- dro: `-(lp * A - beta / 2 * (lp - q)^2)` (as above; beta 0.05).

One compiled step serves every loss: each row carries its loss's index and config values, and
every row's loss is picked from all of them (`engine.token_losses`). This module is the losses'
specification without JAX, which the front end checks requests against.
"""

from __future__ import annotations

from podtrain.orchestrator.serve.work import ServeError

NAMES = ("cross_entropy", "importance_sampling", "ppo", "cispo", "dro")
RL_INPUTS = ("target_tokens", "logprobs", "advantages")
REQUIRED = {"cross_entropy": ("target_tokens",), **{name: RL_INPUTS for name in NAMES[1:]}}
OPTIONAL = {"cross_entropy": ("weights",), **{name: ("weights",) for name in NAMES[1:]}}
DEFAULTS = {"cross_entropy": {}, "importance_sampling": {},
            "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
            "cispo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}, "dro": {"beta": 0.05}}
# Tinker losses the service does not compute.
UNSUPPORTED = ("gspo", "stable_reinforce", "custom")


def loss_config(loss_fn: str, given: dict | None) -> dict[str, float]:
    """The loss's config: its defaults updated with `given`; ServeError naming what is wrong."""
    if loss_fn in UNSUPPORTED:
        raise ServeError(f"loss_fn: {loss_fn!r} is not supported by podtrain serve; expected one of {list(NAMES)} "
                         "(forward_backward_custom computes any other loss on the client)")
    if loss_fn not in NAMES:
        raise ServeError(f"loss_fn: expected one of {list(NAMES)}, found {loss_fn!r}")
    config = dict(DEFAULTS[loss_fn])
    for key, value in (given or {}).items():
        if key not in config:
            raise ServeError(f"loss_fn_config.{key}: {loss_fn} takes {sorted(config) or 'no config'}, found {key!r}")
        if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
            raise ServeError(f"loss_fn_config.{key}: expected a number, found {value!r}")
        config[key] = float(value)
    if "clip_low_threshold" in config and not 0 <= config["clip_low_threshold"] <= config["clip_high_threshold"]:
        raise ServeError("loss_fn_config: expected 0 <= clip_low_threshold <= clip_high_threshold, found "
                         f"{config['clip_low_threshold']} and {config['clip_high_threshold']}")
    if config.get("beta", 0.0) < 0:
        raise ServeError(f"loss_fn_config.beta: expected a number >= 0, found {config['beta']}")
    return config
