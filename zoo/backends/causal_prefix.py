"""Causal attention of s queries aligned to the end of m > s keys (bottom right: query i reads
keys 0 .. i + m - s), on a CPU, without a mask of s x m.

SDPA's CPU kernel aligns ``is_causal`` to the top left, and ``causal_lower_right`` materialises
its mask on a CPU. The keys split in two: the m - s keys before the queries, which every query
reads (no mask), and the last s keys, which the queries read causally from the top left. Each
runs through the CPU FlashAttention kernel, which also returns the log-sum-exp of every query,
and the two merge by log-sum-exp (``lse_merge.combine_two``). The backward gives each call the
merged output and log-sum-exp (``lse_merge``'s module docstring says why that is exact).

This is what a sharded causal call computes on every rank after the first (its queries against
every earlier key: ``zoo.parallel``), and what chunked prefill asks of a cache.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .base import repeat_kv
from .lse_merge import combine_two, lse_for_backward

_forward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def causal_after_prefix(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """(B, H, s, Dv): causal attention of q (B, H, s, D) against k, v (B, H_kv, m, D), m > s,
    the queries aligned to the last s keys; H a multiple of H_kv (grouped heads)."""
    return _CausalAfterPrefix.apply(q, k, v, scale)


def _summed(grad: Tensor, groups: int) -> Tensor:
    """The inverse of ``repeat_kv`` for a gradient: each key/value head's query heads summed."""
    return grad if groups == 1 else grad.unflatten(1, (-1, groups)).sum(dim=2)


class _CausalAfterPrefix(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
        groups, split = q.shape[1] // k.shape[1], k.shape[2] - q.shape[2]
        # The kernel takes one head count, and the causal half cannot stack a group's query
        # heads as rows (as lse_merge does): k and v repeated for their query heads.
        k, v = repeat_kv(k, groups), repeat_kv(v, groups)
        before, last = slice(None, split), slice(split, None)
        out_a, lse_a = _forward(q, k[:, :, before], v[:, :, before], scale=scale)[:2]
        out_b, lse_b = _forward(q, k[:, :, last], v[:, :, last], is_causal=True, scale=scale)[:2]
        wide = torch.promote_types(q.dtype, torch.float32)  # the merge's weights: float32 or more
        out, lse = combine_two(out_a.to(wide), lse_a, out_b.to(wide), lse_b)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.groups, ctx.split = scale, groups, split
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        split, lse = ctx.split, lse_for_backward(lse)
        grad = grad.contiguous()
        dq_a, dk_a, dv_a = _backward(grad, q, k[:, :, :split], v[:, :, :split], out, lse, 0.0,
                                     False, scale=ctx.scale)  # fmt: skip
        dq_b, dk_b, dv_b = _backward(grad, q, k[:, :, split:], v[:, :, split:], out, lse, 0.0,
                                     True, scale=ctx.scale)  # fmt: skip
        dk = _summed(torch.cat([dk_a, dk_b], dim=2), ctx.groups)
        dv = _summed(torch.cat([dv_a, dv_b], dim=2), ctx.groups)
        return dq_a + dq_b, dk, dv, None
