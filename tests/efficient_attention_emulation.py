"""PyTorch's memory-efficient CUDA attention ops (``_scaled_dot_product_efficient_attention`` and
its backward) emulated in plain PyTorch on a CPU, with the requirements the CUDA kernel checks
(attention_backward.cu, kernel_forward.h's ``check_supported``) raised as errors and its output
layouts reproduced: a log-sum-exp padded to a multiple of 32 queries (padding NaN here, so that a
reader that does not crop it shows), an output stored (B, M, H, Dv), and a row whose keys are all
masked given NaN (the worst a kernel may give). The ``blocked`` backend's CUDA wrapping
(``zoo.backends.lse_kernel.cuda_kernel``) runs on these in tests/backends/test_lse_kernel.py."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

ALIGN = 8  # elements: the strictest of the kernels' minimum alignments that the wrapping meets
BIAS_ROWS = 16  # elements between mask rows (SDPA pads its own masks to this)


def _check_inputs(q, k, v, bias, backward: bool = False) -> None:
    """The forward's checks; the backward's also hold a single query row's mask stride to the
    alignment (attention_backward.cu's check_supported: no ``num_queries <= 1 ||``)."""
    B, H, M, _ = q.shape
    N = k.shape[2]
    for name, x in (("query", q), ("key", k), ("value", v)):
        if x.stride(-1) != 1:
            raise RuntimeError(f"{name}: last dimension must be contiguous")
        if x.shape[-1] % ALIGN or x.stride(2) % ALIGN:
            raise RuntimeError(f"{name} is not correctly aligned (strideM)")
    if bias is None:
        return
    if bias.dim() != 4 or tuple(bias.shape) != (B, H, M, N):
        raise RuntimeError(f"attn_bias: wrong shape {tuple(bias.shape)}, not {(B, H, M, N)}")
    if bias.dtype != q.dtype:
        raise RuntimeError("invalid dtype for bias - should match query's dtype")
    if bias.stride(3) != 1:
        raise RuntimeError("attn_bias: wrong alignment (last dimension must be contiguous)")
    for dim, size in ((0, B), (1, H), (2, M)):
        if (size > 1 or (backward and dim == 2)) and bias.stride(dim) % BIAS_ROWS:
            raise RuntimeError(f"attn_bias is not correctly aligned (stride {dim})")


def _scores(q, k, bias, scale):
    scores = (q.double() @ k.double().transpose(-1, -2)) * scale
    return scores if bias is None else scores + bias.double()


def _padded_rows(M: int) -> int:
    return math.ceil(M / 32) * 32


@dataclass
class EmulatedEfficientOps:
    """The two ops, counting their calls; ``nan_for_keyless``: a row with no key gets NaN."""

    calls: dict = field(
        default_factory=lambda: dict.fromkeys(
            ("forward", "backward", "varlen_forward", "varlen_backward"), 0
        )
    )

    def forward(self, q, k, v, bias, compute_log_sumexp, dropout_p, is_causal, *, scale):
        assert compute_log_sumexp and dropout_p == 0.0 and not is_causal
        _check_inputs(q, k, v, bias)
        self.calls["forward"] += 1
        B, H, M, _ = q.shape
        scores = _scores(q, k, bias, scale)
        lse = torch.logsumexp(scores, dim=-1)  # -inf for a row with no key
        out = torch.exp(scores - lse[..., None]) @ v.double()  # NaN for such a row
        stored = out.to(q.dtype).transpose(1, 2).contiguous().transpose(1, 2)  # (B, M, H, Dv)
        padded = torch.full(
            (B, H, _padded_rows(M)), float("nan"), dtype=torch.float32, device=q.device
        )
        padded[..., :M] = lse
        none = torch.empty((), dtype=torch.long)
        return stored, padded, none, none

    def backward(
        self, grad_out, q, k, v, bias, out, logsumexp, seed, offset, dropout_p, grad_input_mask,
        is_causal, *, scale,
    ):  # fmt: skip
        assert dropout_p == 0.0 and not is_causal and list(grad_input_mask[:3]) == [True] * 3
        _check_inputs(q, k, v, bias, backward=True)
        B, H, M, _ = q.shape
        if logsumexp.dtype != torch.float32 or tuple(logsumexp.shape) != (B, H, _padded_rows(M)):
            raise RuntimeError(f"logsumexp {tuple(logsumexp.shape)} is not the forward's")
        if not out.transpose(1, 2).is_contiguous():
            raise RuntimeError("out must be stored (B, M, H, Dv): its row stride is H * Dv")
        self.calls["backward"] += 1
        g = grad_out.double()
        probs = torch.exp(_scores(q, k, bias, scale) - logsumexp[..., :M, None].double())
        dv = probs.transpose(-1, -2) @ g
        row = (g * out.double()).sum(-1, keepdim=True)
        d_scores = probs * (g @ v.double().transpose(-1, -2) - row)
        dq = (d_scores @ k.double()) * scale
        dk = (d_scores.transpose(-1, -2) @ q.double()) * scale
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None

    # The variable-length forms (``_efficient_attention_forward`` / ``_backward`` with
    # cu_seqlens): (1, total, H, D) tensors, segment r the rows cu[r]:cu[r + 1] of each.

    def varlen_forward(
        self, q, k, v, bias, cu_q, cu_k, max_q, max_k, dropout_p, custom_mask_type,
        compute_log_sumexp, *, scale,
    ):  # fmt: skip
        assert compute_log_sumexp and dropout_p == 0.0 and custom_mask_type == 0
        segments = _check_varlen(q, k, v, bias, cu_q, cu_k, max_q, max_k)
        self.calls["varlen_forward"] += 1
        H, Dv = q.shape[2], v.shape[3]
        out = torch.full((1, q.shape[1], H, Dv), float("nan"), dtype=q.dtype, device=q.device)
        lse = torch.full(
            (len(segments), H, _padded_rows(max_q)), float("nan"), dtype=torch.float32,
            device=q.device,
        )  # fmt: skip
        for r, (rows, keys) in enumerate(segments):
            qs, ks, vs = (
                x[:, part].transpose(1, 2) for x, part in ((q, rows), (k, keys), (v, keys))
            )
            scores = _scores(qs, ks, None, scale)  # (1, H, n, N)
            here = torch.logsumexp(scores, dim=-1)
            out[:, rows] = (
                (torch.exp(scores - here[..., None]) @ vs.double()).transpose(1, 2).to(q.dtype)
            )
            lse[r, :, : rows.stop - rows.start] = here[0]
        none = torch.empty((), dtype=torch.long)
        return out, lse, none, none, max_q, max_k

    def varlen_backward(
        self, grad_out, q, k, v, bias, out, cu_q, cu_k, max_q, max_k, logsumexp, dropout_p,
        seed, offset, custom_mask_type, bias_requires_grad, *, scale,
    ):  # fmt: skip
        assert dropout_p == 0.0 and custom_mask_type == 0 and not bias_requires_grad
        segments = _check_varlen(q, k, v, bias, cu_q, cu_k, max_q, max_k)
        H, Dv = q.shape[2], v.shape[3]
        if tuple(logsumexp.shape) != (len(segments), H, _padded_rows(max_q)):
            raise RuntimeError(f"logsumexp {tuple(logsumexp.shape)} is not the forward's")
        if logsumexp.dtype != torch.float32:
            raise RuntimeError("logsumexp must be float32")
        if out.stride(3) != 1 or out.stride(2) != Dv or out.stride(1) != H * Dv:
            raise RuntimeError("out must be stored (1, M, H, Dv): its row stride is H * Dv")
        self.calls["varlen_backward"] += 1
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for r, (rows, keys) in enumerate(segments):
            n = rows.stop - rows.start
            qs, ks, vs = (
                x[:, part].transpose(1, 2) for x, part in ((q, rows), (k, keys), (v, keys))
            )
            g, o = (x[:, rows].transpose(1, 2).double() for x in (grad_out, out))
            probs = torch.exp(_scores(qs, ks, None, scale) - logsumexp[r, :, :n, None].double())
            row = (g * o).sum(-1, keepdim=True)
            d_scores = probs * (g @ vs.double().transpose(-1, -2) - row)
            dq[:, rows] = ((d_scores @ ks.double()) * scale).transpose(1, 2).to(q.dtype)
            dk[:, keys] = (
                ((d_scores.transpose(-1, -2) @ qs.double()) * scale).transpose(1, 2).to(k.dtype)
            )
            dv[:, keys] = (probs.transpose(-1, -2) @ g).transpose(1, 2).to(v.dtype)
        return dq, dk, dv, None


def _check_varlen(q, k, v, bias, cu_q, cu_k, max_q, max_k) -> list[tuple[slice, slice]]:
    """The checks of attention_backward.cu's variable-length mode (the forward's alike), and the
    segments' (rows, keys) slices."""
    if bias is not None:
        raise RuntimeError("cu seqlen + bias not supported")
    if q.dim() != 4 or q.shape[0] != 1:
        raise RuntimeError("cu_seqlen only supports batch_size=1")
    if cu_q.dtype != torch.int32 or cu_k.dtype != torch.int32 or cu_q.shape != cu_k.shape:
        raise RuntimeError("cu_seqlens must be int32, one entry per segment boundary each")
    for name, x in (("query", q), ("key", k), ("value", v)):
        if x.stride(-1) != 1 or x.shape[-1] % ALIGN or x.stride(1) % ALIGN:
            raise RuntimeError(f"{name} is not correctly aligned (strideM)")
    starts_q, starts_k = cu_q.tolist(), cu_k.tolist()
    if starts_q[-1] != q.shape[1] or starts_k[-1] != k.shape[1]:
        raise RuntimeError("cu_seqlens do not end at the packed lengths")
    segments = []
    for r in range(len(starts_q) - 1):
        rows, keys = slice(starts_q[r], starts_q[r + 1]), slice(starts_k[r], starts_k[r + 1])
        if rows.stop - rows.start > max_q or keys.stop - keys.start > max_k:
            raise RuntimeError("a segment longer than max_seqlen: the kernel would skip rows")
        segments.append((rows, keys))
    return segments
