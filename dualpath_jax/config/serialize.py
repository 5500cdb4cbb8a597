"""JSON round trip and typed `key=value` overrides of the config dataclasses.

`to_json`/`from_json` write and read a config (an `ExperimentConfig` read back is validated);
`apply_overrides` applies a launcher's `--set section.key=value`, each value parsed into the type
of the field it names. Every bad key or value raises `ConfigError` naming it.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import types
import typing
from typing import Any, TypeVar

from dualpath_jax.config.schema import ConfigError, ExperimentConfig
from dualpath_jax.config.validation import validate

T = TypeVar("T")

# --------------------------------------------------------------------------- JSON round trip


def to_dict(cfg: Any) -> dict[str, Any]:
    """A JSON-ready dict of a config dataclass (enums as their values)."""

    def conv(v: Any) -> Any:
        if dataclasses.is_dataclass(v):
            return {f.name: conv(getattr(v, f.name)) for f in dataclasses.fields(v)}
        if isinstance(v, enum.Enum):
            return v.value
        if isinstance(v, tuple | list):
            return [conv(x) for x in v]
        return v

    return conv(cfg)


def to_json(cfg: Any, **kw: Any) -> str:
    return json.dumps(to_dict(cfg), **kw)


def from_dict(cls: type[T], data: dict[str, Any], where: str = "") -> T:
    """Builds `cls` from a dict, checking every key and value type."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where or cls.__name__}: expected an object, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(
            f"{where or cls.__name__}: unknown key(s) {unknown}; known: {sorted(names)}"
        )
    kwargs = {}
    for name, value in data.items():
        key = f"{where}.{name}" if where else name
        kwargs[name] = _coerce(hints[name], value, key)
    return cls(**kwargs)


def from_json(cls: type[T], text: str) -> T:
    """Parses `cls` from JSON; an ExperimentConfig is also validated (`validate`)."""
    cfg = from_dict(cls, json.loads(text))
    if isinstance(cfg, ExperimentConfig):
        validate(cfg)
    return cfg


def _coerce(tp: Any, value: Any, key: str) -> Any:
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, key)
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(a, value, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError("; ".join(errors))
    if origin is tuple:
        (elem, *_rest) = typing.get_args(tp)
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        return tuple(_coerce(elem, v, key) for v in value)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(value)
        except ValueError:
            raise ConfigError(f"{key}: {value!r} is not one of {[m.value for m in tp]}") from None
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected a bool, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{key}: expected an int, got {value!r}")
    if tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"{key}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    return value


# --------------------------------------------------------------------------- overrides


def _parse_scalar(tp: Any, text: str, key: str) -> Any:
    """Parses the text of a `key=value` override into the field's type."""
    if tp is bool:
        low = text.strip().lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{key}: expected a bool (true/false), got {text!r}")
    if tp is int:
        try:
            return int(text.replace("_", ""))
        except ValueError:
            try:
                f = float(text)
            except ValueError:
                raise ConfigError(f"{key}: expected an int, got {text!r}") from None
            if not f.is_integer():
                raise ConfigError(f"{key}: expected an int, got {text!r}") from None
            return int(f)
    if tp is float:
        try:
            return float(text)
        except ValueError:
            raise ConfigError(f"{key}: expected a number, got {text!r}") from None
    if tp is str:
        return text
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = text
    return _coerce(tp, value, key)


def apply_overrides(cfg: T, overrides: typing.Iterable[str]) -> T:
    """Returns `cfg` with each `a.b.c=value` override applied, typed by the target field."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected key=value")
        path, text = item.split("=", 1)
        cfg = _set_path(cfg, path.strip().split("."), text, path.strip())
    return cfg


def _set_path(obj: Any, parts: list[str], text: str, full: str) -> Any:
    if not dataclasses.is_dataclass(obj):
        raise ConfigError(f"override {full!r}: {type(obj).__name__} has no fields")
    names = {f.name for f in dataclasses.fields(obj)}
    head = parts[0]
    if head not in names:
        raise ConfigError(
            f"override {full!r}: unknown key {head!r} in {type(obj).__name__}; known: {sorted(names)}"
        )
    hints = typing.get_type_hints(type(obj))
    if len(parts) == 1:
        value = _parse_scalar(hints[head], text, full)
    else:
        value = _set_path(getattr(obj, head), parts[1:], text, full)
    return dataclasses.replace(obj, **{head: value})
