"""Positional encodings: how position enters attention, through one of three hooks.

``ENCODINGS`` maps each name to its class; every class is built the same way,
``ENCODINGS[name](dim=..., num_heads=..., causal=..., **params)``, and its ``kind`` names the hook
a backend must call (see ``base``).

========== ======== ============================================= ==============================
name       kind     params (defaults)                             paper
========== ======== ============================================= ==============================
none       none     (none)                                        -
sinusoidal embed    base=10000.0, dropout=0.0                     Vaswani et al. 2017
learned    embed    max_len=2048, dropout=0.0                     Gehring et al. 2017; GPT-2
rope       rotate   base=10000.0, rotary_fraction=1.0             Su et al. 2021 (RoFormer)
alibi      bias     (none)                                        Press et al. 2022
t5         bias     num_buckets=32, max_distance=128              Raffel et al. 2020
========== ======== ============================================= ==============================
"""

from __future__ import annotations

from ..core.arguments import import_object
from ..core.named import Named
from .alibi import AlibiEncoding, alibi_slopes
from .base import PositionalEncoding
from .learned import LearnedEncoding
from .none import NoPositionalEncoding
from .plot import draw_encoding
from .rope import RotaryEncoding
from .sinusoidal import SinusoidalEncoding
from .t5 import T5RelativeBias, relative_position_bucket

ENCODINGS: Named[type[PositionalEncoding]] = Named(
    "encoding class",
    "zoo.positional.ENCODINGS",
    {
        cls.name: cls
        for cls in (
            NoPositionalEncoding,
            SinusoidalEncoding,
            LearnedEncoding,
            RotaryEncoding,
            AlibiEncoding,
            T5RelativeBias,
        )
    },
)


def register_encoding(
    cls: type[PositionalEncoding], *, replace: bool = False
) -> type[PositionalEncoding]:
    """Class decorator: make a user's encoding nameable by its ``name`` in registry files.

    The class subclasses ``PositionalEncoding``, sets ``name`` and ``kind`` and takes
    ``dim``, ``num_heads`` and ``causal`` plus its own keyword parameters.
    """
    if not (isinstance(cls, type) and issubclass(cls, PositionalEncoding)):
        raise TypeError(f"register_encoding takes a PositionalEncoding subclass, got {cls!r}")
    return ENCODINGS.add(cls.name, cls, replace=replace)


def resolve_encoding(name: str) -> type[PositionalEncoding]:
    """An encoding class by registered name, or as ``package.module:Class``."""
    if ":" in name:
        cls = import_object(name, "encoding")
        if not (isinstance(cls, type) and issubclass(cls, PositionalEncoding)):
            raise ValueError(f"encoding {name!r} is not a PositionalEncoding subclass")
        return cls
    return ENCODINGS.lookup(name)


__all__ = [
    "ENCODINGS",
    "AlibiEncoding",
    "LearnedEncoding",
    "NoPositionalEncoding",
    "PositionalEncoding",
    "RotaryEncoding",
    "SinusoidalEncoding",
    "T5RelativeBias",
    "alibi_slopes",
    "draw_encoding",
    "register_encoding",
    "relative_position_bucket",
    "resolve_encoding",
]
