"""Modules that moved into rooms by purpose still import under their old names (``zoo._moved``):
the same module object, so code and monkeypatch strings written against the old layout work."""

from __future__ import annotations

import importlib

import pytest

import zoo
from zoo._moved import MOVED


@pytest.mark.parametrize(("old", "new"), sorted(MOVED.items()))
def test_an_old_name_is_the_module_at_its_new_place(old, new):
    assert importlib.import_module(old) is importlib.import_module(new)


def test_names_of_the_old_layout_module_resolve_in_the_package():
    from zoo.layout import allowed_pairs, build_layout
    from zoo.layout.block_layout import allowed_pairs as moved_pairs
    from zoo.layout.block_layout import build_layout as moved_layout

    assert (build_layout, allowed_pairs) == (moved_layout, moved_pairs)
    with pytest.raises(AttributeError, match=r"module 'zoo\.layout' has no attribute 'nothing'"):
        zoo.layout.nothing  # noqa: B018


def test_a_monkeypatch_through_an_old_name_reaches_the_new_module(monkeypatch):
    import zoo.backends.blocked.lse_merge as old

    monkeypatch.setattr("zoo.backends.blocked.lse_merge.CHUNK_BYTES", 123)
    assert zoo.backends.lse_merge.CHUNK_BYTES == 123 == old.CHUNK_BYTES


def test_no_two_modules_share_a_basename():
    from pathlib import Path

    names = [p.name for p in Path(zoo.__file__).parent.rglob("*.py")]
    shared = {n for n in names if names.count(n) > 1} - {"__init__.py", "base.py"}
    assert not shared


@pytest.mark.parametrize(("old", "new"), sorted(MOVED.items()))
def test_importing_an_old_name_leaves_the_module_its_own_spec(old, new):
    """The import machinery set the old name's spec on the module, which relative imports and
    importlib.reload read (an ImportWarning, then a failed relative import after a reload)."""
    module = importlib.import_module(old)
    assert module.__spec__.name == module.__name__ == new
