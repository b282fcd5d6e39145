"""Wide query rows computed where their keys are (``zoo.parallel.exchange_plan``: a rank's query
blocks that read more than half of another rank's keys, Longformer's global token, BigBird's global
blocks).

A rank ships its wide query rows to every rank whose keys they read (``ship_to``); each of those
ranks computes a partial attention of them against its OWN keys (the pattern at global
positions, its key padding, the score and its bias at global positions) and returns the output
and log-sum-exp; the rank computes its own partial against its own keys and merges them all
with the house's merge (``zoo.backends.lse_merge.merge``). Bytes: the wide rows and their
partials, instead of every shard.

A partial is a few query rows against one shard's keys, every pair the pattern allows computed
(the cost the pattern itself gives global rows), in float32, or float64 for float64: on a CPU
through the FlashAttention kernel (``lse_merge.kernel_partial``, with an additive mask only
where some pair is not allowed or a bias is added), elsewhere, for another score, or for a
bias with learned parameters (the kernel's backward gives its mask no gradient), as the
reference backend computes, with an explicit masked softmax (``lse_merge.partial``). Both exchanges
(queries out, partials back) are ``SwapRows``, which every rank runs, with or without rows to
ship, so that autograd returns the gradients of the partials to their owners' keys and those of
the shipped queries to their rank, in the same order on every rank.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
from torch import Tensor

from ..backends.base import repeat_kv
from ..backends.lse_merge import kernel_partial, merge, partial
from ..backends.reference import attention_mask, masked_scores, score_bias
from ..core.narrowed import narrowed
from ..core.prepare import prepare_call
from ..core.shape_cache import per_shape
from ..patterns import Pattern
from .at_positions import AtPositions, at_global
from .exchange import swap_rows
from .exchange_plan import ExchangePlan


@per_shape(maxsize=256)
def wide_pattern(
    pattern: Pattern, plan: ExchangePlan, shipper: int, owner: int, device: torch.device,
    heads: int, chunk: int,
) -> AtPositions:  # fmt: skip
    """The pattern of ``shipper``'s wide rows against the keys of ``owner``'s chunk number
    ``chunk`` (of its shard), once per plan."""
    size = plan.layout.chunk
    return AtPositions(
        pattern, plan.ranks[shipper].wide_positions.to(device),
        plan.ranks[owner].q_positions[chunk * size : (chunk + 1) * size].to(device),
        heads if pattern.per_head else None,
    )  # fmt: skip


def own_keys_partial(
    q: Tensor, k: Tensor, v: Tensor, padding: Tensor | None, wrappers: list[AtPositions], scale,
    score, bias,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """(out (B, H, g, Dv), lse (B, H, g)) of queries q (B, H, g, D) against a rank's own keys k,
    v (B, H_kv, s, D), in float32 (float64 for float64): a partial per chunk of its shard (under
    ``wrappers``, one per chunk), merged. Each chunk's keys are one run of positions, so where
    the rows read every key of it, or read it causally, the kernel needs no mask."""
    size = k.shape[2] // len(wrappers)
    parts = []
    for index, wrapper in enumerate(wrappers):
        held = index * size, size
        chunk_padding = None if padding is None else narrowed(padding, 1, *held)
        parts.append(_chunk_partial(q, narrowed(k, 2, *held), narrowed(v, 2, *held), chunk_padding,
                                    wrapper, scale, score, bias))  # fmt: skip
    return parts[0] if len(parts) == 1 else merge(*zip(*parts, strict=True))


def _chunk_partial(q, k, v, padding, wrapper: AtPositions, scale, score, bias):
    """``own_keys_partial`` against one chunk's keys."""
    call = prepare_call(q, k, v, variant=wrapper, key_padding_mask=padding, scale=scale,
                        score=score)  # fmt: skip
    if bias is not None:
        call = replace(call, bias=at_global(bias, wrapper))
    if call.device.type != "cpu" or call.score.kind != "dot":
        return partial(*masked_scores(call))
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    plain = call.bias is None and padding is None
    causal = plain and wrapper.kind == "causal" and call.q_len == call.kv_len
    mask = None
    if not causal:
        allowed = attention_mask(call)
        if call.bias is not None:
            mask = score_bias(call, dtype)[None].masked_fill(~allowed, -math.inf)
            if mask.requires_grad:  # a learned bias (t5): the kernel's backward gives its mask
                return partial(*masked_scores(call))  # no gradient, autograd's dense one does
        elif not bool(allowed.all()):
            mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, -math.inf)
    k, v = (repeat_kv(t.to(dtype), call.groups) for t in (call.k, call.v))
    return kernel_partial(call.q.to(dtype), k, v, mask, call.scale, causal)


def wide_attention(
    q: Tensor, k: Tensor, v: Tensor, padding: Tensor | None, *, pattern: Pattern,
    plan: ExchangePlan, rank: int, after: Tensor, group, scale, score, bias,
) -> tuple[Tensor | None, Tensor]:  # fmt: skip
    """(this rank's wide rows' output (B, H, g, Dv) or None where it has none, a token for the
    output, ``SwapRows``): q, k, v (B, H, s, D) its shard (rotated, padded keys zeroed); every
    rank calls it where the plan ships anything."""
    mine, heads = plan.ranks[rank], q.shape[1]
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    q_wide = q.index_select(2, mine.wide_rows.to(q.device))  # (B, H, g, D)
    shapes = {p: (q.shape[0], heads, rows, q.shape[3]) for p, rows in plan.shippers(rank).items()}
    token, shipped = swap_rows(after, dict.fromkeys(mine.ship_to, q_wide), shapes, q.dtype, group)

    def partial_of(shipper: int, rows: Tensor) -> tuple[Tensor, Tensor]:
        wrappers = [wide_pattern(pattern, plan, shipper, rank, q.device, heads, chunk)
                    for chunk in range(plan.layout.chunks_per_rank)]  # fmt: skip
        return own_keys_partial(rows, k, v, padding, wrappers, scale, score, bias)

    returned = {}
    for shipper, rows in shipped.items():  # out and lse side by side: one message
        out, lse = partial_of(shipper, rows)
        returned[shipper] = torch.cat([out, lse[..., None]], dim=-1)
    back = {p: (q.shape[0], heads, q_wide.shape[2], v.shape[3] + 1) for p in mine.ship_to}
    token, partials = swap_rows(token, returned, back, dtype, group)
    if not mine.ship_to:
        return None, token
    outs, lses = zip(partial_of(rank, q_wide), *((p[..., :-1], p[..., -1]) for p in
                                                  partials.values()), strict=True)  # fmt: skip
    return merge(outs, lses)[0].to(q.dtype), token
