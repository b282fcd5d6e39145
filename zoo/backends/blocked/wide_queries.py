"""Queries that read most keys (global tokens), split from the blocks that hold them.

A block of 64 queries that holds one global token reads every key block, so the kernel would
compute 64 queries against all n keys for one query's sake, a sizeable share of Longformer's
forward (measured: eval/results/design-notes-cpu.md#wide-queries). Split at the query, not the
block: the global queries run as a group of their own
against the keys they read, and the rest of their block as an ordinary row of the key blocks
its queries read::

    block r:  q0 (global)   -> query group: [ all keys ]
              q1 .. q63     -> row r:       [ band blocks ]  (q0 masked out here)

Each pair is still read once. Only the blocked backend's CPU path takes such groups
(``merged``): a query group shares output rows with its block's row, so the two merge
by log-sum-exp, which the fused path cannot do.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ...layout.frames import Frame
from ...patterns import Pattern


@dataclass(frozen=True, eq=False)
class WideSplit:
    """The split of some query blocks (``rows``) into their wide queries and the rest."""

    rows: Tensor  # (R,) query blocks that hold wide queries
    wide: Tensor  # (R, bq) True for a wide query
    narrow_used: Tensor  # (R, key blocks) the key blocks the other queries of each row read
    wide_slots: Tensor  # (G,) the frame slots of all wide queries
    wide_used: Tensor  # (key blocks,) the key blocks some wide query reads


def split_wide_queries(
    part: Pattern, frame: Frame, rows: Tensor, typical: float
) -> WideSplit | None:
    """Among the query blocks ``rows`` (those that read more than twice the typical number of key
    blocks), the queries that themselves read more than twice the typical number of keys
    (``typical`` key blocks of the frame's key block); None where there are none."""
    bq, bk = frame.q.block, frame.k.block
    slots = rows[:, None] * bq + torch.arange(bq, device=rows.device)  # (R, bq)
    q_pos = frame.q.position[slots][:, :, None]
    allowed = part.allowed(q_pos, frame.k.position[None, None, :])  # (R, bq, key slots)
    allowed &= frame.k.valid[None, None, :] & frame.q.valid[slots][:, :, None]
    wide = allowed.sum(dim=-1) > 2 * typical * bk
    if not bool(wide.any()):
        return None
    per_block = allowed.unflatten(-1, (-1, bk)).any(dim=-1)  # (R, bq, key blocks)
    narrow_used = (per_block & ~wide[:, :, None]).any(dim=1)
    wide_used = per_block[wide].any(dim=0)
    keep = wide.any(dim=1)
    return WideSplit(rows[keep], wide[keep], narrow_used[keep], slots[wide], wide_used)
