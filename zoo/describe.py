"""The registry as tables, for the terminal and for the README (which a test keeps in step)."""

from __future__ import annotations

from collections.abc import Sequence

from .registry import get_encoding_spec, get_spec, list_encodings, list_variants


def format_params(params: dict[str, object]) -> str:
    return ", ".join(f"{k}={v}" for k, v in params.items()) or "-"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub markdown table, its columns padded to line up in a terminal too."""
    cells = [[str(h) for h in headers], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]

    def line(row: Sequence[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |"

    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(cells[0]), rule, *(line(r) for r in cells[1:])])


def variant_table() -> str:
    rows = []
    for name in list_variants():
        spec = get_spec(name)
        pattern = spec.pattern if isinstance(spec.pattern, str) else "composition"
        rows.append(
            [f"`{name}`", pattern, format_params(spec.params), spec.description, spec.complexity]
        )
    return markdown_table(["variant", "pattern", "parameters", "description", "complexity"], rows)


def encoding_table() -> str:
    rows = []
    for name in list_encodings():
        spec = get_encoding_spec(name)
        rows.append([f"`{name}`", spec.kind, format_params(spec.parameters()), spec.description])
    return markdown_table(["encoding", "kind", "parameters", "description"], rows)


def comparison() -> str:
    from .comparison import comparison_table

    return comparison_table(1024, 2)


TABLES = {"variants": variant_table, "encodings": encoding_table, "comparison": comparison}


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
