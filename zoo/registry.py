"""Variants by name, from ``registry.yaml``: data, never code.

An entry names its pattern and the rest describes it::

    variants:
      longformer:
        pattern:                      # a family name, or union / intersection / causal of specs
          union:
            - dilated: {window_size: $window_size, dilation: $dilation}
            - global: {global_tokens: $global_tokens}
        params: {window_size: 256, dilation: 1, global_tokens: 1}   # defaults callers may override
        description: One line.
        paper: Authors, title, year, link.
        complexity: O(n·(w + g)·d)

With a single family (``pattern: local``), every parameter of that family may be overridden and
``params`` gives defaults. With a composition, ``params`` declares the parameters and ``$name``
places them. The zoo's own file loads first, then the files named in ``ZOO_REGISTRY`` (a path list,
``os.pathsep``-separated), then any ``zoo.load_registry(path)``. A name defined twice, an unknown
key, family or parameter, or a wrong type is an error naming the file, the entry and the fix.
"""

from __future__ import annotations

import fnmatch
import os
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import yaml

from .checks import suggest
from .patterns import Causal, Intersection, Pattern, Union, build_family, resolve_family
from .patterns.registry import family_parameters

BUILTIN_REGISTRY = Path(__file__).with_name("registry.yaml")
ENTRY_KEYS = {"pattern", "params", "description", "paper", "complexity"}
SECTIONS = {"variants", "positional"}


@dataclass(frozen=True)
class VariantSpec:
    """One registry entry."""

    name: str
    pattern: object  # the YAML pattern spec
    params: dict = field(default_factory=dict)
    description: str = ""
    paper: str = ""
    complexity: str = ""
    source: str = ""  # the file it came from

    def parameters(self) -> dict[str, object]:
        """The parameters a caller may override, with their defaults."""
        if isinstance(self.pattern, str):
            return {**family_parameters(resolve_family(self.pattern)), **self.params}
        return dict(self.params)

    def build(self, **overrides: object) -> Pattern:
        """The pattern with the entry's defaults and the caller's overrides."""
        known = self.parameters()
        for key in overrides:
            if key not in known:
                valid = ", ".join(known) or "none"
                raise TypeError(
                    f"variant {self.name!r} has no parameter {key!r} (its parameters: {valid})"
                )
        return _build_cached(self, _freeze({**self.params, **overrides}))

    def __hash__(self) -> int:
        return hash((self.name, self.source))


def _freeze(value: object) -> object:
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    if isinstance(value, list | tuple):
        return tuple(_freeze(v) for v in value)
    return value


@lru_cache(maxsize=512)
def _build_cached(spec: VariantSpec, frozen_params: tuple) -> Pattern:
    params = dict(frozen_params)
    if isinstance(spec.pattern, str):
        return build_family(spec.pattern, params)
    return _compose(spec.pattern, params)


def _compose(node: object, params: dict[str, object]) -> Pattern:
    """A pattern from a YAML spec node, with ``$name`` replaced by the variant's parameters."""
    if isinstance(node, str):
        return build_family(node, {})
    if not isinstance(node, dict) or len(node) != 1:
        raise ValueError(
            "a pattern spec is a family name or a one-key mapping (union, intersection, "
            f"causal, or a family with its parameters), got {node!r}"
        )
    ((key, value),) = node.items()
    if key in ("union", "intersection"):
        if not isinstance(value, list) or len(value) < 2:
            raise ValueError(f"{key} takes a list of at least two pattern specs, got {value!r}")
        members = tuple(_compose(v, params) for v in value)
        return Union(members) if key == "union" else Intersection(members)
    if key == "causal":
        return Intersection((_compose(value, params), Causal()))
    if value is None:
        value = {}
    if not isinstance(value, dict):
        raise ValueError(f"the parameters of pattern {key!r} must be a mapping, got {value!r}")
    return build_family(key, {k: _substitute(v, params) for k, v in value.items()})


def _substitute(value: object, params: dict[str, object]) -> object:
    if isinstance(value, str) and value.startswith("$"):
        name = value[1:]
        if name not in params:
            raise ValueError(
                f"{value} refers to a parameter that the entry's params do not declare"
            )
        return params[name]
    return value


def _references(node: object) -> set[str]:
    if isinstance(node, str):
        return {node[1:]} if node.startswith("$") else set()
    if isinstance(node, dict):
        return set().union(*(_references(v) for v in node.values()))
    if isinstance(node, list):
        return set().union(*(_references(v) for v in node))
    return set()


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.safe_load keeps the last of two equal keys; a registry must not."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def read_registry_file(path: str | os.PathLike) -> dict[str, dict[str, object]]:
    """The sections of a registry file, checked for shape; errors name the file."""
    path = Path(path)
    try:
        data = yaml.load(path.read_text(), Loader=_UniqueKeyLoader)
    except OSError as error:
        raise ValueError(f"cannot read registry file {path}: {error}") from error
    except yaml.YAMLError as error:
        raise ValueError(f"{path}: not valid YAML: {error}") from error
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a registry file is a mapping with sections {sorted(SECTIONS)}")
    for section in data:
        if section not in SECTIONS:
            raise ValueError(
                f"{path}: {suggest('section', str(section), SECTIONS, 'the registry docs')}"
            )
        if not isinstance(data[section], dict):
            raise ValueError(f"{path}: section {section!r} must map names to entries")
    return data


def parse_variant(name: str, entry: object, source: str) -> VariantSpec:
    where = f"{source}: variant {name!r}"
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: an entry is a mapping with keys {sorted(ENTRY_KEYS)}")
    for key in entry:
        if key not in ENTRY_KEYS:
            raise ValueError(
                f"{where}: {suggest('key', str(key), ENTRY_KEYS, 'the registry docs')}"
            )
    if "pattern" not in entry:
        raise ValueError(f"{where}: needs a 'pattern' (a family name or a composition)")
    for key in ("description", "paper", "complexity"):
        if not isinstance(entry.get(key, ""), str):
            raise ValueError(f"{where}: {key!r} must be a string, got {entry[key]!r}")
    params = entry.get("params") or {}
    if not isinstance(params, dict):
        raise ValueError(f"{where}: 'params' must be a mapping of parameter names to defaults")
    spec = VariantSpec(
        name=name,
        pattern=entry["pattern"],
        params=params,
        description=entry.get("description", ""),
        paper=entry.get("paper", ""),
        complexity=entry.get("complexity", ""),
        source=source,
    )
    try:
        if not isinstance(spec.pattern, str):
            unused = set(params) - _references(spec.pattern)
            if unused:
                raise ValueError(
                    f"params {sorted(unused)} are declared but no $name in the pattern uses them"
                )
        spec.build()
    except (TypeError, ValueError) as error:
        raise ValueError(f"{where}: {error}") from error
    return spec


class Registry:
    """The variants known in this process."""

    def __init__(self) -> None:
        self.variants: dict[str, VariantSpec] = {}
        self.positional: dict[str, dict[str, object]] = {}
        self.files: list[str] = []

    def load(self, path: str | os.PathLike) -> list[str]:
        """Add a file's entries; returns the names it added."""
        data = read_registry_file(path)
        source = str(path)
        new = {
            name: parse_variant(name, entry, source)
            for name, entry in data.get("variants", {}).items()
        }
        for name in new:
            if name in self.variants:
                raise ValueError(
                    f"{source}: variant {name!r} is already defined in "
                    f"{self.variants[name].source}; give it another name"
                )
        self.variants.update(new)
        self.positional.update(data.get("positional", {}))
        self.files.append(source)
        return list(new)


_registry: Registry | None = None


def registry() -> Registry:
    """The process-wide registry: the built-in file, then ``ZOO_REGISTRY`` files, on first use."""
    global _registry
    if _registry is None:
        fresh = Registry()
        fresh.load(BUILTIN_REGISTRY)
        for path in filter(None, os.environ.get("ZOO_REGISTRY", "").split(os.pathsep)):
            fresh.load(path)
        _registry = fresh
    return _registry


def load_registry(path: str | os.PathLike) -> list[str]:
    """Add the variants of a user's YAML file; returns their names."""
    return registry().load(path)


def list_variants(pattern: str = "*") -> list[str]:
    """Variant names matching a glob, e.g. ``zoo.list_variants("*local*")``."""
    return sorted(fnmatch.filter(registry().variants, pattern))


def get_spec(name: str) -> VariantSpec:
    variants = registry().variants
    if not isinstance(name, str) or name not in variants:
        raise ValueError(suggest("variant", str(name), variants, "zoo.list_variants()"))
    return variants[name]
