"""The blocked backend's path on a CPU: every group's sources and every part as pieces of one
merged attention (``lse_merge``).

For each part (its own token order) and each group of its plan (``block_plan``), each source of
keys (band, shared blocks, extra blocks) is one piece: the group's query blocks against that
source, under the group's mask restricted to it. A band group runs one sequence at a time (its
keys are a view of that sequence's keys); a gathered group runs all sequences at once. Each piece
names the output row of every query it holds (its position in the caller's order, per sequence),
so parts in different orders merge without being put back in order first.

Used for dot-product scores without dropout or a learned score bias, with one head size for q,
k and v (what the CPU kernel takes); the other calls take the paths of ``blocked``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...core.call import AttentionCall
from ...core.shape_cache import per_shape
from ...layout.frames import Frame
from ..base import head_index
from ..lse_merge import Piece, merged_attention
from .block_plan import GroupPlan
from .row_grid import RowGrid, row_grid


def merges_pieces(call: AttentionCall) -> bool:
    """Whether a call can run as merged pieces (see the module docstring)."""
    return (
        call.q.device.type == "cpu"
        and call.score.kind == "dot"
        and not call.dropout_p
        and call.q.shape[-1] == call.v.shape[-1]
        # the kernel's backward gives the mask no gradient: a learned bias (T5) needs one
        and not any(t.requires_grad for t in call.learned)
    )


@per_shape(maxsize=1024)
def masked_additive(group: GroupPlan, dtype: torch.dtype) -> Tensor:
    """The group's mask as the kernel adds it: (1, R, 1, bq, width * bk) of 0 and -inf."""
    mask = torch.zeros(group.masked.shape, dtype=dtype, device=group.masked.device)
    return mask.masked_fill(group.masked, float("-inf"))[None, :, None]


@per_shape(maxsize=1024)
def pattern_no_keys(group: GroupPlan, widths: tuple[int, ...]) -> list[Tensor]:
    """Per source, (1, R, 1, bq) True where the pattern leaves a query no key in it."""
    return [m.all(dim=-1)[None, :, None] for m in group.masked.split(widths, dim=-1)]


def _mask(call: AttentionCall, group: GroupPlan, padded: Tensor | None, dtype) -> Tensor:
    """(B or 1, R, 1 or H, bq, width * bk): the pattern, the key padding and any score bias."""
    if padded is None and call.bias is None:
        return masked_additive(group, dtype)
    masked = group.masked_with(padded)[:, :, None]
    bias = torch.zeros((), dtype=dtype, device=masked.device)
    if call.bias is not None:
        heads = head_index(call.q.shape[1], masked.device, 3)
        bias = call.bias(heads, group.q_pos, group.k_pos).to(dtype).transpose(0, 1)[None]
    return bias.masked_fill(masked, float("-inf"))


@per_shape(maxsize=1024)
def _rows(
    frame: Frame, group: GroupPlan, batch: int, q_len: int
) -> tuple[Tensor, list[RowGrid | None], RowGrid | None]:
    """(B, R, bq): each query slot's row in the (B * Lq) output, padding slots B * Lq; and the
    rows' grids (``RowGrid``), of each sequence's and of all sequences' (flattened to B * R)."""
    slots = group.query_slots(frame.q.block)
    rows = torch.where(frame.q.valid[slots], frame.q.index[slots], q_len)
    offsets = torch.arange(batch, device=rows.device)[:, None, None] * q_len
    rows = torch.where(rows < q_len, rows + offsets, batch * q_len)
    total = batch * q_len
    return rows, [row_grid(r, total) for r in rows], row_grid(rows.flatten(0, 1), total)


def group_pieces(
    call: AttentionCall, frame: Frame, group: GroupPlan, q: Tensor, k: Tensor, v: Tensor,
    padded: Tensor | None, dtype: torch.dtype, fresh: bool,
) -> list[Piece]:  # fmt: skip
    """The pieces of one group, for q, k and v (B, H, slots, D) in the frame's order; ``fresh``
    where no earlier group holds its rows (``Piece.fresh``)."""
    B = q.shape[0]
    bq, bk = frame.q.block, frame.k.block
    mask = _mask(call, group, padded, dtype)  # (B or 1, R, 1 or H, bq, width * bk)
    rows, grids, grid = _rows(frame, group, B, call.q_len)
    widths = [columns for columns in group.widths if columns]
    masks = mask.split(widths, dim=-1)
    if padded is None:  # the pattern alone decides which queries have keys: once per shape
        no_keys = pattern_no_keys(group, tuple(widths))
    else:
        no_keys = [m.all(dim=-1)[:, :, None] for m in group.masked_with(padded).split(widths, -1)]
    pieces = []
    if group.window is not None:  # keys are views of one sequence's keys
        for b in range(B):
            qb = q[b].unflatten(1, (-1, bq)).narrow(1, group.window.first, group.rows.numel())
            qb = qb.transpose(0, 1)  # (R, H, bq, D)
            keys = group.key_sources(k[b], bk, band_view=False)
            values = group.key_sources(v[b], bk, band_view=False)
            windows = [group.band(bk)] + [None] * (len(keys) - 1)  # the band comes first
            rows_b = rows[b]  # one object for the sources: they merge as one group (Piece)
            for kb, vb, m, none, w in zip(keys, values, masks, no_keys, windows, strict=True):
                i = b % m.shape[0]
                pieces.append(Piece(qb, kb, vb, m[i], none[i], rows_b, fresh, w, grids[b]))
        return pieces
    q_blocks, k_blocks, v_blocks = group.gather(q, k, v, frame)  # (B, H, R, ...)

    def batched(x: Tensor) -> Tensor:  # (B, H, R, L, D) -> (B * R, H, L, D)
        return x.transpose(1, 2).flatten(0, 1)

    m = masks[0].expand(B, *masks[0].shape[1:]).flatten(0, 1)
    none = no_keys[0].expand(B, *no_keys[0].shape[1:]).flatten(0, 1)
    return [
        Piece(
            batched(q_blocks), batched(k_blocks), batched(v_blocks), m, none, rows.flatten(0, 1),
            fresh, grid=grid,
        )
    ]  # fmt: skip


def merged_blocked(
    call: AttentionCall, planned: list[tuple[Frame, list[GroupPlan]]], inputs, dtype
) -> Tensor:
    """(B, H, Lq, Dv): the call's attention as merged pieces, or None where the pattern allows
    no pair; ``inputs(frame)`` gives q, k, v and the key padding in a frame's order."""
    pieces = []
    for part, (frame, groups) in enumerate(planned):
        q, k, v, padded = inputs(frame)
        for group in groups:  # the groups of one part hold disjoint query blocks
            # a query group (``wide_queries``) merges with its queries' blocks, listed before it
            fresh = part == 0 and group.q_slot is None
            pieces += group_pieces(call, frame, group, q, k, v, padded, dtype, fresh)
    if not pieces:
        return None
    B, Lq = call.q.shape[0], call.q.shape[2]
    out = merged_attention(pieces, B * Lq, call.scale)  # (B * Lq, H, Dv)
    return out.unflatten(0, (B, Lq)).transpose(1, 2)
