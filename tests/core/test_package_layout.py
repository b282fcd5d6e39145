"""The package's rooms (ARCHITECTURE.md): a module's file name names it alone, and ``zoo.layout``
answers the names of its block layouts (``zoo.layout.block_layout``)."""

from __future__ import annotations

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
