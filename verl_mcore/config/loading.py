"""Build a typed config tree from YAML mappings and `a.b.c=value` overrides.

The dataclasses in `schema.py` are the single source of truth. This module only converts plain
YAML data into them, and fails with the dotted key, the expected type and the given value when
something does not fit. An unknown key names the closest valid key.
"""
from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Any, Literal, Union, get_args, get_origin

import yaml

from verl_mcore.errors import ConfigError


def parse_override(text: str) -> tuple[list[str], Any]:
    """`trainer.logger=[console,jsonl]` -> (["trainer", "logger"], ["console", "jsonl"]).

    The value is parsed as a YAML scalar or flow sequence/mapping, so numbers, booleans, null and
    lists need no quoting; a value YAML cannot parse is kept as the literal string.
    """
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {text!r} is not of the form a.b.c=value")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    return key.split("."), value


def apply_override(tree: dict, path: list[str], value: Any) -> None:
    """Set tree[path[0]]...[path[-1]] = value, creating intermediate mappings."""
    node = tree
    for i, part in enumerate(path[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(
                f"override {'.'.join(path)}: {'.'.join(path[: i + 1])} is a value, not a section"
            )
        node = child
    node[path[-1]] = value


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in get_args(tp))
    if origin is list:
        return f"list[{_type_name(get_args(tp)[0])}]"
    if origin is dict:
        k, v = get_args(tp)
        return f"dict[{_type_name(k)}, {_type_name(v)}]"
    if tp is type(None):
        return "null"
    if dataclasses.is_dataclass(tp):
        return f"mapping ({tp.__name__})"
    return getattr(tp, "__name__", str(tp))


def _all_keys(cls: type, prefix: str = "") -> list[str]:
    keys = []
    for f in dataclasses.fields(cls):
        name = prefix + f.name
        keys.append(name)
        tp = _field_types(cls)[f.name]
        inner = [a for a in get_args(tp) if dataclasses.is_dataclass(a)] or [tp]
        if dataclasses.is_dataclass(inner[0]):
            keys.extend(_all_keys(inner[0], name + "."))
    return keys


_HINTS: dict[type, dict[str, Any]] = {}


def _field_types(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def _convert(tp: Any, value: Any, key: str) -> Any:
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(arg, value, key)
            except ConfigError as e:
                errors.append(e)
        raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")
    if origin is Literal:
        if value in get_args(tp):
            return value
        # YAML reads a bare off / on as a bool: the word the user wrote, where it is a choice
        word = {False: "off", True: "on"}.get(value) if isinstance(value, bool) else None
        if word in get_args(tp):
            return word
        close = difflib.get_close_matches(str(value), [str(a) for a in get_args(tp)], n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"{key}: expected one of {_type_name(tp)}, got {value!r}{hint}")
    if origin is list:
        (item,) = get_args(tp)
        if isinstance(value, str) and item is str:
            value = [value]  # `data.train_files=a.parquet` means a one-element list
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")
        return [_convert(item, v, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        ktp, vtp = get_args(tp)
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")
        return {_convert(ktp, k, f"{key} key"): _convert(vtp, v, f"{key}.{k}") for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping ({tp.__name__}), got {value!r}")
        return from_dict(tp, value, prefix=key + ".")
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected bool, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected int, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads `1e-6` as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{key}: expected float, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)  # e.g. a numeric run name
        raise ConfigError(f"{key}: expected str, got {value!r}")
    raise ConfigError(f"{key}: unsupported field type {tp!r} in the schema")


def from_dict(cls: type, data: dict, prefix: str = "", defaults: Any = None) -> Any:
    """Instantiate dataclass `cls` from a nested mapping, checking every key and type. Keys the
    mapping leaves out keep their value in `defaults` (an instance of `cls`), else the class
    default: a partial `critic.optim` keeps the critic's own defaults (lr 1e-5), not
    OptimConfig's (1e-6)."""
    hints = _field_types(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for k in data:
        if k not in hints:
            nested = _all_keys(cls, prefix)
            # A right name in the wrong section (`actor.lr` for `actor.optim.lr`) first, then a
            # misspelling at this level, then a misspelling anywhere below.
            close = [n for n in nested if n.rsplit(".", 1)[-1] == str(k)][:1]
            close = close or difflib.get_close_matches(
                prefix + str(k), [prefix + n for n in names], n=1, cutoff=0.6)
            close = close or difflib.get_close_matches(prefix + str(k), nested, n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            raise ConfigError(f"unknown config key {prefix}{k}{hint}")
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in data:
            continue
        tp, value, key = hints[f.name], data[f.name], prefix + f.name
        if dataclasses.is_dataclass(tp) and isinstance(value, dict):
            if defaults is not None:
                base = getattr(defaults, f.name)
            else:
                base = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
            kwargs[f.name] = from_dict(tp, value, key + ".", base)
        else:
            kwargs[f.name] = _convert(tp, value, key)
    try:
        return dataclasses.replace(defaults, **kwargs) if defaults is not None else cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: {e}") from e


def to_dict(obj: Any) -> Any:
    """Dataclass tree -> plain dicts/lists (YAML-serialisable)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def load_yaml(path: str) -> dict:
    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: top level must be a mapping, got {type(data).__name__}")
    return data
