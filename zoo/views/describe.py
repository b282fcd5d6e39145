"""The registry as tables, for the terminal and for the README and the docs pages (which a test
keeps in step).

A page holds a generated table between two markers::

    <!-- variants:start -->
    ...
    <!-- variants:end -->

where the name is one of ``TABLES`` (computed from the registry), or ``from PATH "Heading"``:
the first markdown table under that heading of a committed result file (PATH relative to the
repository's root; an empty heading takes the file's first table), so that a measurement on a
page is copied from the file that recorded it, never retyped. ``zoo readme`` fills them.
"""

from __future__ import annotations

import re
from pathlib import Path

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
        params = spec.params or spec.parameters()  # a variant registered in code: its defaults
        row = [f"`{name}`", pattern, format_params(params), spec.description, spec.complexity]
        rows.append(row)
    for name in list_modules():  # mechanisms with parameters of their own (NSA)
        spec = get_module_spec(name)
        rows.append(
            [f"`{name}`", "module", format_params(spec.params), spec.description, spec.complexity]
        )
    for name, entry in sorted(unavailable("variants").items()):
        rows.append([f"`{name}`", "-", "-", unavailable_note(entry), "-"])
    return markdown_table(["variant", "pattern", "parameters", "description", "complexity"], rows)


def variant_summary() -> str:
    """The variants in one line each, for the README's front page (the docs show every column)."""
    rows = [[f"`{n}`", get_spec(n).description, get_spec(n).complexity] for n in list_variants()]
    for name in list_modules():
        spec = get_module_spec(name)
        rows.append([f"`{name}`", spec.description, spec.complexity])
    for name in list_mechanisms():
        spec = get_mechanism_spec(name)
        rows.append([f"`{name}`", spec.description, spec.complexity])
    return markdown_table(["variant", "what it attends", "complexity"], rows)


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
    "variant-summary": variant_summary,
    "mechanisms": mechanism_table,
    "encodings": encoding_table,
    "comparison": comparison,
}

MARKED = re.compile(r"<!-- (?P<name>[^\n]*?):start -->\n(?P<body>.*?)<!-- (?P=name):end -->", re.S)
_FROM_FILE = re.compile(r'from (?P<path>\S+) "(?P<heading>[^"]*)"')


def table_in_file(path: Path, heading: str = "") -> str:
    """The first markdown table under ``heading`` (a heading line's text, any level) of a
    markdown file; with no heading, the file's first table. ValueError naming what is missing."""
    if not path.is_file():  # a marker's misspelt PATH: a sentence, not read_text's traceback
        raise ValueError(f"{path} is not a file (the result file a 'from PATH' marker copies)")
    lines = path.read_text().splitlines()
    start = 0
    if heading:
        title = re.compile(rf"#+ {re.escape(heading)}")
        found = [i for i, line in enumerate(lines) if title.fullmatch(line)]
        if not found:
            raise ValueError(f"{path} has no heading {heading!r}")
        start = found[0] + 1
    table = []
    for line in lines[start:]:
        if line.startswith("|"):
            table.append(line)
        elif table:
            break
    if not table:
        raise ValueError(f"{path} has no table" + (f" under {heading!r}" if heading else ""))
    return "\n".join(table)


def generated_table(name: str, root: Path) -> str:
    """The table a marker names: a registry table, or one copied from a result file."""
    if name in TABLES:
        return TABLES[name]()
    source = _FROM_FILE.fullmatch(name)
    if source is None:
        known = ", ".join(TABLES)
        raise ValueError(
            f"generated table {name!r} is neither one of {known} nor 'from PATH \"Heading\"'"
        )
    return table_in_file(root / source["path"], source["heading"])


def update_generated(path: str | Path, root: str | Path = ".") -> bool:
    """Rewrite each generated table between its markers in one file; True if anything changed.
    ValueError for a file with no markers (a wrong path) or a marker that names no table."""
    return update_pages([path], root)[0]


def update_pages(paths: list[str | Path], root: str | Path = ".") -> list[bool]:
    """``update_generated`` for several pages, each True if it changed. Every page is filled
    before any is written, so that a bad page or marker fails with no page changed."""
    filled = [_filled(Path(path), Path(root)) for path in paths]
    for path, text, new in filled:
        if new != text:
            path.write_text(new)
    return [new != text for _, text, new in filled]


def _filled(path: Path, root: Path) -> tuple[Path, str, str]:
    """(path, its text, its text with every generated table filled)."""
    if not path.is_file():
        raise ValueError(f"{path} is not a file (a README or a docs page to fill)")
    text = path.read_text()
    if not MARKED.search(text):
        raise ValueError(f"{path} has no <!-- NAME:start --> ... <!-- NAME:end --> markers to fill")

    def fill(match: re.Match) -> str:
        name = match["name"]
        return f"<!-- {name}:start -->\n{generated_table(name, root)}\n<!-- {name}:end -->"

    return path, text, MARKED.sub(fill, text)


def pages_with_tables(root: str | Path = ".") -> list[Path]:
    """The README and every docs page that holds a generated table."""
    root = Path(root)
    pages = [root / "README.md", *sorted((root / "docs").rglob("*.md"))]
    return [page for page in pages if page.is_file() and MARKED.search(page.read_text())]
