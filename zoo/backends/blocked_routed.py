"""The ``blocked`` backend on a layout chosen by content (``zoo.patterns.routed``): per call.

A routed layout is a [B, H, query blocks, key blocks] state, made for one call's q and k. Each
(sequence, head, query block) is a row; its key blocks (the union of the blocks its queries
chose, and whatever fixed pattern is in the union) are gathered from that sequence's key/value
head, padded to the widest row, and masked per query inside::

    query block r of head h            its row: blocks chosen by any of its queries
    q0 chose {0, 2}   q1 chose {2, 3}  ->  keys of blocks 0 2 3, q0 masked off block 3,
                                           q1 masked off block 0

Nothing here is cached per shape (the layout is data): eager calls read the widest row's width
from the layout, a host synchronisation per call. Under ``torch.compile`` a graph cannot read it,
so every key block is gathered and masked: correct, without a graph break, but dense. Memory is
O(B * H * query blocks * widest row).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn.functional import dropout, scaled_dot_product_attention

from ..call import AttentionCall
from ..frames import Frame
from ..layout import used_first
from ..patterns import EMPTY, Pattern


def routed_state(part: Pattern, frame: Frame, B: int, H: int, padded: Tensor | None) -> Tensor:
    """[B, H, query blocks, key blocks] layout; key blocks that are all padding are EMPTY."""
    state = part.block_state(frame.q.spans().column(), frame.k.spans().row())
    state = state.expand(B, H, *state.shape[-2:])
    if padded is not None:
        all_padding = padded.view(B, -1, frame.k.block).all(-1)[:, None, None, :]
        state = torch.where(all_padding, EMPTY, state)
    return state


def routed_rows(state: Tensor) -> tuple[Tensor, Tensor] | None:
    """Each row's key blocks first (increasing) and padded to the widest row: (kv_blocks,
    used), both (B, H, Qb, W); None when no row has a key block."""
    used = state != EMPTY
    if torch.compiler.is_compiling():
        width = used.shape[-1]  # a graph cannot read the widest row: every key block, masked
    else:
        width = int(used.sum(-1).max())
        if width == 0:
            return None
    kv_blocks = used_first(used)[..., :width]
    slot_used = used.gather(-1, kv_blocks)
    return torch.where(slot_used, kv_blocks, 0), slot_used


def routed_pairs(part: Pattern, frame: Frame, B: int, H: int) -> int:
    """Scores computed per sequence and head, widest-row padding included."""
    rows = routed_rows(routed_state(part, frame, B, H, None))
    if rows is None:
        return 0
    Qb, width = rows[0].shape[-2:]
    return Qb * width * frame.q.block * frame.k.block


def routed_attention(
    call: AttentionCall,
    part: Pattern,
    frame: Frame,
    inputs: tuple[Tensor, Tensor, Tensor, Tensor | None],
    fused: bool,
) -> tuple[Tensor, Tensor, Tensor] | None:
    """(output (B, H, Lq, Dv), softmax mass (B, H, Lq), row maximum (B, H, Lq)) over this part's
    keys, as the explicit path returns them; None when the part allows no pair.

    ``inputs``: q (B, H, slots, D) prepared by the score, k and v (B, H_k, slots, D) in the frame,
    the key padding (B, slots) or None. ``fused`` runs SDPA per row (dot scores, no bias) and
    returns no mass or maximum (the part must be the only one)."""
    q, k, v, padded = inputs
    B, H = q.shape[:2]
    bq, bk = frame.q.block, frame.k.block
    rows = routed_rows(routed_state(part, frame, B, H, padded))
    if rows is None:
        return None
    kv_blocks, slot_used = rows  # (B, H, Qb, W)
    device = q.device
    b4 = torch.arange(B, device=device).view(B, 1, 1, 1)
    kv_head = (torch.arange(H, device=device) * k.shape[1] // H).view(1, H, 1, 1)

    def gather(x: Tensor) -> Tensor:  # (B, H_k, slots, D) -> (B, H, Qb, W * bk, D)
        return x.unflatten(2, (-1, bk))[b4, kv_head, kv_blocks].flatten(3, 4)

    keys, values = gather(k), gather(v)
    queries = q.unflatten(2, (-1, bq))  # (B, H, Qb, bq, D)
    k_slot = (kv_blocks[..., None] * bk + torch.arange(bk, device=device)).flatten(-2)
    usable = slot_used.repeat_interleave(bk, dim=-1) & frame.k.valid[k_slot]  # (B, H, Qb, W*bk)
    if padded is not None:
        usable = usable & ~padded[b4, k_slot]
    q_pos = frame.q.position.view(-1, bq)[:, :, None]  # (Qb, bq, 1)
    k_pos = frame.k.position[k_slot][..., None, :]  # (B, H, Qb, 1, W*bk)
    b5, h5 = b4[..., None], torch.arange(H, device=device).view(1, H, 1, 1, 1)
    masked = ~(part.allowed_at(b5, h5, q_pos, k_pos) & usable[..., None, :])  # (B,H,Qb,bq,W*bk)
    has_key = ~masked.all(dim=-1, keepdim=True)

    def in_order(x: Tensor) -> Tensor:  # (B, H, Qb, bq, ...) -> (B, H, Lq, ...)
        return frame.q.scatter(x.flatten(2, 3), dim=2)

    if fused:
        mask = torch.zeros(masked.shape, dtype=q.dtype, device=device)
        mask = mask.masked_fill(masked & has_key, float("-inf"))  # a keyless row sees all, then 0
        out = scaled_dot_product_attention(
            queries.flatten(0, 2)[:, None], keys.flatten(0, 2)[:, None],
            values.flatten(0, 2)[:, None], attn_mask=mask.flatten(0, 2)[:, None],
            dropout_p=call.dropout_p, scale=call.scale,
        )[:, 0].unflatten(0, (B, H, -1))  # fmt: skip
        return in_order(out * has_key), None, None  # type: ignore[return-value]
    scores = call.score.pairwise(queries, keys)  # (B, H, Qb, bq, W*bk)
    if call.bias is not None:
        scores = scores + call.bias(h5, q_pos, k_pos).to(scores.dtype)
    scores = scores.masked_fill(masked, float("-inf"))
    peak = scores.amax(dim=-1).detach()
    exp = torch.exp(scores - torch.where(torch.isfinite(peak), peak, 0)[..., None])
    denominator = exp.sum(dim=-1)
    if call.dropout_p:
        exp = dropout(exp, call.dropout_p)
    output = exp.to(values.dtype) @ values
    output = output / torch.where(denominator > 0, denominator, 1)[..., None]
    return in_order(output), in_order(denominator), in_order(peak)
