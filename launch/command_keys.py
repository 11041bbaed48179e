"""A command's short `key=value` arguments as overrides of its config section.

`podtrain generate checkpoint=X prompt=a` is `generate.checkpoint=X generate.prompts=[a]`: the
command rewrites its own keys before `load_config`, so that they go through the one override
system (its types, its checks, its one-line errors and hints; a key given twice is an error).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence

import yaml


def text_value(text: str) -> str:
    """`text` as an override value the config reads back as this exact string: YAML-quoted (so
    that `yes`, `123` or `a: b` stay text) and with OmegaConf's `${` escaped (no interpolation)."""
    escaped = re.sub(r"(\\*)\$\{", lambda match: match.group(1) * 2 + "\\${", text)
    return yaml.safe_dump(escaped, default_style='"', width=float("inf"), allow_unicode=True).rstrip("\n")


def texts_value(texts: Sequence[str]) -> str:
    """A list of texts as one override value, each read back as in `text_value`."""
    return "[" + ", ".join(text_value(text) for text in texts) + "]"


def command_overrides(overrides: Sequence[str], section: str, keys: Iterable[str], *,
                      convert: Mapping[str, Callable[[str], str]] | None = None,
                      collect: Mapping[str, str] | None = None) -> list[str]:
    """`overrides` with each `key=value` of a command key (`keys`) as `<section>.<key>=value`; the
    others (config overrides) stay as they are.

    `convert` maps a key to what turns its value into the override's (e.g. `text_value`; the
    others are read as YAML, as any override). A key of `collect` (`{"prompt": "prompts"}`) may be
    repeated: its values, taken as text, become one list override of the field it names.
    """
    keys, convert, collect = set(keys), convert or {}, collect or {}
    rewritten, collected = [], {}
    for item in overrides:
        key, sep, value = item.partition("=")
        if sep and key in collect:
            collected.setdefault(collect[key], []).append(value)
        elif sep and key in keys:
            rewritten.append(f"{section}.{key}={convert.get(key, str)(value)}")
        else:
            rewritten.append(item)
    return rewritten + [f"{section}.{field}={texts_value(values)}" for field, values in collected.items()]
