"""xFormers' ``memory_efficient_attention`` with its structured attention biases.

A pattern runs as the pieces of its plan (``plan.py``): one piece over the whole call (full,
causal, a local window) is one ``memory_efficient_attention`` call; otherwise each piece (a
window plus global tokens, block-local chunks, as a batch of windows where it repeats) runs
through ``memory_efficient_attention_partial``, which also returns each query's log-sum-exp,
and the pieces that hold a query merge exactly by it (``lse_merge``). The backward pass gives
every piece the merged output and log-sum-exp: with those, each piece's softmax is the whole
pattern's softmax restricted to its keys, so the pieces' gradients add up to the pattern's
gradient exactly (FlashAttention's backward over key blocks, with pieces for blocks). A piece
takes the gradients its role names: dq of its queries, dk and dv of its kept keys, or all three;
block-local chunks run by queries for the output and dq and by keys for dk and dv, so that each
comes from one call, rounded once (FlashAttention returns every result in bf16 or fp16: merged,
a sum of several rounded calls is rounded again).

Imported lazily. xFormers' wheels carry compiled operators built for one torch version; where the
package is missing, its operators do not load against the installed torch, or there is no CUDA
device, the backend reports itself unavailable with that reason and ``auto`` never takes it.
Grouped k and v run in xFormers' 5-D layout (``grouped_layout``), expanded over each group's query
heads without a copy. It takes no key padding mask and no score bias; composed patterns have no
dropout (the partial kernel has none). Windows and merged pieces run only on xFormers'
FlashAttention kernels (bf16 or fp16, one head size up to 256, see ``kernel_reason``); whole-call
full and causal attention also on its cutlass kernel (float32 too).
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Protocol

import torch
from torch import Tensor

from ...core.call import AttentionCall
from ...core.shape_cache import outside_graph
from ...layout.block_layout import allowed_pairs
from ..base import Backend, Capabilities
from ..lse_merge import lse_for_backward, merge_rows
from .plan import Mask, Piece, plan_pieces


@outside_graph  # a host fact (its imports, a probe): a constant where a compiled call asks
def _unavailable() -> str | None:
    # the marker on a plain function: dynamo calls an lru_cache's inner function, uncached
    return _probe()


@lru_cache(maxsize=1)
def _probe() -> str | None:
    try:
        import xformers
    except ImportError as error:
        return f"xformers is not installed ({error}); pip install attention-zoo[xformers]"
    versions = f"xformers {xformers.__version__} on torch {torch.__version__}"
    try:
        import xformers.ops as xops
    except Exception as error:  # it checks torch's FlashAttention at import
        return f"{versions} does not import: {error}"
    if not torch.cuda.is_available():
        return "xformers' memory_efficient_attention needs a CUDA device"
    if not getattr(xformers, "_has_cpp_library", True):
        # Without its _C (built for one torch and CUDA runtime) xFormers refuses every CUDA
        # operator, its torch-backed FlashAttention ones too (ops/fmha/common.py).
        cause = getattr(xformers._cpp_lib, "_cpp_library_load_exception", None)
        cause = getattr(cause, "__cause__", None) or cause
        return f"{versions} cannot load its compiled _C ({cause}), so it runs no operator"
    try:  # forward and backward: a wheel can carry one without the other
        # ones, not randn: a probe must not move the global (CUDA) random state
        probe = torch.ones(1, 8, 1, 64, device="cuda", dtype=torch.float16, requires_grad=True)
        xops.memory_efficient_attention(probe, probe, probe).sum().backward()
    except Exception as error:
        lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
        return f"{versions} cannot run attention here: {' '.join(lines[:4])[:400]}"
    return None


def kernel_reason(call: AttentionCall, pieces: list[Piece]) -> str | None:
    """What xFormers' kernels would refuse. Partial outputs and local windows run only on its
    FlashAttention kernels (bf16/fp16, one head size, a multiple of 8 up to 256); a whole-call
    full or causal mask also has the cutlass kernel, which takes float32."""
    d, dv = call.q.shape[-1], call.v.shape[-1]
    merged = len(pieces) > 1 or pieces[0].count > 1
    flash_only = merged or isinstance(pieces[0].mask, tuple)
    if flash_only and (call.q.dtype == torch.float32 or d != dv or d % 8 or d > 256):
        return (
            "its kernels for windows and merged pieces (FlashAttention) take bf16 or fp16 with "
            f"one head size, a multiple of 8 up to 256, not {str(call.q.dtype)[6:]} with "
            f"q/k {d} and v {dv}"
        )
    align = 4 if call.q.dtype == torch.float32 else 8
    if d % align or dv % align:
        return f"its kernels need head sizes that are multiples of {align}, not {d} and {dv}"
    return None


class Kernels(Protocol):
    """The three kernel calls the backend makes; tensors in xFormers' (B, M, H, K) layout."""

    def attention(self, q: Tensor, k: Tensor, v: Tensor, mask: Mask, scale: float, p: float):
        """softmax(q k^T * scale + mask) v, differentiable, in q's dtype. k and v may have fewer
        heads than q (grouped-query attention); so in the other two, whose dk and dv then have
        the heads of k and v."""

    def partial(self, q: Tensor, k: Tensor, v: Tensor, mask: Mask, scale: float):
        """(out (B, M, H, Kv), lse float32 (B, H, M)). FlashAttention's out comes in q's dtype
        and its lse is +inf on a row without keys (others give -inf); the merge takes both."""

    def backward(self, grad, out, lse, q, k, v, mask: Mask, scale: float):
        """(dq, dk, dv) of one piece, given the merged output and log-sum-exp."""


def attention_bias(mask: Mask):
    """The xFormers bias object for a slice's mask."""
    from xformers.ops.fmha import attn_bias

    if mask is None:
        return None
    if mask == "causal":
        return attn_bias.LowerTriangularFromBottomRightMask()
    return attn_bias.LocalAttentionFromBottomRightMask(window_left=mask[0], window_right=mask[1])


def grouped_layout(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Grouped k and v (B, M, H_kv, K) in xFormers' 5-D (B, M, G, H, K) layout, as its docs ask for
    grouped-query attention: q split into G = H_kv groups of H / H_kv heads, k and v expanded over
    a group's heads (stride 0, no copy)."""
    groups = q.shape[2] // k.shape[2]
    if groups == 1:
        return q, k, v
    k, v = (t.unsqueeze(3).expand(-1, -1, -1, groups, -1) for t in (k, v))
    return q.unflatten(2, (-1, groups)), k, v


def shared_gradient(grad: Tensor) -> Tensor:
    """The gradient of an expanded (B, M, G, H, K) k or v, back to (B, M, G, K): a sum over the
    heads that shared it, unless the kernel summed already and expanded the sum (stride 0)."""
    return grad[:, :, :, 0] if grad.stride(3) == 0 else grad.sum(3)


class XformersKernels:
    """The real kernels. Tensors arrive in (B, M, H, K) with k and v of H_kv heads; grouped ones
    run in the 5-D layout of ``grouped_layout``, results come back in 4-D."""

    def attention(self, q, k, v, mask, scale, p):
        import xformers.ops as xops

        out = xops.memory_efficient_attention(
            *grouped_layout(q, k, v), attn_bias=attention_bias(mask), p=p, scale=scale
        )
        return out.flatten(2, 3) if out.dim() == 5 else out

    def partial(self, q, k, v, mask, scale):
        from xformers.ops import fmha

        # No output_dtype: only the split-k inference kernel takes one.
        out, lse = fmha.memory_efficient_attention_partial(
            *grouped_layout(q, k, v), attn_bias=attention_bias(mask), scale=scale
        )
        if out.dim() == 5:  # (B, M, G, H, K) and (B, G, H, M)
            out, lse = out.flatten(2, 3), lse.flatten(1, 2)
        return out, lse[..., : q.shape[1]]  # some kernels pad the log-sum-exp's length

    def backward(self, grad, out, lse, q, k, v, mask, scale):
        from xformers.ops import fmha

        q5, k5, v5 = grouped_layout(q, k, v)
        if q5.dim() == 4:
            return fmha.memory_efficient_attention_backward(
                grad, out, lse, q, k, v, attn_bias=attention_bias(mask), scale=scale
            )
        groups = q5.shape[2]
        dq, dk, dv = fmha.memory_efficient_attention_backward(
            grad.unflatten(2, (groups, -1)), out.unflatten(2, (groups, -1)),
            lse.unflatten(1, (groups, -1)), q5, k5, v5, attn_bias=attention_bias(mask),
            scale=scale,
        )  # fmt: skip
        return dq.flatten(2, 3), shared_gradient(dk), shared_gradient(dv)


def _windows(x: Tensor, span: tuple[int, int], piece: Piece, dim: int = 1) -> Tensor:
    """x's ``span`` (the first window's rows or keys) along ``dim``, with the piece's further
    windows moved on by its step, as a batch: (B, M, ...) to (B * count, M_span, ...) for dim 1;
    (B, H, M) to (B * count, H, M_span) for dim 2 (a log-sum-exp)."""
    start, stop = span
    if piece.count == 1:
        return x.narrow(dim, start, stop - start)
    size, step = stop - start, piece.step
    x = x.narrow(dim, start, (piece.count - 1) * step + size)
    if size == step:  # aligned chunks: a reshape, a view where x allows one
        x = x.unflatten(dim, (piece.count, size))
    else:  # overlapping windows: a copy
        x = x.unfold(dim, size, step).movedim(-1, dim + 1)
    return x.movedim(dim, 1).flatten(0, 1)


def _joined(x: Tensor, batch: int, used: int, dim: int = 1) -> Tensor:
    """The inverse of ``_windows`` for results of which each window's first ``used`` rows or keys
    count, windows that tile their span (used == step where there are several)."""
    x = x.narrow(dim, 0, used).unflatten(0, (batch, -1))  # (B, count, ...)
    return x.movedim(1, dim).flatten(dim, dim + 1)


def _slices(piece: Piece, *tensors: Tensor) -> list[Tensor]:
    """q-like tensors cut to the piece's rows, then k-like ones to its keys, as window batches."""
    q_like, k_like = tensors[: len(tensors) - 2], tensors[-2:]
    return [_windows(t, piece.rows, piece) for t in q_like] + [
        _windows(t, piece.keys, piece) for t in k_like
    ]


def _span(piece: Piece, used: int, first: int) -> slice:
    """Where a piece's results (``used`` per window) go: from its first row or key on."""
    return slice(first, first + (piece.count - 1) * piece.step + used)


class _PieceAttention(torch.autograd.Function):
    """The pieces' attention, merged, with the exact backward described in the module doc."""

    @staticmethod
    def forward(ctx, q, k, v, pieces, q_len, scale, kernels):
        partials, rows = [], []
        batch = q.shape[0]
        for piece in pieces:
            if not piece.outputs:
                continue
            pq, pk, pv = _slices(piece, q, k, v)
            out, lse = kernels.partial(pq, pk, pv, piece.mask, scale)
            lse = torch.where(lse == math.inf, -math.inf, lse)  # a row without keys, as FA2 says
            used = piece.shape[0]
            partials.append((_joined(out, batch, used), _joined(lse, batch, used, dim=2)))
            span = _span(piece, used, piece.rows[0])
            rows.append((span.start, span.stop))
        out, lse = merge_rows(rows, partials, q_len)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.pieces, ctx.scale, ctx.kernels = pieces, scale, kernels
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        lse = lse_for_backward(lse)
        grads = [torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in (q, k, v)]
        batch, grad = q.shape[0], grad.contiguous()
        for piece in ctx.pieces:
            pg, po, pq, pk, pv = _slices(piece, grad, out, q, k, v)
            piece_lse = _windows(lse, piece.rows, piece, dim=2).contiguous()
            dq, dk, dv = ctx.kernels.backward(pg, po, piece_lse, pq, pk, pv, piece.mask, ctx.scale)
            if piece.outputs:
                rows = piece.shape[0]
                grads[0][:, _span(piece, rows, piece.rows[0])] += _joined(dq, batch, rows)
            if piece.key_grads:
                kept, keys = piece.kept_keys, _span(piece, piece.kept_keys, piece.keys[0])
                grads[1][:, keys] += _joined(dk, batch, kept)
                grads[2][:, keys] += _joined(dv, batch, kept)
        dq, dk, dv = (g.to(t.dtype) for g, t in zip(grads, (q, k, v), strict=True))
        return dq, dk, dv, None, None, None, None


def _one_call(pieces: list[Piece], call: AttentionCall) -> bool:
    """Whether the plan is one kernel call over the whole call (which takes dropout)."""
    piece = pieces[0]
    whole = piece.rows == (0, call.q_len) and piece.keys == (0, call.kv_len)
    return len(pieces) == 1 and piece.count == 1 and whole


class XformersBackend(Backend):
    name = "xformers"
    capabilities = Capabilities(
        devices=("cuda",),
        backward=("cuda",),
        dtypes=(torch.float32, torch.bfloat16, torch.float16),
        patterns="any",
        dropout=True,
        sparse=True,  # its local-window kernel skips the blocks outside the window
    )

    def __init__(self, kernels: Kernels | None = None) -> None:
        self.kernels = kernels or XformersKernels()

    def unavailable(self) -> str | None:
        return _unavailable() if isinstance(self.kernels, XformersKernels) else None

    def plan(self, call: AttentionCall) -> list[Piece] | str:
        """The call's pieces, or why there are none."""
        return plan_pieces(call.pattern, call.q_len, call.kv_len)

    def scored_pairs(self, call: AttentionCall) -> int:
        """The pattern's pairs, which its pieces partition: the kernels skip the tiles outside a
        window, so this is what they approach (tiles on a window's edge compute a few more)."""
        return allowed_pairs(call.pattern, call.q_len, call.kv_len)

    def reason_against(self, call: AttentionCall) -> str | None:
        reason = super().reason_against(call)
        if reason is None and call.key_padding_mask is not None:
            reason = "it takes no key padding mask"
        if reason is None:
            pieces = self.plan(call)
            if isinstance(pieces, str):
                reason = f"{pieces} (the pattern of {call.variant!r})"
            elif call.dropout_p > 0 and not _one_call(pieces, call):
                reason = (
                    "it has no dropout for patterns merged from several kernel calls or run as a "
                    "batch of windows (its partial kernel has none)"
                )
            elif isinstance(self.kernels, XformersKernels):
                reason = kernel_reason(call, pieces)
        return reason

    def forward(self, call: AttentionCall) -> tuple[Tensor, None]:
        pieces = self.plan(call)
        assert not isinstance(pieces, str), pieces  # reason_against ran first
        q, k, v = (t.transpose(1, 2) for t in (call.q, call.k, call.v))  # xFormers' (B, M, H, K)
        if _one_call(pieces, call):
            out = self.kernels.attention(q, k, v, pieces[0].mask, call.scale, call.dropout_p)
        else:
            out = _PieceAttention.apply(q, k, v, pieces, call.q_len, call.scale, self.kernels)
        return out.transpose(1, 2), None
