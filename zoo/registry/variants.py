"""A variant: a named pattern with defaults, built from its registry entry.

With a single family (``pattern: local``), every parameter of that family may be overridden and the
entry's ``params`` give defaults. With a composition (``union``, ``intersection``, ``causal``), the
entry's ``params`` declare the parameters and ``$name`` places them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from ..core.arguments import check_parameters, close_matches, did_you_mean, typed
from ..patterns import Intersection, Pattern, Union, build_family, made_causal, resolve_family
from ..patterns.families import family_parameters, list_families, replacements

COMBINATORS = ("union", "intersection", "causal")


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
        check_parameters(f"variant {self.name!r}", overrides, self.parameters())
        frozen = _freeze({**self.params, **overrides})
        try:
            hash(frozen)
        except TypeError:  # a value of no parameter's type (a set, an array): its check says so
            return _build_cached.__wrapped__(self, frozen, None, replacements())
        return _build_cached(self, frozen, typed(frozen), replacements())

    def __hash__(self) -> int:
        return hash((self.name, self.source))

    def validate(self) -> None:
        """Build the pattern with its defaults; a composition must use every declared param."""
        if not isinstance(self.pattern, str):
            unused = set(self.params) - _references(self.pattern)
            if unused:
                raise ValueError(
                    f"params {sorted(unused)} are declared but no $name in the pattern uses them"
                )
        self.build()


def _freeze(value: object) -> object:
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    if isinstance(value, list | tuple):
        return tuple(_freeze(v) for v in value)
    return value


@lru_cache(maxsize=512)
def _build_cached(
    spec: VariantSpec, frozen_params: tuple, typed_params: tuple | None, replaced: int
) -> Pattern:
    # ``typed_params``: the parameters with their types (1 and True are equal keys, and the
    # checks refuse True); ``replaced``: a family replaced by another factory builds anew
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
    _check_pattern_name(key)
    if key in ("union", "intersection"):
        if not isinstance(value, list) or len(value) < 2:
            raise ValueError(f"{key} takes a list of at least two pattern specs, got {value!r}")
        members = tuple(_compose(v, params) for v in value)
        return Union(members) if key == "union" else Intersection(members)
    if key == "causal":
        return made_causal(_compose(value, params))
    if value is None:
        value = {}
    if not isinstance(value, dict):
        raise ValueError(f"the parameters of pattern {key!r} must be a mapping, got {value!r}")
    try:
        return build_family(key, {k: _substitute(v, params) for k, v in value.items()})
    except (TypeError, ValueError) as error:
        raise _named_as_given(error, key, value) from error


def _named_as_given(error: Exception, family: str, value: dict) -> Exception:
    """The family's error, naming the variant's parameter where the family knows it by another
    name (bigbird's ``random_per_head`` is the ``random`` family's ``per_head``)."""
    message = str(error)
    for inner, spec in value.items():
        renamed = isinstance(spec, str) and spec.startswith("$") and spec[1:] != inner
        if renamed and message.startswith((f"{inner} ", f"{inner}=")):
            return type(error)(f"{spec[1:]} (the {family} pattern's {inner}): {message}")
    return error


def _check_pattern_name(name: object) -> None:
    """A spec key must be a combinator, a registered family or ``package.module:factory``."""
    if isinstance(name, str) and (name in COMBINATORS or ":" in name):
        return
    families = list_families()
    if name not in families:
        hint = did_you_mean(close_matches(str(name), [*COMBINATORS, *families]))
        raise ValueError(
            f"unknown pattern {name!r}{hint} (a pattern is a combinator, {', '.join(COMBINATORS)}, "
            f"or a family from zoo.list_pattern_families(): {', '.join(families)})"
        )


def _substitute(value: object, params: dict[str, object]) -> object:
    if isinstance(value, str) and value.startswith("$"):
        name = value[1:]
        if name not in params:
            raise ValueError(
                f"{value} refers to a parameter that the entry's params do not declare"
            )
        return params[name]
    if isinstance(value, list):  # a list parameter may place some items: [$first, 5]
        return [_substitute(item, params) for item in value]
    return value


def _references(node: object) -> set[str]:
    if isinstance(node, str):
        return {node[1:]} if node.startswith("$") else set()
    if isinstance(node, dict):
        return set().union(*(_references(v) for v in node.values()))
    if isinstance(node, list):
        return set().union(*(_references(v) for v in node))
    return set()
