"""``moba``: Mixture of Block Attention (Lu et al., Moonshot AI, 2025), keys chosen by content.

Keys are cut into blocks of ``block_size`` (the last one shorter when the length is not a
multiple). Each query scores each block by the dot product of the query with the mean of the
block's keys, computed in float32 with padded keys left out of the mean, and attends every key of
the ``top_k`` best blocks. The choice is per query and per head (a grouped key/value head's means
serve each of its query heads), made without gradient.

- Its own block (the block holding the query's position, queries aligned bottom-right as in
  ``zoo.patterns.base``) is always chosen and counts toward ``top_k``.
- Causal (``causal=True``): blocks after the query's own are never ranked, its own block is
  attended causally (the intersection with ``causal`` does that), so ``top_k - 1`` earlier
  blocks are chosen by score and attended fully.
- Not causal: the ``top_k`` blocks of all blocks by score, its own among them.
- A block whose keys are all padding is never chosen, not even as the query's own; padded keys
  are never attended (the key padding mask sees to that in every backend).
- Ties go to the lower block index. With fewer available blocks than ``top_k``, all are chosen
  (the first queries of a causal sequence), so short inputs run.
- Decoding with a ``KVCache`` (causal): the cache keeps every key, slot j at position j, and a
  new query scores the blocks of the cache's keys at its own position (``RouteInputs.q_pos``).
  Every block before the query's own is complete and its own is forced, so the choice, hence
  prefill + steps, equals that of one causal forward over the whole sequence.

::

    block_size=2, top_k=2, causal (8x8): query 6 (block 3) chose block 1
    keys   0 1 | 2 3 | 4 5 | 6 7
    q6     . . | x x | . . | x .

Published settings: block_size 512, top_k 3; 4096 and 12 at 1M tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..core.arguments import check_int
from ..core.autocast import float32_inside
from ..core.fused import fused
from ..decoding.block_sums import block_sums
from .base import Pattern
from .families import register_pattern
from .routed import ChosenBlocks, RouteInputs, top_blocks

CHOICE_ELEMENTS = 1 << 24  # scores per chunk of queries (64 MiB of float32)


@torch.no_grad()
def moba_choice(
    q: Tensor,
    k: Tensor,
    *,
    block_size: int,
    top_k: int,
    causal: bool,
    key_padding_mask: Tensor | None = None,
    q_pos: Tensor | None = None,
    sums: tuple[Tensor, Tensor] | None = None,
) -> Tensor:
    """(B, H, Lq, min(top_k, key blocks)) int32: the blocks each query chooses (see the module
    docstring), as ``ChosenBlocks.picks`` holds them (the number of key blocks in an empty slot).

    q (B, H, Lq, D), k (B, H_kv, Lk, D) with H_kv dividing H; key_padding_mask (B, Lk), True
    where a key is padding; q_pos (B, Lq) the queries' positions (None: bottom-right aligned);
    ``sums``: the block sums of k's unpadded keys and their counts (``zoo.decoding.block_sums``)
    where the caller keeps them, else computed here.
    """
    B, H, q_len, _ = q.shape
    kv_len = k.shape[2]
    if sums is None:
        keep = torch.ones(B, kv_len, dtype=torch.bool, device=k.device)
        if key_padding_mask is not None:
            keep = ~key_padding_mask
        sums = block_sums(k, keep, block_size)
    totals, counts = sums  # (B, H_kv, blocks, D), (B, blocks)
    blocks = counts.shape[1]
    # None: bottom-right aligned, consecutive positions from kv_len - q_len; else (B, 1, Lq)
    q_pos = kv_len - q_len if q_pos is None else q_pos[:, None]
    # Queries in chunks: the float32 scores and their sort are (rows, blocks) per head at a time,
    # not (Lq, blocks) (2 GiB of scores at 128K tokens, 16 heads, blocks of 512).
    rows = max(1, CHOICE_ELEMENTS // max(B * H * blocks, 1))
    if rows >= q_len:  # one chunk (16K tokens, 16 heads, blocks of 512): no copy
        return _choose(q, totals, counts, q_pos, block_size, causal, top_k)
    chosen = torch.empty(B, H, q_len, min(top_k, blocks), dtype=torch.int32, device=q.device)
    for start in range(0, q_len, rows):
        part = slice(start, start + rows)
        positions = q_pos + start if isinstance(q_pos, int) else q_pos[..., part]
        chosen[:, :, part] = _choose(q[:, :, part], totals, counts, positions, block_size, causal,
                                     top_k)  # fmt: skip
    return chosen


@fused
def _choose(
    q: Tensor, totals: Tensor, counts: Tensor, q_pos: Tensor | int, block_size: int, causal: bool,
    top_k: int,
) -> Tensor:  # fmt: skip
    """(B, H, rows, min(top_k, blocks)) the choice of the queries q (B, H, rows, D) among the
    blocks of ``block_size`` keys whose sums are ``totals`` (B, H_kv, blocks, D) and counts
    ``counts`` (B, blocks); ``q_pos`` the queries' positions (B, 1, rows), or the first one's
    where they are consecutive (an int): one compiled graph on a GPU (``zoo.core.fused``)."""
    if isinstance(q_pos, int):
        q_pos = torch.arange(q.shape[2], device=q.device) + q_pos  # (rows,)
    own = q_pos.div(block_size, rounding_mode="floor")[..., None]  # (..., rows, 1); < 0 before keys
    means = totals / counts.clamp(min=1)[:, None, :, None]  # (B, H_kv, blocks, D)
    group = q.shape[1] // totals.shape[1]
    means = means.repeat_interleave(group, dim=1).transpose(-1, -2)  # (B, H, D, blocks)
    has_keys = (counts > 0)[:, None, None, :]  # (B, 1, 1, blocks)
    block = torch.arange(means.shape[-1], device=q.device)[None, :]
    with float32_inside(q.device):  # also under autocast: the choice is made in float32
        scores = q.float() @ means  # (B, H, rows, blocks)
    available = has_keys & (block <= own) if causal else has_keys
    return top_blocks(scores, top_k, available, block == own)


@register_pattern("moba")
@dataclass(frozen=True)
class Moba(Pattern):
    """The top ``top_k`` key blocks of ``block_size`` per query by q . mean(block keys)."""

    block_size: int = 512
    top_k: int = 3

    def __post_init__(self) -> None:
        check_int("block_size", self.block_size)
        check_int("top_k", self.top_k)

    @property
    def routed(self) -> bool:
        return True

    def most_keys(self, position: int | None = None) -> int:
        """The most keys one query's choice holds: ``top_k`` blocks; for a query at
        ``position`` (decoding, causal), ``top_k - 1`` whole blocks and its own up to it."""
        if position is None:
            return self.top_k * self.block_size
        return (self.top_k - 1) * self.block_size + position % self.block_size + 1

    def bind(self, inputs: object) -> Pattern:
        if not isinstance(inputs, RouteInputs):
            raise TypeError(f"moba binds to RouteInputs, got {type(inputs).__name__}")
        sums = inputs.block_sums(self.block_size) if inputs.block_sums else None
        chosen = moba_choice(
            inputs.q,
            inputs.k,
            block_size=self.block_size,
            top_k=self.top_k,
            causal=inputs.causal,
            key_padding_mask=inputs.key_padding_mask,
            q_pos=inputs.q_pos,
            sums=sums,
        )
        # The blocks scored: the kept sums' (a sharded call's cover the whole sequence), else k's.
        blocks = sums[1].shape[1] if sums is not None else -(-inputs.k.shape[2] // self.block_size)
        return ChosenBlocks(self.block_size, chosen, blocks, inputs.offset())

    def _needs_inputs(self, *args: object) -> Tensor:
        raise TypeError(
            "moba chooses its blocks by content: there is no fixed mask; bind it to a call's "
            "inputs (pattern.bind(RouteInputs(q, k)) or zoo.attention(q, k, v, variant='moba'))"
        )

    allowed = block_state = dense = _needs_inputs  # type: ignore[assignment]
