"""Mechanisms: attention computed differently rather than masked (see ``base``).

``MECHANISMS`` maps each class name to its class; registry entries (the ``mechanisms:`` section
of ``registry.yaml``) name one with default parameters. ``zoo.attention``, ``MultiHeadAttention``
and ``create_attention`` take a mechanism's name wherever they take a variant's.

========== ========================================== ============== ====== =========== =====
name       params (defaults)                          cost           causal key padding Lq≠Lk
========== ========================================== ============== ====== =========== =====
linear     chunk_size=64                              O(n·d²)        yes    yes         yes
performer  num_features=d·ln d, seed=0,               O(n·m·d)       yes    yes         yes
           redraw_interval=None, chunk_size=64
linformer  proj_len=256, max_len=4096 (learned)       O(n·k·d)       no     yes         yes
nystrom    num_landmarks=64, pinv_iterations=6,       O(n·m·d + m³)  no     yes         yes*
           conv_kernel=None
========== ========================================== ============== ====== =========== =====

\\* not with conv_kernel. All take rotary positions and grouped-query k, v; none takes a score
bias (ALiBi, T5), dropout or return_weights.
"""

from __future__ import annotations

from ..core.arguments import import_object
from ..core.named import Named
from .base import Mechanism
from .linear import LinearAttention
from .linformer import LinformerAttention
from .nystrom import NystromAttention
from .performer import PerformerAttention

MECHANISMS: Named[type[Mechanism]] = Named(
    "mechanism class",
    "zoo.mechanisms.MECHANISMS",
    {
        cls.family: cls
        for cls in (LinearAttention, PerformerAttention, LinformerAttention, NystromAttention)
    },
)


def register_mechanism(cls: type[Mechanism], *, replace: bool = False) -> type[Mechanism]:
    """Class decorator: make a user's mechanism nameable by its ``family`` in registry files."""
    if not (isinstance(cls, type) and issubclass(cls, Mechanism)):
        raise TypeError(f"register_mechanism takes a Mechanism subclass, got {cls!r}")
    return MECHANISMS.add(cls.family, cls, replace=replace)


def resolve_mechanism(name: str) -> type[Mechanism]:
    """A mechanism class by registered name, or as ``package.module:Class``."""
    if ":" in name:
        cls = import_object(name, "mechanism")
        if not (isinstance(cls, type) and issubclass(cls, Mechanism)):
            raise ValueError(f"mechanism {name!r} is not a zoo.mechanisms.Mechanism subclass")
        return cls
    return MECHANISMS.lookup(name)


__all__ = [
    "MECHANISMS",
    "LinearAttention",
    "LinformerAttention",
    "Mechanism",
    "NystromAttention",
    "PerformerAttention",
    "register_mechanism",
    "resolve_mechanism",
]
