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
from ..patterns import Pattern
from ..scores import score_dtype
from .base import FLOATS, Backend, Capabilities, head_index
from .block_plan import GroupPlan, gather_blocks, key_windows, plan


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

    def _frame(self, call: AttentionCall, part: Pattern) -> Frame:
        size = self.block_size
        return build_frame(part.stride, call.q_len, call.kv_len, size, size, call.device)

    def scored_pairs(self, call: AttentionCall) -> int:
        return sum(
            g.masked.numel()
            for part in call.pattern.parts()
            for g in plan(part, self._frame(call, part), self.waste)
        )

    def forward(self, call: AttentionCall) -> tuple[Tensor, None]:
        dtype = self.compute_dtype
        if dtype is None:
            dtype = (
                torch.float32 if call.q.dtype in (torch.bfloat16, torch.float16) else call.q.dtype
            )
        parts = call.pattern.parts()
        if len(parts) == 1 and call.score.kind == "dot":
            return self._fused(call, parts[0], dtype).to(call.q.dtype), None
        partials = [self._attend_part(call, part, dtype) for part in parts]
        return merge(partials).to(call.q.dtype), None

    def _fused(self, call: AttentionCall, part: Pattern, dtype: torch.dtype) -> Tensor:
        """One part, dot-product scores: PyTorch's fused SDPA kernel on each group's blocks (a
        strided view for band windows, gathered copies otherwise), with the group's mask. Same
        result as the explicit path without its separate passes over the scores."""
        frame = self._frame(call, part)
        q, k, v = (
            frame.q.gather(call.q.to(dtype)),
            frame.k.gather(call.k.to(dtype)),
            frame.k.gather(call.v.to(dtype)),
        )
        padded = None
        if call.key_padding_mask is not None:
            padded = frame.k.gather(call.key_padding_mask[:, :, None])[..., 0]  # (B, slots)
        groups = plan(part, frame, self.waste)
        outs = [
            self._fused_group(call, frame, g, q, k, v, padded) for g in groups
        ]  # (B, H, R, bq, Dv)
        if (
            len(groups) == 1
            and groups[0].rows.numel() == frame.q.num_blocks
            and groups[0].window is not None
        ):
            output = outs[0]  # one band window over every query block, in order
        else:
            B, H = call.q.shape[:2]
            output = v.new_zeros(B, H, frame.q.num_blocks, frame.q.block, v.shape[-1])
            if groups:
                rows = torch.cat([g.rows for g in groups])
                output = output.index_copy(2, rows, torch.cat(outs, dim=2))
        return frame.q.scatter(output.flatten(2, 3), dim=2)  # (B, H, Lq, Dv)

    def _fused_group(
        self,
        call: AttentionCall,
        frame: Frame,
        group: GroupPlan,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        padded: Tensor | None,
    ) -> Tensor:
        B, H = q.shape[:2]
        mask, has_key = self._mask(call, group, padded, B, H, q.dtype)  # (B or 1, R, 1 or H, ...)
        if group.window is not None:  # keys as overlapping windows, one sequence at a time
            per_sequence = [
                self._windowed(call, frame, group, q[b], k[b], v[b], mask[b % mask.shape[0]])
                for b in range(B)
            ]
            out = torch.stack(per_sequence) if B > 1 else per_sequence[0][None]  # (B, R, H, bq, Dv)
        else:
            R = group.rows.numel()

            def heads_inside(x: Tensor) -> Tensor:  # (B, H, R, L, D) -> (B * R, H, L, D)
                return x.transpose(1, 2).flatten(0, 1)

            q_blk = q.unflatten(2, (-1, frame.q.block)).index_select(2, group.rows)
            k_blk = gather_blocks(k, group.kv_index, group.width, frame.k.block)
            v_blk = gather_blocks(v, group.kv_index, group.width, frame.k.block)
            out = torch.nn.functional.scaled_dot_product_attention(
                heads_inside(q_blk), heads_inside(k_blk), heads_inside(v_blk),
                attn_mask=mask.expand(B, -1, -1, -1, -1).flatten(0, 1),
                dropout_p=call.dropout_p, scale=call.scale,
            ).unflatten(0, (B, R))  # fmt: skip
        if has_key is not None:
            out = out * has_key.to(out.dtype)
        return out.transpose(1, 2)  # (B, H, R, bq, Dv)

    @staticmethod
    def _mask(
        call: AttentionCall,
        group: GroupPlan,
        padded: Tensor | None,
        B: int,
        H: int,
        dtype: torch.dtype,
    ) -> tuple[Tensor, Tensor | None]:
        """The additive mask (0 allowed, -inf not), (B or 1, R, 1 or H, bq, W*bk), and where some
        query has no key at all, its (B or 1, R, 1, bq, 1) indicator to zero its output after the
        kernel (which would divide 0 by 0). Without padding or bias both come from the plan."""
        if padded is None and call.bias is None:
            mask, has_key = group.additive(dtype)
            return mask[None], has_key
        masked = group.masked[None]  # (1, R, bq, W*bk)
        if padded is not None:
            masked = masked | padded[:, group.k_slot][:, :, None, :]  # (B, R, bq, W*bk)
        has_key = ~masked.all(dim=-1, keepdim=True)
        masked = masked & has_key  # a query with no key sees everything, then gets zero
        bias = torch.zeros((), dtype=dtype, device=masked.device)
        if call.bias is not None:
            heads = head_index(H, masked.device, 3)
            bias = (
                call.bias(heads, group.q_pos, group.k_pos).to(dtype).transpose(0, 1)
            )  # (R, H, ...)
        mask = bias.masked_fill(masked[:, :, None], float("-inf"))
        return mask, has_key[:, :, None]

    def _windowed(
        self,
        call: AttentionCall,
        frame: Frame,
        group: GroupPlan,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        mask: Tensor,
    ) -> Tensor:
        """One sequence: (H, slots, D) each -> (R, H, bq, Dv), keys read as band windows."""
        R, window = group.rows.numel(), group.window
        q_rows = q.unflatten(1, (-1, frame.q.block)).narrow(1, window.first, R).transpose(0, 1)
        keys = key_windows(k, window, R, frame.k.block)
        values = key_windows(v, window, R, frame.k.block)
        return torch.nn.functional.scaled_dot_product_attention(
            q_rows, keys, values, attn_mask=mask, dropout_p=call.dropout_p, scale=call.scale
        )

    def _attend_part(self, call: AttentionCall, part: Pattern, dtype: torch.dtype) -> Partial:
        frame = self._frame(call, part)
        q, k = call.score.prepare(call.q.to(dtype), call.k.to(dtype))
        q, k, v = frame.q.gather(q), frame.k.gather(k), frame.k.gather(call.v.to(dtype))
        padding = call.key_padding_mask
        padded = None if padding is None else frame.k.gather(padding[:, :, None])[..., 0]
        B, H = call.q.shape[:2]
        blocks, bq = frame.q.num_blocks, frame.q.block
        score = score_dtype(v)
        output = v.new_zeros(B, H, blocks, bq, v.shape[-1])
        denominator = q.new_zeros(B, H, blocks, bq, dtype=score)
        peak = q.new_full((B, H, blocks, bq), float("-inf"), dtype=score)
        groups = plan(part, frame, self.waste)
        if groups:
            sums = [self._attend_group(call, frame, g, q, k, v, padded) for g in groups]
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
        frame: Frame,
        group: GroupPlan,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        padded: Tensor | None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        q_blk = q.unflatten(2, (-1, frame.q.block)).index_select(2, group.rows)  # (B, H, R, bq, D)
        k_blk = gather_blocks(k, group.kv_index, group.width, frame.k.block)  # (B, H, R, W*bk, D)
        v_blk = gather_blocks(v, group.kv_index, group.width, frame.k.block)  # (B, H, R, W*bk, Dv)
        masked = group.masked[None]  # (1, R, bq, W*bk)
        if padded is not None:
            masked = masked | padded[:, group.k_slot][:, :, None, :]  # (B, R, bq, W*bk)

        scores = call.score.pairwise(q_blk, k_blk)  # (B, H, R, bq, W*bk)
        if call.bias is not None:
            heads = head_index(scores.shape[1], q.device, 3)
            scores = scores + call.bias(heads, group.q_pos, group.k_pos)
        scores = scores.masked_fill(masked[:, None], float("-inf"))
        peak = scores.amax(dim=-1).detach()
        exp = torch.exp(scores - torch.where(torch.isfinite(peak), peak, 0)[..., None])
        denominator = exp.sum(dim=-1)
        if call.dropout_p:
            exp = torch.nn.functional.dropout(exp, call.dropout_p)
        # Normalise after the product: a (bq, Dv) division instead of a (bq, W*bk) one.
        output = (exp.to(v.dtype) @ v_blk) / torch.where(denominator > 0, denominator, 1)[..., None]
        return output, denominator, peak
