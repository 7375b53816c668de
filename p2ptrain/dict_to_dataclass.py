"""Frozen dataclasses built from the nested dicts that YAML, TOML and JSON load into, checked against the fields'
type hints (ground floor: shared by the peer's config and the testnet's scenario files).

Every mistake is a one-line `ConfigError` that names the dotted key: an unknown key, a missing required field
(one without a default), a value of the wrong type. Ints are accepted for floats, lists for tuples; an empty
(null) section takes its defaults; an optional field (``float | None``) takes null. A field whose file form is
not its type (a rate written ``50mbit``, a list of scripted events) says how to read it with `parsed_by`.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from p2ptrain.errors import ConfigError

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

T = TypeVar("T", bound="DataclassInstance")

_PARSE = "dict_to_dataclass.parse"  # field metadata: a reader (value, dotted key) -> field value
_KEY = "dict_to_dataclass.key"  # field metadata: the key in the dict, when it is not the field's name
_EXPECTED = {bool: "true or false", int: "a whole number", float: "a number", str: "a string"}


def parsed_by(parse: Callable[[Any, str], Any], key: str | None = None) -> dict[str, Any]:
    """Field metadata for `build_dataclass`: read the value with ``parse(value, dotted_key)`` instead of checking it
    against the type hint, and find it under `key` in the dict (default: the field's name)."""
    return {_PARSE: parse, _KEY: key}


def build_dataclass(cls: type[T], values: Any, key: str = "") -> T:
    """An instance of the dataclass `cls` from a dict, every key and value checked; `key` is the dict's dotted
    place in the file ("" for the whole file), used to name keys in messages. None counts as an empty dict."""
    fields = {f.metadata.get(_KEY) or f.name: f for f in dataclasses.fields(cls) if f.init}
    values = check_mapping({} if values is None else values, key, tuple(fields))
    missing = [name for name, field in fields.items() if name not in values
               and field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING]
    if missing:
        raise ConfigError(f"{_join(key, missing[0])} is required")
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for name, value in values.items():
        field, dotted_key = fields[name], _join(key, name)
        parse = field.metadata.get(_PARSE)
        kwargs[field.name] = parse(value, dotted_key) if parse else _check(hints[field.name], value, dotted_key)
    return cls(**kwargs)


def check_mapping(values: object, key: str, known: tuple[str, ...]) -> dict[str, Any]:
    """`values` itself if it is a dict of `known` keys only; else a ConfigError naming `key` or the unknown key."""
    mapping = _mapping(values, key)
    unknown = sorted(str(name) for name in mapping if name not in known)
    if unknown:
        raise ConfigError(f"unknown key {_join(key, unknown[0])!r} (known: {', '.join(known)})")
    return mapping


def _check(hint: Any, value: Any, key: str) -> Any:
    """`value` checked against a type hint (and converted: int to float, list to tuple, dict to dataclass)."""
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return build_dataclass(hint, value, key)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return _check_union(args, value, key)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        item_hint = args[0] if args else Any
        return tuple(_check(item_hint, item, f"{key}[{i}]") for i, item in enumerate(value))
    if hint is dict or origin in (dict, Mapping):
        return _mapping(value, key)
    if hint is Any:
        return value
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, bool) != (hint is bool) or (isinstance(hint, type) and not isinstance(value, hint)):
        raise ConfigError(f"{key}: expected {_expected(hint)}, got {value!r}")
    return value


def _check_union(options: tuple[Any, ...], value: Any, key: str) -> Any:
    """One arm of ``A | B | None``: null if allowed; a single other arm reports its own error; else the first fit."""
    if value is None and type(None) in options:
        return None
    arms = [option for option in options if option is not type(None)]
    if len(arms) == 1:
        return _check(arms[0], value, key)
    for arm in arms:
        try:
            return _check(arm, value, key)
        except ConfigError:
            continue
    expected = " or ".join("null" if option is type(None) else _expected(option) for option in options)
    raise ConfigError(f"{key}: expected {expected}, got {value!r}")


def _mapping(value: object, key: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ConfigError(f"{key + ': ' if key else ''}expected a mapping, got {type(value).__name__}")
    return value


def _expected(hint: Any) -> str:
    return _EXPECTED.get(hint) or f"a {getattr(hint, '__name__', hint)}"


def _join(key: str, name: str) -> str:
    return f"{key}.{name}" if key else name
