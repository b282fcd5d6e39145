"""The package's rooms (ARCHITECTURE.md): a module's file name names it alone, and ``zoo.layout``
answers the names of its block layouts (``zoo.layout.block_layout``), and imports run one way."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import zoo


def test_names_of_the_block_layouts_resolve_in_the_layout_package():
    from zoo.layout import allowed_pairs, build_layout
    from zoo.layout.block_layout import allowed_pairs as layout_pairs
    from zoo.layout.block_layout import build_layout as layout_build

    assert (build_layout, allowed_pairs) == (layout_build, layout_pairs)
    with pytest.raises(AttributeError, match=r"module 'zoo\.layout' has no attribute 'nothing'"):
        zoo.layout.nothing  # noqa: B018


def test_no_two_modules_share_a_basename():
    names = [p.name for p in Path(zoo.__file__).parent.rglob("*.py")]
    shared = {n for n in names if names.count(n) > 1} - {"__init__.py", "base.py"}
    assert not shared


def _imports(root: Path, package: str) -> dict[str, set[str]]:
    """Each module of ``package`` -> the package's modules it imports anywhere (function-level
    and TYPE_CHECKING imports included)."""
    paths = {}
    for path in (root / package).rglob("*.py"):
        parts = list(path.relative_to(root).with_suffix("").parts)
        paths[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in paths.items():
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                parts = here.split(".")
                base = parts[: len(parts) - node.level + 1] if node.level else []
                target = ".".join([*base, *([node.module] if node.module else [])])
                found |= {target, *(f"{target}.{alias.name}" for alias in node.names)}
            elif isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
        graph[name] = {m for m in found if m in paths and m != name}
    return graph


@pytest.mark.parametrize("package", ["zoo", "eval"])
def test_no_import_cycle_in_the_packages(package):
    """Imports run one way inside each package, function-level ones too (ARCHITECTURE.md)."""
    graph = _imports(Path(__file__).resolve().parents[2], package)
    state: dict[str, int] = {}  # 1: on the path being walked, 2: done

    def walk(module: str, path: list[str]) -> None:
        state[module] = 1
        for other in sorted(graph[module]):
            if state.get(other) == 1:
                cycle = [*path[path.index(other) :], other]
                raise AssertionError(f"import cycle: {' -> '.join(cycle)}")
            if other not in state:
                walk(other, [*path, other])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            walk(module, [module])
