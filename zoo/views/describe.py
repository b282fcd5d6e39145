"""The registry as tables, for the terminal and for the README (which a test keeps in step)."""

from __future__ import annotations

from ..registry import (
    Unavailable,
    get_encoding_spec,
    get_mechanism_spec,
    get_module_spec,
    get_spec,
    list_encodings,
    list_mechanisms,
    list_modules,
    list_variants,
    unavailable,
)
from .comparison import comparison_table
from .tables import format_params, markdown_table


def unavailable_note(entry: Unavailable) -> str:
    return f"UNAVAILABLE: {entry.reference} does not import (using {entry.name!r} says why)"


def variant_table() -> str:
    rows = []
    for name in list_variants():
        spec = get_spec(name)
        pattern = spec.pattern if isinstance(spec.pattern, str) else "composition"
        rows.append(
            [f"`{name}`", pattern, format_params(spec.params), spec.description, spec.complexity]
        )
    for name in list_modules():  # mechanisms with parameters of their own (NSA)
        spec = get_module_spec(name)
        rows.append(
            [f"`{name}`", "module", format_params(spec.params), spec.description, spec.complexity]
        )
    for name, entry in sorted(unavailable("variants").items()):
        rows.append([f"`{name}`", "-", "-", unavailable_note(entry), "-"])
    return markdown_table(["variant", "pattern", "parameters", "description", "complexity"], rows)


def mechanism_table() -> str:
    """The mechanisms with their parameters and what each supports (``zoo.mechanisms.base``)."""
    rows = []
    for name in list_mechanisms():
        spec = get_mechanism_spec(name)
        cls = spec.mechanism_class()
        yes = {True: "yes", False: "no"}
        rows.append(
            [
                f"`{name}`",
                format_params(spec.parameters()),
                spec.description,
                spec.complexity,
                yes[cls.causal],
                yes[cls.key_padding],
                yes[cls.cross],
            ]
        )
    for name, entry in sorted(unavailable("mechanisms").items()):
        rows.append([f"`{name}`", "-", unavailable_note(entry), "-", "-", "-", "-"])
    headers = ["mechanism", "parameters", "description", "complexity", "causal", "key padding"]
    return markdown_table([*headers, "Lq != Lk"], rows)


def encoding_table() -> str:
    rows = []
    for name in list_encodings():
        spec = get_encoding_spec(name)
        rows.append([f"`{name}`", spec.kind, format_params(spec.parameters()), spec.description])
    for name, entry in sorted(unavailable("positional").items()):
        rows.append([f"`{name}`", "-", "-", unavailable_note(entry)])
    return markdown_table(["encoding", "kind", "parameters", "description"], rows)


def comparison() -> str:
    return comparison_table(1024, 2)


TABLES = {
    "variants": variant_table,
    "mechanisms": mechanism_table,
    "encodings": encoding_table,
    "comparison": comparison,
}


def update_readme(path: str) -> bool:
    """Rewrite each generated table between its README markers; True if anything changed."""
    with open(path) as f:
        text = f.read()
    new = text
    for name, table in TABLES.items():
        start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
        if start not in new or end not in new:
            raise ValueError(f"{path} has no {start} ... {end} markers to fill")
        head, rest = new.split(start, 1)
        _, tail = rest.split(end, 1)
        new = f"{head}{start}\n{table()}\n{end}{tail}"
    if new != text:
        with open(path, "w") as f:
            f.write(new)
    return new != text
