"""xFormers' three kernel calls emulated in plain PyTorch on any device, after xFormers' own
definitions of its masks and of the log-sum-exp, rounding where FlashAttention rounds: the
xformers backend's plans and merging run on a CPU against these, and against the real kernels on
a GPU (tests/backends/test_xformers.py). In bf16 the emulation scores the GPU test's
block_local case as the H100 did (dv 0.0324 against 0.0229 allowed, before the plan by rows and
keys); computed in float32 throughout, it had scored 0.0199 and hidden it."""

from __future__ import annotations

import dataclasses
import math

import torch

from zoo.backends import XformersBackend


def slice_allowed(mask, rows: int, keys: int) -> torch.Tensor:
    """(rows, keys) bool, as xFormers defines its masks (attn_bias.py): no mask allows all;
    LowerTriangularFromBottomRightMask allows key k for query q when k <= q + keys - rows;
    LocalAttentionFromBottomRightMask(left, right) when q - left <= k + rows - keys <= q + right."""
    q = torch.arange(rows)[:, None]
    k = torch.arange(keys)[None, :]
    if mask is None:
        return torch.ones(rows, keys, dtype=torch.bool)
    if mask == "causal":
        return k <= q + keys - rows
    left, right = mask
    return (q - left <= k + rows - keys) & (k + rows - keys <= q + right)


def flash_allowed(mask, rows: int, keys: int) -> torch.Tensor:
    """What FlashAttention computes for a mask: flash_api.cpp turns a window_right >= keys into
    keys (not unbounded), which differs from the mask where rows > keys + 1."""
    if isinstance(mask, tuple) and mask[1] >= keys:
        mask = (mask[0], keys)
    return slice_allowed(mask, rows, keys)


def _scores(q, k, mask, scale):
    """(B, H, M, N) float32 scores of (B, M, H, K) inputs, -inf outside what the kernel allows."""
    scores = torch.einsum("bmhk,bnhk->bhmn", q.float(), k.float()) * scale
    allowed = flash_allowed(mask, q.shape[1], k.shape[1]).to(q.device)
    return scores.masked_fill(~allowed, float("-inf"))


def _repeated(q, k, v):
    """Grouped k and v (B, M, H_kv, K) repeated to q's heads: the emulation may copy."""
    groups = q.shape[2] // k.shape[2]
    return k.repeat_interleave(groups, dim=2), v.repeat_interleave(groups, dim=2)


def _summed(grad, heads):
    """A repeated k's or v's gradient (B, N, H, K) summed back to its ``heads``."""
    return grad.unflatten(2, (heads, -1)).sum(3)


def _as_input(x, like):
    """x (float32) rounded to ``like``'s dtype and back, as FlashAttention rounds its
    probabilities P and score gradients dS to bf16 or fp16 before the products that take them;
    nothing in float32."""
    return x.to(like.dtype).float()


class EmulatedKernels:
    """memory_efficient_attention, its _partial and its _backward, computed in float32 and rounded
    where FlashAttention rounds: P and dS to the inputs' dtype before their products, each
    result to it at the end (so a bf16 merge of several calls shows the error it adds on a GPU).
    k and v may have fewer heads than q, as the backend's kernels take them (grouped-query
    attention)."""

    def attention(self, q, k, v, mask, scale, p):
        k, v = _repeated(q, k, v)
        weights = torch.softmax(_scores(q, k, mask, scale), dim=-1).nan_to_num(0.0)
        weights = _as_input(torch.nn.functional.dropout(weights, p), q)
        return torch.einsum("bhmn,bnhk->bmhk", weights, v.float()).to(q.dtype)

    def partial(self, q, k, v, mask, scale):
        """As FlashAttention's partial kernel: out in q's dtype, lse +inf on a row without keys."""
        k, v = _repeated(q, k, v)
        scores = _scores(q, k, mask, scale)
        lse = torch.logsumexp(scores, dim=-1)
        weights = _as_input(torch.exp(scores - lse[..., None]).nan_to_num(0.0), q)
        out = torch.einsum("bhmn,bnhk->bmhk", weights, v.float()).to(q.dtype)
        return out, torch.where(lse == -math.inf, math.inf, lse)

    def backward(self, grad, out, lse, q, k, v, mask, scale):
        """FlashAttention's backward: P = exp(S - lse), D = rowsum(dO * O), dS = P (dP - D); dV
        takes P and dQ, dK take dS rounded to the inputs' dtype; results in it."""
        kv_heads, k_dtype = k.shape[2], k.dtype
        k, v = _repeated(q, k, v)
        weights = torch.exp(_scores(q, k, mask, scale) - lse[..., None])
        grad, out = grad.float(), out.float()
        dv = torch.einsum("bhmn,bmhk->bnhk", _as_input(weights, q), grad)
        d_weights = torch.einsum("bmhk,bnhk->bhmn", grad, v.float())
        rowsum = (grad * out).sum(-1).transpose(1, 2)[..., None]
        d_scores = _as_input(weights * (d_weights - rowsum), q)  # scaled after, as FA2 does
        dq = torch.einsum("bhmn,bnhk->bmhk", d_scores, k.float()) * scale
        dk = torch.einsum("bhmn,bmhk->bnhk", d_scores, q.float()) * scale
        dk, dv = _summed(dk, kv_heads), _summed(dv, kv_heads)
        return dq.to(q.dtype), dk.to(k_dtype), dv.to(k_dtype)


class EmulatedXformers(XformersBackend):
    """The backend's plans and merging on a CPU, with xFormers' kernels emulated."""

    name = "xformers-emulated"
    capabilities = dataclasses.replace(
        XformersBackend.capabilities, devices=("cpu",), backward=("cpu",)
    )

    def __init__(self) -> None:
        super().__init__(EmulatedKernels())
