"""Old import paths of modules that moved into rooms by purpose (``zoo.frames`` is now
``zoo.layout.frames``, ...): importing an old name gives the module at its new place, the same
object, so that code and ``monkeypatch`` strings written against the old layout keep working."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from types import ModuleType

MOVED = {
    "zoo.backends.block_plan": "zoo.backends.blocked.block_plan",
    "zoo.backends.blocked_by_key": "zoo.backends.blocked.by_key",
    "zoo.backends.blocked_merged": "zoo.backends.blocked.merged",
    "zoo.backends.blocked.lse_merge": "zoo.backends.lse_merge",
    "zoo.backends.blocked_routed": "zoo.backends.blocked.chosen_union",
    "zoo.backends.key_windows": "zoo.backends.blocked.key_windows",
    "zoo.backends.row_grid": "zoo.backends.blocked.row_grid",
    "zoo.backends.wide_queries": "zoo.backends.blocked.wide_queries",
    "zoo.backends.xformers_plan": "zoo.backends.xformers.plan",
    "zoo.block_sums": "zoo.decoding.block_sums",
    "zoo.cache": "zoo.decoding.cache",
    "zoo.call": "zoo.core.call",
    "zoo.check": "zoo.testing.check",
    "zoo.check_routed": "zoo.testing.check_routed",
    "zoo.checks": "zoo.core.arguments",
    "zoo.comparison": "zoo.views.comparison",
    "zoo.decode": "zoo.decoding.decode",
    "zoo.decode_flex": "zoo.backends.flex_decode",
    "zoo.decoding.decode_flex": "zoo.backends.flex_decode",
    "zoo.describe": "zoo.views.describe",
    "zoo.frames": "zoo.layout.frames",
    "zoo.generation": "zoo.decoding.generation",
    "zoo.graph_pictures": "zoo.views.graph_pictures",
    "zoo.index_rows": "zoo.backends.blocked.index_rows",
    "zoo.mechanisms.call": "zoo.mechanisms.dispatch",
    "zoo.mechanisms.module": "zoo.mechanisms.layer",
    "zoo.mechanisms.spec": "zoo.registry.mechanism_spec",
    "zoo.module_spec": "zoo.registry.module_spec",
    "zoo.node_order": "zoo.patterns.node_order",
    "zoo.nsa": "zoo.modules.nsa",
    "zoo.paths": "zoo.views.paths",
    "zoo.patterns.registry": "zoo.patterns.families",
    "zoo.pictures": "zoo.views.pictures",
    "zoo.positional.spec": "zoo.registry.encoding_spec",
    "zoo.scores": "zoo.core.scores",
    "zoo.shape_cache": "zoo.core.shape_cache",
    "zoo.tables": "zoo.views.tables",
    "zoo.tiles": "zoo.layout.tiles",
    "zoo.variants": "zoo.registry.variants",
}


_OWN = ("__spec__", "__name__", "__package__", "__loader__")


class _Alias(importlib.abc.Loader):
    def __init__(self, new: str) -> None:
        self.new = new
        self.own: dict[str, object] = {}

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(self.new)
        self.own = {name: getattr(module, name) for name in _OWN}
        return module

    def exec_module(self, module: ModuleType) -> None:
        """The module ran at its new place; the import machinery set the old name's spec on it,
        which relative imports and ``importlib.reload`` read: its own go back."""
        for name, value in self.own.items():
            setattr(module, name, value)


class _MovedFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        new = MOVED.get(name)
        if new is None:
            return None
        return importlib.machinery.ModuleSpec(name, _Alias(new))


def install() -> None:
    """Answer the old names (once per process)."""
    if not any(isinstance(finder, _MovedFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _MovedFinder())  # before a stale file of an old name


install()
