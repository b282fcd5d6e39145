"""The registry as a table, for the terminal and for the README (which a test keeps in step)."""

from __future__ import annotations

from collections.abc import Sequence

from .registry import get_spec, list_variants


def format_params(params: dict[str, object]) -> str:
    return ", ".join(f"{k}={v}" for k, v in params.items()) or "-"


def variant_rows() -> list[list[str]]:
    rows = []
    for name in list_variants():
        spec = get_spec(name)
        pattern = spec.pattern if isinstance(spec.pattern, str) else "composition"
        rows.append(
            [f"`{name}`", pattern, format_params(spec.params), spec.description, spec.complexity]
        )
    return rows


VARIANT_HEADERS = ["variant", "pattern", "parameters", "description", "complexity"]


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub markdown table, its columns padded to line up in a terminal too."""
    cells = [[str(h) for h in headers], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]

    def line(row: Sequence[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |"

    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(cells[0]), rule, *(line(r) for r in cells[1:])])


def variant_table() -> str:
    return markdown_table(VARIANT_HEADERS, variant_rows())


START, END = "<!-- variants:start -->", "<!-- variants:end -->"


def update_readme(path: str) -> bool:
    """Rewrite the variant table between the README's markers; True if it changed."""
    with open(path) as f:
        text = f.read()
    if START not in text or END not in text:
        raise ValueError(f"{path} has no {START} ... {END} markers to fill")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    new = f"{head}{START}\n{variant_table()}\n{END}{tail}"
    if new != text:
        with open(path, "w") as f:
            f.write(new)
    return new != text
