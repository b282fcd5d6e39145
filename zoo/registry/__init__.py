"""Variants and positional encodings by name, from ``registry.yaml``: data, never code.

A file has up to two sections::

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
    mechanisms:                       # attention computed differently, not masked
      performer:
        mechanism: performer          # a registered class name, or package.module:Class
        params: {seed: 0}
        description: One line.
        complexity: O(n·m·d)
    positional:
      rope:
        encoding: rope                # a registered class name, or package.module:Class
        params: {base: 10000.0}
        description: One line.

See ``zoo.registry.variants``, ``zoo.registry.mechanism_spec`` and ``zoo.registry.encoding_spec``
for what the entries mean. The zoo's own file loads first, then the files named in ``ZOO_REGISTRY``
(a path list, ``os.pathsep``-separated), then any ``zoo.load_registry(path)``; the Python
modules named in ``ZOO_IMPORTS`` are imported before, so that the patterns they register are
variants. A name defined twice, an unknown key, family, class or parameter, or a wrong type is an
error naming the file, the entry and the fix.

Variants and mechanisms share one namespace (``variant=`` takes either), so a name may not be
both. An entry whose ``package.module:name`` does not import (a package not installed, or not on
sys.path) does not stop the rest of the file: the registry records it as unavailable, listings
leave it out (``zoo list`` marks it), and only using it raises the error. A module that imports
but lacks the name is a misspelling, an error as any other.

A bad file named in ``ZOO_REGISTRY`` does not break the zoo's own variants, which every call
needs (the variable is read on the registry's first use, by any call). Each problem is a
``RegistryWarning`` naming the file (and the entry), and:

* a file that cannot be read, is not valid YAML, holds a recursive anchor or an unknown section
  is left out whole; using one of its names raises "unknown variant" with a note naming the file
  and why it did not load;
* an entry that fails its checks (an unknown key, family or parameter, a wrong type) is left out
  of the listings, and using its name raises its error, naming the file and the entry; the
  file's other entries load;
* an entry whose name is already defined (in the zoo's file, say) is left out: the name keeps
  its first meaning.

``zoo.load_registry(path)`` is the strict path: any of these problems raises its ValueError
there and adds nothing from the file.
"""

from __future__ import annotations

import fnmatch
import importlib
import os
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

import yaml

from ..core.arguments import NotImportable, suggest
from ..core.shape_cache import clear_all, outside_graph
from ..patterns.families import VariantInfo, code_variants, on_variant
from .encoding_spec import EncodingSpec
from .mechanism_spec import MechanismSpec
from .module_spec import ModuleSpec
from .variants import VariantSpec

BUILTIN_REGISTRY = Path(__file__).with_name("registry.yaml")
SECTION_KEYS = {
    "variants": ({"pattern", "params", "description", "paper", "complexity"}, "pattern"),
    "positional": ({"encoding", "params", "description", "paper"}, "encoding"),
    "mechanisms": ({"mechanism", "params", "description", "paper", "complexity"}, "mechanism"),
    "modules": ({"module", "params", "description", "paper", "complexity"}, "module"),
}
REQUIRED_HELP = {
    "pattern": "a family name or a composition",
    "encoding": "an encoding class name, or package.module:Class",
    "mechanism": "a mechanism class name (zoo.mechanisms.MECHANISMS), or package.module:Class",
    "module": "package.module:Class of an attention module",
}
SINGULAR = {
    "variants": "variant",
    "positional": "encoding",
    "mechanisms": "mechanism",
    "modules": "module",
}
SPECS = {
    "variants": VariantSpec,
    "positional": EncodingSpec,
    "mechanisms": MechanismSpec,
    "modules": ModuleSpec,
}
# sections whose names must differ (one name, one meaning in create_attention)
NAMESPACES = (("variants", "mechanisms", "modules"), ("positional",))


class RegistryWarning(UserWarning):
    """A file named in ``ZOO_REGISTRY``, or an entry of one, that the registry left out."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.safe_load keeps the last of two equal keys; a registry must not."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, list | dict):
                raise yaml.constructor.ConstructorError(
                    None, None, f"a key must be a name, got {key!r}", key_node.start_mark
                )
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _recursive_alias(data: object) -> str | None:
    """Where (``variants.mine.params``) a YAML alias makes a node contain itself, or None: a
    registry file must be a tree, and every reader of one (checks, caches) would recurse."""
    done: set[int] = set()
    ancestors: set[int] = set()  # of the node popped: their "leaving" marks are still stacked
    stack: list[tuple[object, str, bool]] = [(data, "", False)]
    while stack:
        node, where, leaving = stack.pop()
        if not isinstance(node, dict | list):
            continue
        if leaving:
            ancestors.discard(id(node))
            done.add(id(node))
            continue
        if id(node) in ancestors:
            return where
        if id(node) in done:  # reached again through an alias, without a cycle
            continue
        ancestors.add(id(node))
        stack.append((node, where, True))
        if isinstance(node, dict):
            stack.extend((v, f"{where}.{k}" if where else str(k), False) for k, v in node.items())
        else:
            stack.extend((v, f"{where}[{i}]", False) for i, v in enumerate(node))
    return None


def read_registry_file(path: str | os.PathLike) -> dict[str, dict[str, object]]:
    """The sections of a registry file, checked for shape; errors name the file."""
    path = Path(path)
    try:
        with path.open(encoding="utf-8") as stream:  # YAML's messages name the file
            data = yaml.load(stream, Loader=_UniqueKeyLoader)
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"cannot read registry file {path}: {error}") from error
    except yaml.YAMLError as error:
        raise ValueError(f"{path}: not valid YAML: {error}") from error
    except RecursionError as error:
        raise ValueError(
            f"{path}: nested too deeply for the YAML reader; a registry file holds a few levels "
            "of mappings and lists"
        ) from error
    where = _recursive_alias(data)
    if where is not None:
        raise ValueError(
            f"{path}: a recursive YAML anchor: the alias at {where or 'the top'} refers to an "
            "anchor (&name) that contains it; a registry file must be a tree, so write the node "
            "out (or alias a node outside the anchored one)"
        )
    if not isinstance(data, dict):
        raise ValueError(
            f"{path}: a registry file is a mapping with sections {sorted(SECTION_KEYS)}"
        )
    for section, entries in data.items():
        if section not in SECTION_KEYS:
            message = suggest("section", str(section), SECTION_KEYS, "the registry docs")
            raise ValueError(f"{path}: {message}")
        if not isinstance(entries, dict):
            raise ValueError(f"{path}: section {section!r} must map names to entries")
    return data


def check_entry(section: str, name: str, entry: object, source: str) -> dict[str, object]:
    """An entry's fields, checked for shape; errors name the file, the entry and the fix."""
    where = f"{source}: {SINGULAR[section]} {name!r}"
    if not isinstance(name, str):  # listings and lookups match names as strings
        raise ValueError(
            f"{where}: a name must be a string, but YAML reads this one as a "
            f"{type(name).__name__}; quote it in the file"
        )
    keys, required = SECTION_KEYS[section]
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: an entry is a mapping with keys {sorted(keys)}")
    for key in entry:
        if key not in keys:
            raise ValueError(f"{where}: {suggest('key', str(key), keys, 'the registry docs')}")
    if required not in entry:
        raise ValueError(f"{where}: needs {required!r} ({REQUIRED_HELP[required]})")
    named = entry[required]
    if required != "pattern" and (not isinstance(named, str) or not named):  # a pattern composes
        raise ValueError(
            f"{where}: {required!r} must be a string ({REQUIRED_HELP[required]}), got {named!r}"
        )
    for key in ("description", "paper", "complexity"):
        if not isinstance(entry.get(key, ""), str):
            raise ValueError(f"{where}: {key!r} must be a string, got {entry[key]!r}")
    params = entry.get("params") or {}
    if not isinstance(params, dict):
        raise ValueError(f"{where}: 'params' must be a mapping of parameter names to defaults")
    return {**entry, "params": params}


@dataclass(frozen=True)
class Unavailable:
    """An entry whose code does not import; using it raises ``message``."""

    name: str
    source: str
    reference: str  # the package.module:name that failed
    message: str  # the whole sentence: file, entry, module and fix

    def error(self) -> NotImportable:
        return NotImportable(self.message, self.reference)


@dataclass(frozen=True)
class Invalid:
    """An entry of a ``ZOO_REGISTRY`` file that failed its checks; using it raises ``message``."""

    name: str
    source: str
    message: str  # the whole sentence: file, entry and fix

    def error(self) -> ValueError:
        return ValueError(self.message)


Spec = VariantSpec | EncodingSpec | MechanismSpec


def parse_entry(section: str, name: str, entry: object, source: str) -> Spec:
    fields = check_entry(section, name, entry, source)
    spec = SPECS[section](name=name, source=source, **fields)
    where = f"{source}: {SINGULAR[section]} {name!r}"
    try:
        spec.validate()
    except NotImportable as error:
        raise NotImportable(f"{where}: {error}", error.reference) from error
    except (TypeError, ValueError) as error:
        raise ValueError(f"{where}: {error}") from error
    return spec


def parse_or_record(section: str, name: str, entry: object, source: str) -> Spec | Unavailable:
    """The parsed entry, or a record of why its code does not import."""
    try:
        return parse_entry(section, name, entry, source)
    except NotImportable as error:
        return Unavailable(name, source, error.reference, str(error))


class Registry:
    """The variants, mechanisms and encodings known in this process."""

    def __init__(self) -> None:
        self.variants: dict[str, VariantSpec] = {}
        self.positional: dict[str, EncodingSpec] = {}
        self.mechanisms: dict[str, MechanismSpec] = {}
        self.modules: dict[str, ModuleSpec] = {}  # attention modules with parameters (NSA)
        # entries whose code does not import, by section: using one raises its error
        self.unavailable: dict[str, dict[str, Unavailable]] = {s: {} for s in SECTION_KEYS}
        # entries of ZOO_REGISTRY files that failed their checks: using one raises its error
        self.invalid: dict[str, dict[str, Invalid]] = {s: {} for s in SECTION_KEYS}
        self.skipped: dict[str, str] = {}  # ZOO_REGISTRY files left out whole: file -> why
        self.files: list[str] = []

    def load(self, path: str | os.PathLike, *, strict: bool = True) -> list[str]:
        """Add a file's entries; returns the names it added (unavailable ones included).

        ``strict`` (``zoo.load_registry``): a bad file or entry raises, naming the file and the
        entry, and nothing of the file is added. Not strict (the files of ``ZOO_REGISTRY``):
        each problem is a RegistryWarning, and the file or the entry is left out as the module
        docstring says, so that the other entries, the zoo's own first, still work."""
        source = str(path)
        try:
            data = read_registry_file(path)
        except ValueError as error:
            if strict:
                raise
            self.skipped[source] = str(error)
            _warn(f"{error}; none of its entries are loaded, the zoo's own ones work as before")
            return []

        def parse(section: str, name: str, entry: object) -> Spec | Unavailable | Invalid:
            try:
                return parse_or_record(section, name, entry, source)
            except ValueError as error:
                if strict:
                    raise
                _warn(f"{error}; the entry is left out, and using {name!r} raises this error")
                return Invalid(name, source, f"{error} (the file is named in ZOO_REGISTRY)")

        parsed = {
            section: {n: parse(section, n, e) for n, e in data.get(section, {}).items()}
            for section in SECTION_KEYS
        }
        for sections in NAMESPACES:
            known = {}
            for section in sections:
                for name in list(parsed[section]):
                    earlier = self.entry(name, sections) or known.get(name)
                    if earlier is not None and not _loaded_again(earlier, parsed[section][name]):
                        message = (
                            f"{source}: {SINGULAR[section]} {name!r} is already defined in "
                            f"{earlier.source}; give it another name"
                        )
                        if strict:
                            raise ValueError(message)
                        _warn(f"{message}; the entry is left out, {name!r} keeps its meaning")
                        del parsed[section][name]
                        continue
                    known[name] = parsed[section][name]
        for section, entries in parsed.items():
            for name, entry in entries.items():
                if isinstance(entry, Unavailable):
                    self.unavailable[section][name] = entry
                elif isinstance(entry, Invalid):
                    self.invalid[section][name] = entry
                else:
                    getattr(self, section)[name] = entry
        self.files.append(source)
        return [name for entries in parsed.values() for name in entries]

    def add_code_variant(self, name: str, info: VariantInfo, replace: bool = False) -> None:
        """A family that ``register_pattern`` made a variant: its entry, as YAML would give it;
        a name already defined raises unless ``replace``."""
        taken = self.entry(name, NAMESPACES[0])
        if taken is not None and not (replace and name in self.variants):
            raise ValueError(
                f"variant {name!r} is already defined in {taken.source}; choose another name for "
                f"the pattern registered by {info.source}, or pass replace=True"
            )
        spec = VariantSpec(
            name=name, pattern=name, description=info.description, paper=info.paper,
            complexity=info.complexity, source=info.source,
        )  # fmt: skip
        try:
            spec.validate()  # its defaults build a pattern
        except (TypeError, ValueError) as error:
            raise ValueError(f"{info.source}: variant {name!r}: {error}") from error
        self.variants[name] = spec
        if taken is not None:
            clear_all()  # what was built with the entry it replaced (patterns, plans)

    def entry(self, name: str, sections: tuple[str, ...]) -> Spec | Unavailable | Invalid | None:
        """The entry of that name in one of the sections, available, unavailable or invalid."""
        for section in sections:
            found = (
                getattr(self, section).get(name)
                or self.unavailable[section].get(name)
                or self.invalid[section].get(name)
            )
            if found is not None:
                return found
        return None

    def raise_if_broken(self, section: str, name: object) -> None:
        """The error of an entry of that name that does not import or failed its checks."""
        if isinstance(name, str):
            found = self.unavailable[section].get(name) or self.invalid[section].get(name)
            if found is not None:
                raise found.error()

    def skipped_note(self) -> str:
        """For an unknown name: the ZOO_REGISTRY files that did not load, which may define it."""
        return "".join(
            f"; note: {path}, named in ZOO_REGISTRY, did not load ({why})"
            for path, why in self.skipped.items()
        )


def _loaded_again(
    earlier: Spec | Unavailable | Invalid, entry: Spec | Unavailable | Invalid
) -> bool:
    """Whether ``entry`` is ``earlier`` read again from the same file (named both in ZOO_REGISTRY
    and to load_registry, say, or by another spelling of its path): no second definition."""
    try:
        same_file = Path(earlier.source).resolve() == Path(entry.source).resolve()
    except (OSError, ValueError):
        return False
    return same_file and replace(entry, source=earlier.source) == earlier


def _warn(message: str) -> None:
    warnings.warn(f"{message} (the file is named in ZOO_REGISTRY)", RegistryWarning, stacklevel=2)


def _warn_code(message: str) -> None:
    warnings.warn(message, RegistryWarning, stacklevel=2)


_registry: Registry | None = None
# The registry while it is built: the ZOO_IMPORTS modules and the modules that ZOO_REGISTRY
# entries name register their one-file variants into it (and a module that uses the zoo as it
# is imported reads it), as a script's registrations go into the loaded registry.
_building: Registry | None = None


def registry() -> Registry:
    """The process-wide registry: the built-in file, the ``ZOO_IMPORTS`` modules' variants,
    then ``ZOO_REGISTRY`` files, on first use.

    A bad ``ZOO_REGISTRY`` file or entry is a RegistryWarning naming the file and the entry,
    and is left out (the module docstring says how); the built-in variants keep working."""
    _load_once()
    return _registry if _registry is not None else _building


@outside_graph  # a first zoo call inside torch.compile must not trace the files' reading
def _load_once() -> bool:
    global _registry, _building
    if _registry is not None or _building is not None:  # loaded, or being loaded
        return True
    fresh = Registry()
    fresh.load(BUILTIN_REGISTRY)
    for name, info in code_variants().items():  # registered before this load
        try:
            fresh.add_code_variant(name, info)
        except ValueError as error:
            _warn_code(f"{error}; the variant is left out")
    _building = fresh
    try:
        _import_user_modules()
        for path in filter(None, os.environ.get("ZOO_REGISTRY", "").split(os.pathsep)):
            fresh.load(path, strict=False)
    finally:
        _building = None
    _registry = fresh
    return True


def _import_user_modules() -> None:
    """Import the modules named in ``ZOO_IMPORTS`` (module names, ``os.pathsep``-separated):
    the one-file patterns they register are then variants by name wherever the registry is
    read, the command lines and the harness's workers included. A module that does not import
    is a RegistryWarning; the zoo's own variants work as before."""
    for module in filter(None, os.environ.get("ZOO_IMPORTS", "").split(os.pathsep)):
        try:
            importlib.import_module(module.strip())
        except Exception as error:  # any error of the user's module: warn, do not break zoo
            # sys.path is the fix only where the module itself was not found; an error raised
            # by its code (a taken name, a missing dependency) is fixed there
            missing = error.name if isinstance(error, ModuleNotFoundError) else None
            not_found = missing is not None and f"{module.strip()}.".startswith(f"{missing}.")
            found = "it was found: the error comes from its code"
            fix = "is it on sys.path (PYTHONPATH)?" if not_found else found
            _warn_code(
                f"ZOO_IMPORTS names {module!r}, which did not import "
                f"({type(error).__name__}: {error}); {fix}"
            )


def _add_code_variant(name: str, info: VariantInfo, replace: bool) -> None:
    """A family that ``register_pattern`` made a variant, added to the registry, loaded first
    if it is not: a taken name raises in the registering module, which then keeps no family of
    that name, wherever it is imported (a script, ZOO_IMPORTS, a ZOO_REGISTRY entry)."""
    registry().add_code_variant(name, info, replace)


on_variant(_add_code_variant)


def load_registry(path: str | os.PathLike) -> list[str]:
    """Add the variants and encodings of a user's YAML file; returns their names. A bad file or
    entry raises a ValueError naming the file and the entry, and adds nothing."""
    return registry().load(path)


def list_variants(pattern: str = "*") -> list[str]:
    """Variant names matching a glob, e.g. ``zoo.list_variants("*local*")``: the patterns, each
    a set of pairs that softmax attention may use. ``list_mechanisms`` lists the mechanisms,
    ``list_attention`` both: every name that ``variant=`` takes."""
    return sorted(fnmatch.filter(registry().variants, pattern))


def list_mechanisms(pattern: str = "*") -> list[str]:
    """Mechanism names matching a glob: attention computed differently (``zoo.mechanisms``)."""
    return sorted(fnmatch.filter(registry().mechanisms, pattern))


def list_attention(pattern: str = "*") -> list[str]:
    """Every name ``variant=`` takes, variants and mechanisms, matching a glob."""
    return sorted(list_variants(pattern) + list_mechanisms(pattern))


def is_mechanism_name(name: object) -> bool:
    """Whether a name is a registry mechanism (importable or not)."""
    return isinstance(name, str) and registry().entry(name, ("mechanisms",)) is not None


def get_mechanism_spec(name: str) -> MechanismSpec:
    return _lookup("mechanisms", "mechanism", name, "zoo.list_mechanisms()")


def unavailable(section: str = "variants") -> dict[str, Unavailable]:
    """Entries of a section ("variants", "mechanisms" or "positional") whose code does not
    import, by name."""
    return dict(registry().unavailable[section])


def get_spec(name: str) -> VariantSpec:
    if not isinstance(name, str):
        raise TypeError(
            "variant must be a registry name (a str: zoo.list_attention() lists them), a "
            "zoo.patterns.Pattern or a mechanism instance (zoo.mechanisms), got "
            f"{_shown(name)} ({type(name).__name__})"
        )
    variants = registry().variants
    for section in ("variants", "modules"):  # create_attention's names include modules
        registry().raise_if_broken(section, name)
    if is_mechanism_name(name):
        raise ValueError(
            f"{name!r} is a mechanism (zoo.list_mechanisms()), computed differently rather than "
            "masked: it has no pattern, mask or backend; zoo.get_mechanism_spec gives its entry"
        )
    if name in registry().modules:  # zoo list shows it among the variants
        raise ValueError(
            f"{name!r} is an attention module (zoo.list_modules()) with branches of its own, "
            f"built by zoo.create_attention({name!r}, dim=..., num_heads=...): it has no single "
            "pattern, mask or backend; zoo.get_module_spec gives its entry"
        )
    if name not in variants:
        known = [*variants, *registry().mechanisms]  # a misspelt mechanism gets its suggestion
        message = suggest("variant", name, known, "zoo.list_attention()")
        raise ValueError(message + registry().skipped_note())
    return variants[name]


def _shown(value: object) -> str:
    """A value's repr, cut short for a message."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def list_modules(pattern: str = "*") -> list[str]:
    """Attention modules with their own parameters (``modules:`` section), e.g. ``nsa``."""
    return sorted(fnmatch.filter(registry().modules, pattern))


def get_module_spec(name: str) -> ModuleSpec:
    return _lookup("modules", "module", name, "zoo.list_modules()")


def list_encodings(pattern: str = "*") -> list[str]:
    """Positional encoding names matching a glob."""
    return sorted(fnmatch.filter(registry().positional, pattern))


def get_encoding_spec(name: str) -> EncodingSpec:
    return _lookup("positional", "encoding", name, "zoo.list_encodings()")


def _lookup(section: str, kind: str, name: object, listing: str):
    """The entry ``name`` of a registry section, or the import error of an entry that does not
    load, or an error naming the unknown ``kind`` with the nearest names and where to list them."""
    if not isinstance(name, str):
        article = "an" if kind[0] in "aeiou" else "a"
        raise TypeError(
            f"{article} {kind} is named by a str ({listing} lists them), got {_shown(name)} "
            f"({type(name).__name__})"
        )
    entries = getattr(registry(), section)
    registry().raise_if_broken(section, name)
    if name not in entries:
        raise ValueError(suggest(kind, name, entries, listing) + registry().skipped_note())
    return entries[name]
