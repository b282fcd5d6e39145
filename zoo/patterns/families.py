"""Pattern families by name: the built-in ones, ``@register_pattern`` for a user's own, and
``package.module:factory`` for a factory that lives outside the zoo."""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass

from ..core.arguments import check_parameters, import_object
from ..core.named import Named
from ..core.shape_cache import outside_graph
from .base import Pattern

PatternFactory = Callable[..., Pattern]
_FAMILIES: Named[PatternFactory] = Named("pattern family", "zoo.list_pattern_families()")


@dataclass(frozen=True)
class VariantInfo:
    """What ``register_pattern`` says of a family that is also a variant of the same name."""

    description: str
    paper: str
    complexity: str
    source: str  # the module that registered it


VariantListener = Callable[[str, VariantInfo, bool], None]
_VARIANT_LISTENERS: list[VariantListener] = []
# The families registered as variants, kept here so that a registry built later (or anew) adds
# them too; and how many times a family was replaced by another factory (cached builds of the
# variants key on it).
_CODE_VARIANTS: dict[str, VariantInfo] = {}
_REPLACED = [0]


def code_variants() -> dict[str, VariantInfo]:
    """The families registered with a description, as variants of their names."""
    return dict(_CODE_VARIANTS)


def replacements() -> int:
    """How many times a family was replaced by another factory."""
    return _REPLACED[0]


def on_variant(listener: VariantListener) -> None:
    """Call ``listener(name, info, replace)`` for each family registered as a variant: how
    ``zoo.registry`` adds it to the variants (this package imports nothing of the zoo outside
    it)."""
    _VARIANT_LISTENERS.append(listener)


def register_pattern(
    name: str,
    *,
    description: str | None = None,
    paper: str = "",
    complexity: str = "",
    replace: bool = False,
) -> Callable[[PatternFactory], PatternFactory]:
    """Register a pattern family: a Pattern class or a function returning a Pattern.

    Its keyword parameters become the family's parameters, usable from ``registry.yaml``::

        @zoo.register_pattern("my_band")
        def my_band(window_size: int = 8) -> zoo.Pattern:
            return zoo.patterns.Local(window_size) | zoo.patterns.Global(1)

    With a ``description``, the family is also a variant of the same name, with the family's
    defaults as its parameters, for ``zoo.attention(variant=name)``, ``create_attention``,
    ``zoo list`` and the tests generated from the registry, with no YAML entry: every parameter
    then needs a default (one without is refused, naming it). A pattern class
    that defines only ``allowed`` runs on every backend (its block states are derived,
    ``zoo.patterns.derived``). A name already taken raises, unless ``replace=True``.
    """
    if not isinstance(name, str) or not name or ":" in name:
        # resolve_family reads a name with a colon as package.module:factory, never as a family
        raise ValueError(
            "register_pattern: a family name is a non-empty str without ':' (that form names "
            f"package.module:factory), got {name!r}"
        )
    if description is not None and not isinstance(description, str):
        raise TypeError(f"description must be a str, got {description!r}")

    def decorate(factory: PatternFactory) -> PatternFactory:
        if description is not None:  # a variant is built with the family's defaults alone
            required = [key for key, default in family_parameters(factory).items()
                        if default is inspect.Parameter.empty]  # fmt: skip
            if required:
                raise TypeError(
                    f"register_pattern({name!r}, description=...): with a description the family "
                    f"is also a variant, built with its defaults, but {', '.join(required)} has "
                    "no default; give it one, or register the family without a description (a "
                    "building block for registry entries)"
                )
        before = _FAMILIES.get(name)
        _FAMILIES.add(name, factory, replace=replace)
        if before is not None and before is not factory:
            _REPLACED[0] += 1  # patterns built from the old factory are stale
        info = None if description is None else VariantInfo(description, paper, complexity,
                                                            factory.__module__)  # fmt: skip
        if info is not None and not (before is factory and _CODE_VARIANTS.get(name) == info):
            try:
                for listener in _VARIANT_LISTENERS:  # raises if the name is taken or bad
                    listener(name, info, replace)
            except Exception:
                if before is None:
                    del _FAMILIES[name]
                else:
                    _FAMILIES[name] = before
                raise
            _CODE_VARIANTS[name] = info
        return factory

    return decorate


def list_families() -> list[str]:
    return sorted(_FAMILIES)


def resolve_family(name: str) -> PatternFactory:
    """A family by registered name, or a factory given as ``package.module:attribute``."""
    if ":" in name:
        factory = import_object(name, "pattern")
        if not callable(factory):
            raise ValueError(
                f"pattern {name!r} is a {type(factory).__name__}, not a Pattern class or a "
                "function returning a Pattern"
            )
        return factory
    return _FAMILIES.lookup(name)


def family_parameters(factory: PatternFactory) -> dict[str, object]:
    """The family's parameters and their defaults (``inspect.Parameter.empty`` if required)."""
    return dict(_defaults_outside_graph(factory))


@outside_graph
def _defaults_outside_graph(factory: PatternFactory) -> tuple[tuple[str, object], ...]:
    try:
        return _signature_defaults(factory)
    except TypeError:  # an unhashable callable object as a factory: read it every time
        return _signature_defaults.__wrapped__(factory)


@functools.lru_cache(maxsize=256)
def _signature_defaults(factory: PatternFactory) -> tuple[tuple[str, object], ...]:
    # Every call with a registry variant reads its parameters; inspect.signature took a tenth of
    # zoo.attention's own time in a training step. A replaced family is a new factory object, so
    # the cache never answers for the old one.
    made = _made_defaults(factory)
    return tuple(
        (p.name, made.get(p.name, p.default))
        for p in inspect.signature(factory).parameters.values()
        if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
    )


def _made_defaults(factory: PatternFactory) -> dict[str, object]:
    """A dataclass family's defaults given as ``field(default_factory=...)``, made: its
    signature holds a sentinel there, which a variant's parameters would then show (and JSON,
    for auto's table, could not write)."""
    if not (isinstance(factory, type) and dataclasses.is_dataclass(factory)):
        return {}
    return {
        f.name: f.default_factory()
        for f in dataclasses.fields(factory)
        if f.default_factory is not dataclasses.MISSING
    }


def build_family(name: str, params: dict[str, object]) -> Pattern:
    """Call a family with parameters, turning YAML lists into tuples and naming any unknown one."""
    factory = resolve_family(name)
    check_parameters(f"pattern {name!r}", params, family_parameters(factory))
    args = {k: tuple(v) if isinstance(v, list) else v for k, v in params.items()}
    pattern = factory(**args)
    if not isinstance(pattern, Pattern):
        raise TypeError(f"pattern {name!r} returned {type(pattern).__name__}, not a zoo Pattern")
    try:
        hash(pattern)
    except TypeError as error:  # its first call would fail on every backend, less clearly
        raise TypeError(
            f"pattern {name!r} returned a {type(pattern).__name__} that is not hashable "
            f"({error}); backends cache layouts by pattern, so make it a frozen dataclass: "
            "@dataclass(frozen=True)"
        ) from error
    return pattern
