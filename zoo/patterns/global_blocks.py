"""``global_blocks``: BigBird's global blocks, at the start of the sequence or at both its ends.

``num_blocks`` blocks of ``block_size`` positions are global (they attend to every key and every
query attends to them, as in ``global``), placed by ``position``:

- ``"first_last"``: the first ceil(g / 2) blocks and the last floor(g / 2) blocks, g =
  ``num_blocks``. With g = 2 this is BigBird's ITC form as Hugging Face implements it (the first and
  the last block; ``BigBirdBlockSparseAttention``, ``global_block_left = global_block_right = 1``).
  The last block is the one holding the last key, ``(kv_len - 1) // block_size``, shorter when the
  length is not a multiple of ``block_size``.
- ``"first"``: blocks 0 .. g - 1, what ``global: {global_tokens: g, block_size: b}`` gives.

Blocks that coincide at short lengths (first and last of a one-block sequence) count once, and
a sequence of g blocks or fewer is global throughout (no error, unlike ``global``, whose block
indices are fixed)::

    num_blocks=2, block_size=2, position="first_last" (8x8)
    x x x x x x x x
    x x x x x x x x
    x x . . . . x x
    x x . . . . x x
    x x . . . . x x
    x x . . . . x x
    x x x x x x x x
    x x x x x x x x

At a length the pattern is ``Global`` with the block indices above (``specialize``), so its three
views are ``Global``'s. Causal form: ``"first"`` blocks only (the last floor(g / 2) blocks
dropped). A last block moves with the length: while decoding, every new token would sit in it
and read every key, so a prefix would not see what it saw alone; and under ``causal`` no earlier
query can read a last block anyway. ``"first_last"`` made causal is therefore the first
ceil(g / 2) blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..core.arguments import check_int
from .base import Pattern
from .families import register_pattern
from .global_tokens import Global

POSITIONS = ("first_last", "first")


def check_position(name: str, value: object) -> str:
    """One of ``POSITIONS``, naming the argument and the choices otherwise."""
    if value not in POSITIONS:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, POSITIONS))}, got {value!r}")
    return value  # type: ignore[return-value]


def global_block_indices(count: int, position: str, num_blocks: int) -> tuple[int, ...]:
    """The sorted global block indices among ``num_blocks`` blocks (the module docstring)."""
    if position == "first":
        first, last = count, 0
    else:
        first, last = (count + 1) // 2, count // 2
    chosen = set(range(min(first, num_blocks)))
    chosen |= set(range(max(num_blocks - last, 0), num_blocks))
    return tuple(sorted(chosen))


@register_pattern("global_blocks")
@dataclass(frozen=True)
class GlobalBlocks(Pattern):
    """``num_blocks`` global blocks placed by ``position``; see the module docstring."""

    num_blocks: int = 2
    block_size: int = 64
    position: str = "first_last"

    def __post_init__(self) -> None:
        check_int("num_blocks", self.num_blocks)
        check_int("block_size", self.block_size)
        check_position("position", self.position)

    @property
    def constant_block(self) -> int:
        return self.block_size

    def specialize(self, q_len: int, kv_len: int, device: torch.device | None = None) -> Pattern:
        blocks = (kv_len - 1) // self.block_size + 1
        chosen = global_block_indices(self.num_blocks, self.position, blocks)
        return Global(chosen, self.block_size).specialize(q_len, kv_len, device)

    def causal_form(self) -> Pattern:
        if self.position == "first":
            return self
        return GlobalBlocks((self.num_blocks + 1) // 2, self.block_size, "first")

    def _needs_lengths(self, *args: object) -> Tensor:
        raise TypeError(
            "global blocks at the end need their lengths first: call specialize(q_len, kv_len)"
        )

    allowed = block_state = dense = _needs_lengths  # type: ignore[assignment]
