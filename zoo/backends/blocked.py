"""Pure PyTorch block-sparse attention: gather the key blocks each query block needs, attend inside
them, and nothing else. Real sparsity with autograd on any device, without a compiler.

Each part of the pattern (see ``Pattern.parts``) runs in its own token order (see ``zoo.frames``).
Query blocks are grouped by how many key blocks they need (``BlockLayout.row_groups``), so global
rows do not make the rest dense. Every group keeps unnormalised sums: numerator, denominator and
the row maximum; parts merge exactly, as FlashAttention merges key blocks. Memory is
O(B * H * computed pairs): a query block's scores against its gathered keys, never n x n.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..call import AttentionCall
from ..checks import check_int
from ..frames import Frame, build_frame
from ..layout import RowGroup, build_layout
from ..patterns import Pattern
from ..scores import score_dtype
from .base import FLOATS, Backend, Capabilities, head_index, key_keep


@dataclass
class Partial:
    """Unnormalised attention over one part's keys, in the original query order."""

    numerator: Tensor  # (B, H, Lq, Dv), float32
    denominator: Tensor  # (B, H, Lq)
    peak: Tensor  # (B, H, Lq), detached; -inf where the part allows no key


def merge(partials: list[Partial]) -> Tensor:
    """softmax(all scores) @ v from the parts' sums; zero for a query that no part lets attend."""
    if len(partials) == 1:
        numerator, denominator = partials[0].numerator, partials[0].denominator
    else:
        peak = torch.stack([p.peak for p in partials]).amax(dim=0)
        peak = torch.where(torch.isfinite(peak), peak, 0)
        weights = [torch.exp(p.peak - peak) for p in partials]
        numerator = sum(w[..., None] * p.numerator for w, p in zip(weights, partials, strict=True))
        denominator = sum(w * p.denominator for w, p in zip(weights, partials, strict=True))
    return numerator / torch.where(denominator > 0, denominator, 1)[..., None]


def gather_blocks(x: Tensor, blocks: Tensor, block: int) -> Tensor:
    """(B, H, slots, D) -> (B, H, R, W * block, D): the key blocks named in each row of ``blocks``.

    A key block is gathered for several query blocks, so its gradient is a sum of copies; in
    bfloat16 that sum loses digits. Gathering from a float32 view makes the backward accumulate in
    float32, as one matmul would.
    """
    source = x.float() if x.dtype in (torch.bfloat16, torch.float16) else x
    return source.unflatten(2, (-1, block))[:, :, blocks].flatten(3, 4).to(x.dtype)


class BlockedBackend(Backend):
    """Block-sparse attention in plain PyTorch; ``block_size`` is the kernel block (64 by default)."""

    name = "blocked"
    capabilities = Capabilities(
        devices=("cpu", "cuda"),
        backward=("cpu", "cuda"),
        dtypes=(*FLOATS, torch.float64),
        patterns="any",
        scores=("dot", "additive"),
        score_bias=True,
        dropout=True,
        sparse=True,
    )

    def __init__(self, block_size: int = 64, waste: float = 0.25) -> None:
        self.block_size = check_int("block_size", block_size)
        self.waste = waste

    def __repr__(self) -> str:
        return f"BlockedBackend(block_size={self.block_size})"

    def forward(self, call: AttentionCall) -> tuple[Tensor, None]:
        partials = [self._attend_part(call, part) for part in call.pattern.parts()]
        return merge(partials).to(call.q.dtype), None

    def _attend_part(self, call: AttentionCall, part: Pattern) -> Partial:
        frame = build_frame(part.stride, call.q_len, call.kv_len, self.block_size, self.block_size, call.device)
        layout = build_layout(part, frame)
        q, k = call.score.prepare(call.q, call.k)
        q, k, v = frame.q.gather(q), frame.k.gather(k), frame.k.gather(call.v)
        keep = frame.k.valid[None]  # (1 or B, slots)
        padding = key_keep(call)
        if padding is not None:
            keep = keep & frame.k.gather(padding[:, :, None])[..., 0]
        B, H = call.q.shape[:2]
        dtype = score_dtype(call.q)
        numerator = q.new_zeros(B, H, frame.q.num_blocks, frame.q.block, v.shape[-1], dtype=dtype)
        denominator = q.new_zeros(B, H, frame.q.num_blocks, frame.q.block, dtype=dtype)
        peak = q.new_full((B, H, frame.q.num_blocks, frame.q.block), float("-inf"), dtype=dtype)
        groups = layout.row_groups(self.waste)
        if groups:
            sums = [self._attend_group(call, part, frame, g, q, k, v, keep) for g in groups]
            rows = torch.cat([g.rows for g in groups])
            numerator = numerator.index_copy(2, rows, torch.cat([s[0] for s in sums], dim=2))
            denominator = denominator.index_copy(2, rows, torch.cat([s[1] for s in sums], dim=2))
            peak = peak.index_copy(2, rows, torch.cat([s[2] for s in sums], dim=2))

        def original_order(x: Tensor) -> Tensor:  # (B, H, blocks, bq, ...) -> (B, H, Lq, ...)
            return frame.q.scatter(x.flatten(2, 3), dim=2)

        return Partial(original_order(numerator), original_order(denominator), original_order(peak))

    def _attend_group(
        self,
        call: AttentionCall,
        part: Pattern,
        frame: Frame,
        group: RowGroup,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        keep: Tensor,
    ) -> tuple[Tensor, Tensor, Tensor]:
        bq, bk = frame.q.block, frame.k.block
        rows, kv_blocks = group.rows, group.kv_blocks  # (R,), (R, W)
        q_blk = q.unflatten(2, (-1, bq))[:, :, rows]  # (B, H, R, bq, D)
        k_blk = gather_blocks(k, kv_blocks, bk)  # (B, H, R, W*bk, D)
        v_blk = gather_blocks(v, kv_blocks, bk)  # (B, H, R, W*bk, Dv)
        k_slot = (kv_blocks[..., None] * bk + torch.arange(bk, device=q.device)).flatten(1)  # (R, W*bk)
        q_pos = frame.q.position.view(-1, bq)[rows][:, :, None]  # (R, bq, 1)
        k_pos = frame.k.position[k_slot][:, None, :]  # (R, 1, W*bk)
        allowed = part.allowed(q_pos, k_pos) & group.used.repeat_interleave(bk, dim=1)[:, None, :]
        allowed = allowed & keep[:, k_slot][:, :, None, :]  # (B or 1, R, bq, W*bk)

        scores = call.score.pairwise(q_blk, k_blk)  # (B, H, R, bq, W*bk)
        if call.bias is not None:
            scores = scores + call.bias(head_index(scores.shape[1], q.device, 3), q_pos, k_pos)
        scores = scores.masked_fill(~allowed[:, None], float("-inf"))
        peak = scores.amax(dim=-1).detach()
        exp = torch.exp(scores - torch.where(torch.isfinite(peak), peak, 0)[..., None])
        denominator = exp.sum(dim=-1)
        if call.dropout_p:
            exp = torch.nn.functional.dropout(exp, call.dropout_p)
        numerator = (exp.to(v.dtype) @ v_blk).to(exp.dtype)
        return numerator, denominator, peak
