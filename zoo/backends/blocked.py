"""Pure PyTorch block-sparse attention: gather the key blocks each query block needs, attend inside
them, and nothing else. Real sparsity with autograd on any device, without a compiler.

Each part of the pattern (see ``Pattern.parts``) runs in its own token order (see ``zoo.frames``).
Query blocks are grouped by how many key blocks they need (``BlockLayout.row_groups``), so global
rows do not make the rest dense. Each part keeps, per query, its normalised output, its softmax
mass and the row maximum, from which parts merge exactly, as FlashAttention merges key blocks.
Memory is O(B * H * computed pairs): a query block's scores against its gathered keys, never n^2.
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
    """Attention over one part's keys, in the original query order."""

    output: Tensor  # (B, H, Lq, Dv): softmax over this part's keys @ v; zero where it has none
    denominator: Tensor  # (B, H, Lq): sum of exp(score - peak) over this part's keys
    peak: Tensor  # (B, H, Lq), detached; -inf where the part allows no key


def merge(partials: list[Partial]) -> Tensor:
    """softmax over all parts' keys @ v, from each part's normalised output and its softmax mass.

    A part's share of a query's attention is denominator * exp(peak - overall peak), normalised
    over the parts; a query that no part lets attend gets zero.
    """
    if len(partials) == 1:
        return partials[0].output
    peak = torch.stack([p.peak for p in partials]).amax(dim=0)
    peak = torch.where(torch.isfinite(peak), peak, 0)
    mass = [p.denominator * torch.exp(p.peak - peak) for p in partials]
    total = sum(mass)
    total = torch.where(total > 0, total, 1)
    return sum((m / total)[..., None] * p.output for m, p in zip(mass, partials, strict=True))


def gather_blocks(x: Tensor, blocks: Tensor, block: int) -> Tensor:
    """(B, H, slots, D) -> (B, H, R, W * block, D): the blocks named in each row of ``blocks``."""
    return x.unflatten(2, (-1, block))[:, :, blocks].flatten(3, 4)


class BlockedBackend(Backend):
    """Block-sparse attention in plain PyTorch.

    Args:
        block_size: the kernel block, for queries and keys (64 by default).
        compute_dtype: the dtype of the block matmuls. By default float32 for 16-bit inputs: a key
            block is gathered for several query blocks, so its gradient is a sum of per-block
            matmul results, and rounding each of them to bfloat16 doubles the gradient error of
            one dense matmul (measured in tests/test_backends.py). Pass torch.bfloat16 to trade
            that precision for speed.
    """

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

    def __init__(
        self, block_size: int = 64, compute_dtype: torch.dtype | None = None, waste: float = 0.25
    ) -> None:
        self.block_size = check_int("block_size", block_size)
        self.compute_dtype = compute_dtype
        self.waste = waste

    def __repr__(self) -> str:
        dtype = "" if self.compute_dtype is None else f", compute_dtype={self.compute_dtype}"
        return f"BlockedBackend(block_size={self.block_size}{dtype})"

    def scored_pairs(self, call: AttentionCall) -> int:
        total = 0
        for part in call.pattern.parts():
            frame = build_frame(
                part.stride, call.q_len, call.kv_len, self.block_size, self.block_size, call.device
            )
            for group in build_layout(part, frame).row_groups(self.waste):
                total += group.kv_blocks.numel() * frame.q.block * frame.k.block
        return total

    def forward(self, call: AttentionCall) -> tuple[Tensor, None]:
        dtype = self.compute_dtype
        if dtype is None:
            dtype = (
                torch.float32 if call.q.dtype in (torch.bfloat16, torch.float16) else call.q.dtype
            )
        partials = [self._attend_part(call, part, dtype) for part in call.pattern.parts()]
        return merge(partials).to(call.q.dtype), None

    def _attend_part(self, call: AttentionCall, part: Pattern, dtype: torch.dtype) -> Partial:
        frame = build_frame(
            part.stride, call.q_len, call.kv_len, self.block_size, self.block_size, call.device
        )
        layout = build_layout(part, frame)
        q, k = call.score.prepare(call.q.to(dtype), call.k.to(dtype))
        q, k, v = frame.q.gather(q), frame.k.gather(k), frame.k.gather(call.v.to(dtype))
        keep = frame.k.valid[None]  # (1 or B, slots)
        padding = key_keep(call)
        if padding is not None:
            keep = keep & frame.k.gather(padding[:, :, None])[..., 0]
        B, H = call.q.shape[:2]
        dtype = score_dtype(v)
        output = v.new_zeros(B, H, frame.q.num_blocks, frame.q.block, v.shape[-1])
        denominator = q.new_zeros(B, H, frame.q.num_blocks, frame.q.block, dtype=dtype)
        peak = q.new_full((B, H, frame.q.num_blocks, frame.q.block), float("-inf"), dtype=dtype)
        groups = layout.row_groups(self.waste)
        if groups:
            sums = [self._attend_group(call, part, frame, g, q, k, v, keep) for g in groups]
            rows = torch.cat([g.rows for g in groups])
            output = output.index_copy(2, rows, torch.cat([s[0] for s in sums], dim=2))
            denominator = denominator.index_copy(2, rows, torch.cat([s[1] for s in sums], dim=2))
            peak = peak.index_copy(2, rows, torch.cat([s[2] for s in sums], dim=2))

        def original_order(x: Tensor) -> Tensor:  # (B, H, blocks, bq, ...) -> (B, H, Lq, ...)
            return frame.q.scatter(x.flatten(2, 3), dim=2)

        return Partial(original_order(output), original_order(denominator), original_order(peak))

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
        k_slot = (kv_blocks[..., None] * bk + torch.arange(bk, device=q.device)).flatten(
            1
        )  # (R, W*bk)
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
        weights = exp / torch.where(denominator > 0, denominator, 1)[..., None]
        if call.dropout_p:
            weights = torch.nn.functional.dropout(weights, call.dropout_p)
        # Normalised weights meet v in v's dtype, as in FlashAttention: one rounding of the output.
        return weights.to(v.dtype) @ v_blk, denominator, peak
