"""A fixed pattern's mask_mod as one table lookup, where the pattern is constant on squares of
positions (``Pattern.constant_block``): BigBird, block_local, global blocks and their unions.

FlexAttention calls the mask_mod on every pair of a partial block. A pattern built of block
families evaluates each family there: BigBird's three (a window of blocks, global blocks, and a
comparison per random block drawn). Where the pattern allows every pair or none of each b x b
square, one read of a [query squares, key squares] table (per head for a layout drawn per head)
gives the same answer; a causal member stays the comparison of positions it is. With 64-position
BigBird blocks on flex's 128-position blocks almost every computed block is partial (717 of 781
at 8K tokens), so this is the mask_mod that runs.

The table is built per shape with the block mask, from the pattern's block states at the
square size: only where none of them is PARTIAL (a square's padding slots, past the sequence,
do not count) is it used; elsewhere, or where it would hold more than ``LOOKUP_MOST`` entries,
the pattern's own mask_mod serves.

GPUs only (``flex._slot_mask``): Inductor's CPU kernel vectorises the families' arithmetic,
and a gather per pair cost more there than it saved (eval/results/design-notes-cpu.md#flex-lookup).
And only where the pattern's own mask_mod evaluates several families or draws random blocks
(``lookup_pays``): a single structured family (block_local, global blocks) is one or two integer
comparisons per pair, which a gather does not beat (eval/results/gpu-campaign-h100-2026-11-27).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..core.shape_cache import per_shape
from ..layout.frames import build_frame
from ..patterns import FULL, PARTIAL, Pattern
from ..patterns.compose import Intersection, Union
from ..patterns.random_blocks import Random, RandomBlocks

LOOKUP_MOST = 1 << 26  # table entries (64 MiB of bools): 16 heads x 2048^2 squares at 128K
LEAST_SQUARE = 16  # a smaller square's table would grow as n^2 / 256 or worse


def lookup_pays(pattern: Pattern) -> bool:
    """Whether a table lookup is worth more than the pattern's own mask_mod: its non-causal part
    is several families (a union or intersection) or random blocks (a comparison per block
    drawn), not one structured family's comparisons."""
    members = pattern.children if isinstance(pattern, Intersection) else (pattern,)
    rest = [m for m in members if m.kind != "causal"]
    if len(rest) != 1:
        return len(rest) > 1
    return isinstance(rest[0], (Union, Intersection, Random, RandomBlocks))


@per_shape(maxsize=64)
def lookup_mask_mod(pattern: Pattern, q_len: int, kv_len: int, device: torch.device):
    """The mask_mod of ``pattern`` (natural token order, bottom-right aligned queries) as a table
    lookup, or None where the pattern is not constant on squares (see the module docstring)."""
    members = pattern.children if isinstance(pattern, Intersection) else (pattern,)
    causal = any(m.kind == "causal" for m in members)
    rest = tuple(m for m in members if m.kind != "causal")
    if not rest:
        return None
    base = rest[0] if len(rest) == 1 else Intersection(rest)
    size = base.constant_block
    if size is None or size < LEAST_SQUARE:
        return None
    frame = build_frame(1, q_len, kv_len, size, size, device)
    q, k = frame.q.spans(), frame.k.spans()
    # A square's slots past the sequence hold no position: its state is that of its positions.
    q, k = (replace(s, complete=torch.ones_like(s.complete)) for s in (q, k))
    state = base.block_state(q.column(), k.row())  # [Qb, Kb], or [1, H, Qb, Kb] per head
    if state.numel() > LOOKUP_MOST or bool((state == PARTIAL).any()):
        return None
    table = state == FULL
    if table.dim() == 4 and table.shape[1] == 1:  # one layout for every head
        table = table[0, 0]
    offset = kv_len - q_len

    def square(q_idx, kv_idx):
        # The table's bounds read from its shape as traced, not kept as ints of this length: a
        # compiled kernel guards on the ints a mask_mod holds and would compile again for every
        # length (the pattern's own mask_mod holds none but the offset, 0 at equal lengths).
        # Flex's last block reads indices past the sequence: clamped, their answer discarded.
        last_q, last_k = table.shape[-2] - 1, table.shape[-1] - 1
        return (q_idx // size).clamp(max=last_q), (kv_idx // size).clamp(max=last_k)

    if table.dim() == 2:

        def looked_up(b, h, q_idx, kv_idx):
            return table[square(q_idx, kv_idx)]
    else:
        per_head = table[0]

        def looked_up(b, h, q_idx, kv_idx):
            return per_head[(h, *square(q_idx, kv_idx))]

    if not causal:
        return looked_up

    def looked_up_causal(b, h, q_idx, kv_idx):
        return looked_up(b, h, q_idx, kv_idx) & (kv_idx <= q_idx + offset)

    return looked_up_causal
