"""``Named``: things of one kind by name, the one mechanism behind ``register_pattern``,
``register_mechanism``, ``register_encoding`` and ``register_backend``.

A name is registered once: a second thing under a taken name raises, naming both, unless the
caller asks to replace it; registering the same thing again is a no-op. A lookup of an unknown
name raises with the nearest names and where to list them. A ``Named`` is a dict, so code that
reads it as one (``name in MECHANISMS``, ``sorted(ENCODINGS)``) keeps working.
"""

from __future__ import annotations

from typing import TypeVar

from .arguments import suggest
from .shape_cache import clear_all

T = TypeVar("T")


class Named(dict[str, T]):
    def __init__(self, kind: str, listing: str, items: dict[str, T] | None = None) -> None:
        super().__init__(items or {})
        self.kind = kind  # "pattern family", "mechanism", ...: the word in messages
        self.listing = listing  # where a user lists the names, e.g. "zoo.list_backends()"

    def add(self, name: str, thing: T, *, replace: bool = False) -> T:
        """Register ``thing`` as ``name``; a name taken by another thing raises unless
        ``replace``."""
        taken = self.get(name)
        if taken is not None and taken is not thing and not replace:
            raise ValueError(
                f"{self.kind} {name!r} is already registered (by {_origin(taken)}); choose "
                "another name or pass replace=True"
            )
        self[name] = thing
        if taken is not None and taken is not thing:
            clear_all()  # a name's meaning changed: what was built with the old one goes
        return thing

    def lookup(self, name: str) -> T:
        """The thing registered as ``name``, or a ValueError with the nearest names."""
        if name not in self:
            raise ValueError(suggest(self.kind, name, self, self.listing))
        return self[name]

    def copy(self) -> Named[T]:
        return Named(self.kind, self.listing, dict(self))


def _origin(thing: object) -> str:
    module = getattr(thing, "__module__", None) or type(thing).__module__
    return module
