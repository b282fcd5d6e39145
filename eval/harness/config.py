"""YAML configs with command-line overrides, checked against a dataclass schema.

``python -m eval run eval/configs/quick.yaml train.steps=200 variants=[local,full]``: every
``key=value`` after the file overrides one setting; dotted keys reach nested sections and values
are read as YAML (numbers, lists, booleans). An unknown key, in the file or on the command line,
is an error that names the file, the key and the close matches; so is a value of the wrong type.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import re
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A config file or override that does not fit the schema."""


def _suggest(key: str, known: list[str]) -> str:
    close = difflib.get_close_matches(key, known, n=2, cutoff=0.5)
    hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    return f"{hint} (known keys: {', '.join(known)})"


# A number with an exponent and no dot before it, which YAML 1.1 reads as a string.
EXPONENT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def _check_type(value: Any, annotation: Any, where: str) -> Any:
    """Check a YAML value against a field annotation (int, float, str, bool, list, dict, union)."""
    # a bare list or dict takes any items
    origin = typing.get_origin(annotation) or (annotation if annotation in (list, dict) else None)
    if annotation is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        for option in typing.get_args(annotation):
            try:
                return _check_type(value, option, where)
            except ConfigError:
                continue
        raise ConfigError(f"{where} must be {annotation}, got {value!r}")
    if annotation is type(None):
        if value is None:
            return None
        raise ConfigError(f"{where} must be null, got {value!r}")
    if origin in (list, tuple):
        (item,) = typing.get_args(annotation)[:1] or (Any,)
        if not isinstance(value, list | tuple):
            value = [value]  # a single value where a list is expected: variants=local
        return [_check_type(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where} must be a mapping, got {value!r}")
        _, item = typing.get_args(annotation) or (Any, Any)
        return {k: _check_type(v, item, f"{where}: {k}") for k, v in value.items()}
    if annotation is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if annotation is float and isinstance(value, str) and EXPONENT.fullmatch(value):
        return float(value)  # YAML 1.1 (PyYAML) reads 1e-3 as a string: it needs 1.0e-3
    if annotation in (int, float, str, bool):
        if (isinstance(value, bool) and annotation is not bool) or not isinstance(
            value, annotation
        ):
            name = annotation.__name__
            raise ConfigError(f"{where} must be {name}, got {value!r} ({type(value).__name__})")
        return value
    return value


def build(schema: type[T], data: dict[str, Any], where: str) -> T:
    """A schema instance from a mapping; nested dataclass fields take nested mappings."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where} must be a mapping, got {data!r}")
    hints = typing.get_type_hints(schema)
    fields = {f.name: f for f in dataclasses.fields(schema)}
    for key in data:
        if key not in fields:
            raise ConfigError(f"{where}: unknown key {key!r}{_suggest(str(key), list(fields))}")
    values = {}
    for name, value in data.items():
        annotation = hints[name]
        if dataclasses.is_dataclass(annotation):
            values[name] = build(annotation, value or {}, f"{where}: {name}")
        else:
            values[name] = _check_type(value, annotation, f"{where}: {name}")
    return schema(**values)


def _set(data: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    for part in parents:
        if data.get(part) is None:  # a section whose keys are all commented out reads as null
            data[part] = {}
        data = data[part]
        if not isinstance(data, dict):
            raise ConfigError(f"override {dotted}: {part!r} is not a section")
    data[last] = value


def config_arguments(
    prog: str, description: str, argv: list[str], example: str
) -> tuple[str | None, list[str]]:
    """(the config path or None, the key=value overrides) of a command that takes
    ``[CONFIG.yaml] [key=value ...]`` (``bench``, ``bench-decode``, ``bench-cp``); ``--help``
    and a bad option exit as argparse does."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("items", nargs="*", help=f"[CONFIG.yaml] [key=value ...], e.g. {example}")
    items = list(parser.parse_args(argv).items)
    path = items.pop(0) if items and "=" not in items[0] else None
    return path, items


def load_config(schema: type[T], path: str | Path | None, overrides: list[str] = ()) -> T:
    """Read ``path`` (or start from the schema's defaults), apply ``key=value`` overrides, check."""
    data: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        source = str(path)
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except OSError as error:
            raise ConfigError(f"cannot read config {path}: {error}") from error
        except yaml.YAMLError as error:
            raise ConfigError(f"{path}: not valid YAML: {error}") from error
        if not isinstance(data, dict):
            raise ConfigError(
                f"{path} must be a mapping of settings (name: ..., tasks: [...]), got a "
                f"{type(data).__name__}: {data!r}"
            )
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} must look like key=value (e.g. train.steps=100)")
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError as error:
            why = getattr(error, "problem", None) or error  # without the marks' extra lines
            raise ConfigError(f"override {item!r}: {text!r} is not valid YAML ({why})") from error
        _set(data, key.strip(), value)
    return build(schema, data, source)


def as_dict(config: Any) -> dict[str, Any]:
    """The config as plain data, for result records."""
    return dataclasses.asdict(config)
