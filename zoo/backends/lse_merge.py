"""Attention of one set of queries over several key sources, merged exactly by log-sum-exp.

The blocked backend reads a row's keys from up to three places (``block_plan``: a band that is a
strided view, shared blocks, gathered blocks). Concatenating them would copy the band; instead
each source runs through the CPU FlashAttention kernel, which also returns every query's
log-sum-exp, and the sources merge as FlashAttention merges key blocks::

    out = sum_i exp(lse_i - lse) * out_i        lse = log sum_i exp(lse_i)

The backward gives each source the merged output and log-sum-exp. With those, a source's softmax
is the whole row's softmax restricted to its keys, so the sources' gradients add up to the exact
gradient (the xformers backend merges its pieces the same way). The gradients of the sources' keys
flow back through their views and gathers by autograd.

The kernels are ATen's ``_scaled_dot_product_flash_attention_for_cpu`` and its backward, the ops
behind ``scaled_dot_product_attention`` on a CPU; they take a float mask and no dropout.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

_forward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def merged_attention(
    q: Tensor, keys: list[Tensor], values: list[Tensor], masks: list[Tensor], scale: float
) -> Tensor:
    """softmax over all sources' keys @ their values, for q (N, H, M, D) against each source's
    keys and values (N, H, m_i, D) under its additive mask (N or 1, H or 1, M, m_i). A query
    that no source lets attend gets zeros."""
    return _Merged.apply(q, scale, len(keys), *keys, *values, *masks)


def _no_key(mask: Tensor) -> Tensor:
    """(.., M) True where the mask allows no key (the kernel gives such rows lse 0, not -inf)."""
    return torch.isneginf(mask).all(dim=-1)


class _Merged(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, scale, n, *tensors):
        keys, values, masks = tensors[:n], tensors[n : 2 * n], tensors[2 * n :]
        outs, lses = [], []
        for k, v, mask in zip(keys, values, masks, strict=True):
            out, lse = _forward(q, k, v, attn_mask=mask, scale=scale)
            outs.append(out)
            lses.append(torch.where(_no_key(mask), -math.inf, lse))
        lse = torch.stack(lses).logsumexp(dim=0) if n > 1 else lses[0]
        finite = torch.isfinite(lse)
        if n > 1:
            safe = torch.where(finite, lse, 0)
            shares = [torch.exp(part - safe)[..., None] for part in lses]
            out = sum(share * o for share, o in zip(shares, outs, strict=True))
            out = out.to(q.dtype)
        else:
            out = outs[0]
        ctx.save_for_backward(q, out, torch.where(finite, lse, math.inf), *tensors)
        ctx.scale, ctx.n = scale, n
        return out

    @staticmethod
    def backward(ctx, grad):
        q, out, lse, *tensors = ctx.saved_tensors
        n = ctx.n
        keys, values, masks = tensors[:n], tensors[n : 2 * n], tensors[2 * n :]
        grad = grad.contiguous()
        dq, dks, dvs = None, [], []
        for k, v, mask in zip(keys, values, masks, strict=True):
            gq, gk, gv = _backward(grad, q, k, v, out, lse, 0.0, False, attn_mask=mask,
                                   scale=ctx.scale)  # fmt: skip
            dq = gq if dq is None else dq + gq
            dks.append(gk)
            dvs.append(gv)
        return dq, None, None, *dks, *dvs, *([None] * n)
