"""The ``blocked`` backend on a layout chosen by content (``zoo.patterns.routed``): the union
per query block, the fallback path.

``blocked`` runs a routed part key block by key block where it can (``by_key``: eager, CPU
or CUDA, dot-product scores without a score bias or dropout), at the cost of the chosen pairs.
This path serves the rest: ``torch.compile``, fake tensors, additive scores, score biases,
dropout, float64 on CUDA.

A routed layout is a [B, H, query blocks, key blocks] state, made for one call's q and k. Each
(sequence, head, query block) is a row; its key blocks (the union of the blocks its queries
chose, and whatever fixed pattern is in the union) are gathered from that sequence's key/value
head, padded to the widest row, and masked per query inside::

    query block r of head h            its row: blocks chosen by any of its queries
    q0 chose {0, 2}   q1 chose {2, 3}  ->  keys of blocks 0 2 3, q0 masked off block 3,
                                           q1 masked off block 0

For causal MoBA on random inputs the union of a 64-query block approaches every earlier block,
so this path costs about dense attention plus the masks, several times dense SDPA on CPU
(measured before ``by_key``: eval/results/design-notes-cpu.md#by-key-against-union).

Query blocks are grouped by the widest row any sequence or head needs (``routed_groups``), so
that causal rows, which need from one key block to all, are not all padded to the widest.

Nothing here is cached per shape (the layout is data): eager calls read the groups' widths
from the layout, a host synchronisation per call. Under ``torch.compile`` a graph cannot read it,
so every key block is gathered and masked: correct, without a graph break, but dense (the runs
by key block are not traced either: their count is data). Memory is
O(B * H * query blocks * widest row).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn.functional import dropout  # SDPA: through torch.nn.functional, see sdpa.py

from ...core.call import AttentionCall
from ...core.device_build import has_no_data
from ...layout.block_layout import used_first
from ...layout.frames import Frame
from ...patterns import EMPTY, Pattern
from ..reference import exp_and_mass
from .index_rows import index_rows


def routed_state(part: Pattern, frame: Frame, B: int, H: int, padded: Tensor | None) -> Tensor:
    """[B, H, query blocks, key blocks] layout; key blocks that are all padding are EMPTY."""
    state = part.block_state(frame.q.spans().column(), frame.k.spans().row())
    return with_padding(state, frame, B, H, padded)


def with_padding(state: Tensor, frame: Frame, B: int, H: int, padded: Tensor | None) -> Tensor:
    """A layout's block states (B or 1, H or 1, ...) for B sequences and H heads, EMPTY where
    a key block is all padding."""
    state = state.expand(B, H, *state.shape[-2:])
    if padded is not None:
        all_padding = padded.view(B, -1, frame.k.block).all(-1)[:, None, None, :]
        state = torch.where(all_padding, EMPTY, state)
    return state


@dataclass(frozen=True, eq=False)
class RoutedGroup:
    """Query blocks that need about as many key blocks in every sequence and head."""

    rows: Tensor  # (R,) query blocks
    kv_blocks: Tensor  # (B, H, R, W) each row's key blocks first, increasing; 0 in unused slots
    used: Tensor  # (B, H, R, W) False for the padding slots of narrower rows


def routed_groups(state: Tensor, waste: float) -> list[RoutedGroup]:
    """Query blocks grouped by the widest union any sequence or head needs, so that no group
    is padded by more than ``waste`` of its width (causal rows need 1 .. Qb key blocks: one
    width for all would double the work). Query blocks with no key block are left out."""
    used = state != EMPTY
    if torch.compiler.is_compiling() or has_no_data(used):
        # a graph (or fake tensors: torch.export) cannot read the widths: every key block, masked
        rows = torch.arange(used.shape[2], device=used.device)
        return [RoutedGroup(rows, *_slots(used, used.shape[-1]))]
    need = used.sum(-1).amax(dim=(0, 1))  # (Qb,)
    order = torch.argsort(need, descending=True, stable=True)
    widths = need[order].tolist()
    groups, start = [], 0
    while start < len(widths) and widths[start] > 0:
        end = start
        while end < len(widths) and widths[end] >= widths[start] * (1 - waste):
            end += 1
        rows = order[start:end]
        groups.append(RoutedGroup(rows, *_slots(used[:, :, rows], widths[start])))
        start = end
    return groups


def _slots(used: Tensor, width: int) -> tuple[Tensor, Tensor]:
    kv_blocks = used_first(used)[..., :width]
    slot_used = used.gather(-1, kv_blocks)
    return torch.where(slot_used, kv_blocks, 0), slot_used


def routed_pairs(part: Pattern, frame: Frame, B: int, H: int, waste: float) -> int:
    """Scores computed per sequence and head, group padding included."""
    groups = routed_groups(routed_state(part, frame, B, H, None), waste)
    area = frame.q.block * frame.k.block
    return sum(g.rows.numel() * g.kv_blocks.shape[-1] * area for g in groups)


def routed_attention(
    call: AttentionCall,
    part: Pattern,
    frame: Frame,
    inputs: tuple[Tensor, Tensor, Tensor, Tensor | None],
    fused: bool,
    waste: float,
) -> tuple[Tensor, Tensor | None, Tensor | None] | None:
    """(output (B, H, Lq, Dv), softmax mass (B, H, Lq), row maximum (B, H, Lq)) over this part's
    keys, as the explicit path returns them; None when the part allows no pair.

    ``inputs``: q (B, H, slots, D) prepared by the score, k and v (B, H_k, slots, D) in the frame,
    the key padding (B, slots) or None. ``fused`` runs SDPA per row (dot scores, no bias) and
    returns no mass or maximum (the part must be the only one)."""
    q, _, _, padded = inputs
    B, H = q.shape[:2]
    groups = routed_groups(routed_state(part, frame, B, H, padded), waste)
    if not groups:
        return None
    per_group = [_group(call, part, frame, inputs, g, fused) for g in groups]
    rows = torch.cat([g.rows for g in groups])

    def in_order(i: int, fill: float) -> Tensor:  # (B, H, R, bq, ...) per group -> (B, H, Lq, ...)
        first = per_group[0][i]
        whole = first.new_full((B, H, frame.q.num_blocks, *first.shape[3:]), fill)
        whole = whole.index_copy(2, rows, torch.cat([r[i] for r in per_group], dim=2))
        return frame.q.scatter(whole.flatten(2, 3), dim=2)

    if fused:
        return in_order(0, 0.0), None, None
    return in_order(0, 0.0), in_order(1, 0.0), in_order(2, float("-inf"))


def _group(
    call: AttentionCall,
    part: Pattern,
    frame: Frame,
    inputs: tuple[Tensor, Tensor, Tensor, Tensor | None],
    group: RoutedGroup,
    fused: bool,
) -> tuple[Tensor, ...]:
    """One group's rows: output (B, H, R, bq, Dv), and unless fused their mass and maximum."""
    q, k, v, padded = inputs
    B, H = q.shape[:2]
    bq, bk = frame.q.block, frame.k.block
    kv_blocks, slot_used = group.kv_blocks, group.used  # (B, H, R, W)
    device = q.device
    b4 = torch.arange(B, device=device).view(B, 1, 1, 1)
    kv_head = (torch.arange(H, device=device) * k.shape[1] // H).view(1, H, 1, 1)

    def gather(x: Tensor) -> Tensor:  # (B, H_k, slots, D) -> (B, H, R, W * bk, D)
        return x.unflatten(2, (-1, bk))[b4, kv_head, kv_blocks].flatten(3, 4)

    keys, values = gather(k), gather(v)
    queries = index_rows(q.unflatten(2, (-1, bq)), 2, group.rows)  # (B, H, R, bq, D)
    k_slot = (kv_blocks[..., None] * bk + torch.arange(bk, device=device)).flatten(-2)
    usable = slot_used.repeat_interleave(bk, dim=-1) & frame.k.valid[k_slot]  # (B, H, R, W*bk)
    if padded is not None:
        usable = usable & ~padded[b4, k_slot]
    q_pos = frame.q.position.view(-1, bq)[group.rows][:, :, None]  # (R, bq, 1)
    k_pos = frame.k.position[k_slot][..., None, :]  # (B, H, R, 1, W*bk)
    b5, h5 = b4[..., None], torch.arange(H, device=device).view(1, H, 1, 1, 1)
    masked = ~(part.allowed_at(b5, h5, q_pos, k_pos) & usable[..., None, :])  # (B,H,R,bq,W*bk)
    has_key = ~masked.all(dim=-1, keepdim=True)
    if fused:
        mask = torch.zeros(masked.shape, dtype=q.dtype, device=device)
        mask = mask.masked_fill(masked & has_key, float("-inf"))  # a keyless row sees all, then 0
        out = torch.nn.functional.scaled_dot_product_attention(
            queries.flatten(0, 2)[:, None], keys.flatten(0, 2)[:, None],
            values.flatten(0, 2)[:, None], attn_mask=mask.flatten(0, 2)[:, None],
            dropout_p=call.dropout_p, scale=call.scale,
        )[:, 0].unflatten(0, (B, H, -1))  # fmt: skip
        return (out * has_key,)
    scores = call.score.pairwise(queries, keys)  # (B, H, R, bq, W*bk)
    if call.bias is not None:
        scores = scores + call.bias(h5, q_pos, k_pos).to(scores.dtype)
    exp, denominator, peak = exp_and_mass(scores.masked_fill(masked, float("-inf")))
    if call.dropout_p:
        exp = dropout(exp, call.dropout_p)
    output = exp.to(values.dtype) @ values
    output = output / torch.where(denominator > 0, denominator, 1)[..., None]
    return output, denominator, peak
