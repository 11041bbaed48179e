"""A `Config` from the schema (`config.schema`), a preset YAML and `key=value` overrides, then one
validation pass (`config.validate`).

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
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from podtrain.orchestrator.common.errors import ConfigError
from podtrain.orchestrator.config.schema import Config
from podtrain.orchestrator.config.validate import validate

# The presets: `configs/` of the repository, installed as the data package `podtrain.configs`.
CONFIG_DIR = Path(os.environ.get("PODTRAIN_CONFIG_DIR", Path(__file__).resolve().parents[2] / "configs"))


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


def load_config(preset: str | None, overrides: list[str] = (), *, hint_keys: Iterable[str] = (),
                serving: bool = False) -> Config:
    """Schema defaults, then the preset YAML, then the overrides; then `validate` (without devices;
    as a service's config with `serving`).

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
    validate(config, serving=serving)
    return config


def apply_overrides(config: Config, overrides: list[str], *, serving: bool = False) -> Config:
    """`config` with `overrides` applied as on the command line, validated again."""
    merged = _merge(OmegaConf.structured(config), parse_overrides(list(overrides)), _schema_keys(Config), "override")
    result = OmegaConf.to_object(merged)
    validate(result, serving=serving)
    return result


def to_yaml(config: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(config))
