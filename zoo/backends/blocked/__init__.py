"""Pure PyTorch block-sparse attention: gather the key blocks each query block needs, attend inside
them, and nothing else. Real sparsity with autograd on any device, without a compiler.

Each part of the pattern (see ``Pattern.parts``) runs in its own token order (see
``zoo.layout.frames``). Query blocks are grouped by how many key blocks they need
(``BlockLayout.row_groups``), so global rows do not make the rest dense; a band of key blocks is
read as a strided view, other blocks are gathered (``block_plan``). Two paths:

- fused: one part and dot-product scores. PyTorch's fused SDPA kernel runs on each group's blocks
  with the group's mask, without separate passes over the scores.
- explicit: several parts (strided, dilated unions) or additive scores. Scores are materialised
  per group; each part keeps, per query, its normalised output, its softmax mass and the row
  maximum, from which the parts merge exactly, as FlashAttention merges key blocks.

Memory is O(B * H * computed pairs) in both: a query block against its keys, never n x n.

Layouts chosen by content (MoBA) run key block by key block (``by_key``, CPU and CUDA): the
queries that chose a key block attend it in one kernel call and merge by log-sum-exp, so the cost
is the chosen pairs; where that path does not apply, the union per query block
(``chosen_union``).
A fixed layout that differs per query head (``Pattern.per_head``: BigBird's random blocks drawn
per head) runs head by head (``by_head``): each query head's layout is a fixed pattern
(``Pattern.head``) with its own plan, built once per shape, against its key/value head, so its
band windows, shared global blocks and memory bounds are those of one layout; the cost is a
kernel call per head and group instead of per group. With additive scores (weights per head) it
takes the routed paths, its [1, H, ...] block states read per call. The shared table
(``random_per_head: false``) is the faster path: one plan and one kernel call for every head.

Under ``torch.compile`` it traces as one graph (``fullgraph=True``), forward and backward: the
plans, with their data-dependent row groups and band windows, are built once per shape outside
the graph (``zoo.core.shape_cache``) and enter it as constant index tensors and Python ints.

Grouped-query attention: k and v keep their H_kv heads throughout. The fused path hands them to
SDPA with ``enable_gqa``; the explicit path views q as (B, H_kv, groups, ...) against k and v
(B, H_kv, 1, ...), so each key block is gathered once per key/value head, not per query head.
Additive scores map keys with one W_k per query head, so they expand k (``AdditiveScore``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from torch import Tensor
from torch.nn.functional import dropout  # SDPA: through torch.nn.functional, see sdpa.py

from ...core.arguments import check_int
from ...core.call import AttentionCall
from ...layout.block_layout import head_layout
from ...layout.frames import Frame, build_frame
from ...patterns import Pattern
from ..base import FLOATS, Backend, Capabilities, head_index, repeat_kv
from ..lse_merge import merge as lse_merge_rows
from ..reference import exp_and_mass
from .block_plan import GroupPlan, part_block, plan
from .by_key import attention_by_key, scored_by_key, usable
from .chosen_union import routed_attention, routed_pairs
from .merged import merged_blocked, merges_pieces


def per_call(pattern: Pattern) -> bool:
    """Whether a layout runs on the paths of routed layouts, with (batch, heads) dimensions:
    chosen by content (``routed``), or fixed but different per query head (``per_head``) where
    it does not run head by head (``by_head``)."""
    return pattern.routed or pattern.per_head


def by_head(call: AttentionCall) -> bool:
    """Whether the call runs one query head at a time, each head's layout a fixed pattern with
    its own per-shape plan (``Pattern.head``): a layout drawn per head, not chosen by content,
    with dot-product scores (an additive score's weights are per head: those calls take the
    routed paths)."""
    return call.pattern.per_head and not call.pattern.routed and call.score.kind == "dot"


def head_calls(call: AttentionCall) -> list[AttentionCall]:
    """One call per query head h: q's head h, its key/value head, head h's layout (once per
    shape, ``head_layout``), the positional bias read at head h."""
    groups = call.groups

    def at_head(h: int) -> AttentionCall:
        g = h // groups
        bias = call.bias
        if bias is not None:

            def bias(heads, q_pos, k_pos, _bias=call.bias, _h=h):
                return _bias(heads + _h, q_pos, k_pos)

        return replace(
            call, q=call.q[:, h : h + 1], k=call.k[:, g : g + 1], v=call.v[:, g : g + 1],
            pattern=head_layout(call.pattern, h), bias=bias,
        )  # fmt: skip

    return [at_head(h) for h in range(call.q.shape[1])]


@dataclass
class Partial:
    """Attention over one part's keys, in the original query order."""

    output: Tensor  # (B, H, Lq, Dv): softmax over this part's keys @ v; zero where it has none
    denominator: Tensor  # (B, H, Lq): sum of exp(score - peak) over this part's keys
    peak: Tensor  # (B, H, Lq), detached; -inf where the part allows no key

    def lse(self) -> Tensor:
        """The log-sum-exp of the part's scores, peak + log(denominator): -inf where it has no
        key, with a zero gradient there (no log of 0 on the gradient's path)."""
        has_key = self.denominator > 0
        mass = torch.where(has_key, self.denominator, 1)
        return torch.where(has_key, self.peak + torch.log(mass), -math.inf)


def merge(partials: list[Partial]) -> Tensor:
    """softmax over all parts' keys @ v, from each part's normalised output and log-sum-exp
    (``lse_merge.merge``, differentiated by autograd); a query that no part lets attend gets
    zero."""
    if len(partials) == 1:
        return partials[0].output
    return lse_merge_rows([p.output for p in partials], [p.lse() for p in partials])[0]


def by_kv_head(x: Tensor, kv_heads: int) -> Tensor:
    """(B, H or 1, R, bq, ...) -> (B, H_kv or 1, R, groups or 1, bq, ...): the query heads that
    share a key/value head side by side, a view."""
    if x.shape[1] == 1:
        return x.unsqueeze(3)
    return x.unflatten(1, (kv_heads, -1)).transpose(2, 3)


def by_query_head(x: Tensor) -> Tensor:
    """The inverse of ``by_kv_head``: (B, H_kv, R, groups, bq, ...) -> (B, H, R, bq, ...)."""
    return x.transpose(2, 3).flatten(1, 2)


@dataclass
class Inputs:
    """q, k, v (B, H, slots, D) in one part's frame, and the key padding (B, slots) if any."""

    q: Tensor
    k: Tensor
    v: Tensor
    padded: Tensor | None


def in_order(frame: Frame, groups: list[GroupPlan], per_group: list[Tensor], fill: float) -> Tensor:
    """Per-group rows (B, H, R, bq, ...) back to (B, H, Lq, ...) in the original query order;
    query blocks that no group holds get ``fill``."""
    first = per_group[0]
    whole = len(groups) == 1 and groups[0].window is not None
    if whole and groups[0].rows.numel() == frame.q.num_blocks:
        rows = first  # one band window over every query block, already in order
    else:  # each group's rows written in place: no concatenation of them first
        shape = (*first.shape[:2], frame.q.num_blocks, *first.shape[3:])
        covered = sum(g.rows.numel() for g in groups) == frame.q.num_blocks
        rows = first.new_empty(shape) if covered else first.new_full(shape, fill)
        for group, out in zip(groups, per_group, strict=True):
            rows.index_copy_(2, group.rows, out)
    return frame.q.scatter(rows.flatten(2, 3), dim=2)


def no_pairs(call: AttentionCall, dtype: torch.dtype) -> Tensor:
    """The output (B, H, Lq, Dv) of a call whose pattern allows no pair: zeros that still depend
    on every input that asks for a gradient, so backward gives zero gradients, not an error."""
    zeros = call.q.new_zeros(*call.q.shape[:3], call.v.shape[-1], dtype=dtype)
    inputs = [call.q, call.k, call.v, *call.learned]
    if call.score.kind != "dot":
        inputs += list(call.score.parameters())
    anchors = [0 * t.sum() for t in inputs if t.requires_grad]
    return zeros + sum(anchors).to(dtype) if anchors else zeros


def no_pairs_partial(call: AttentionCall, dtype: torch.dtype) -> Partial:
    """``no_pairs`` as a part's partial result: no mass, a peak of -inf."""
    zeros = no_pairs(call, dtype)
    return Partial(zeros, zeros[..., 0], torch.full_like(zeros[..., 0], float("-inf")).detach())


class BlockedBackend(Backend):
    """Block-sparse attention in plain PyTorch.

    Args:
        block_size: the kernel block, for queries and keys (64 by default). A part may run at
            another where that computes fewer pairs (``block_plan.part_block``): a residue
            frame at its group length, a narrow band at half the block.
        compute_dtype: the dtype of the block computations. By default float32 for 16-bit inputs:
            a key block is gathered for several query blocks, so its gradient is a sum of
            per-block products, and rounding each of them to bfloat16 doubled the gradient error
            of one dense matmul (tests/backends/test_backends.py). Pass torch.bfloat16 to trade that
            precision for speed.
        waste: how much of a row group's gathered blocks may be padding for rows that need
            fewer blocks than the widest (0.25: rows needing at least 3/4 of the widest share a
            group); also the most a band window may read beyond the blocks that hold pairs.
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
        routed=True,
        per_head=True,
    )

    def __init__(
        self, block_size: int = 64, compute_dtype: torch.dtype | None = None, waste: float = 0.25
    ) -> None:
        self.block_size = check_int("block_size", block_size)
        if compute_dtype is not None and (
            not isinstance(compute_dtype, torch.dtype) or not compute_dtype.is_floating_point
        ):
            raise ValueError(
                f"compute_dtype must be a floating torch.dtype or None, got {compute_dtype!r}"
            )
        self.compute_dtype = compute_dtype
        if isinstance(waste, bool) or not isinstance(waste, int | float) or not 0 <= waste <= 1:
            raise ValueError(f"waste must be a number in [0, 1], got {waste!r}")
        # Kept as its repr: under torch.compile(dynamic=True) dynamo reads a float attribute as a
        # symbolic float, which the per-shape builders cannot take as a constant; a str it
        # reads as a constant, and float() of it too.
        self._waste = repr(float(waste))

    @property
    def waste(self) -> float:
        return float(self._waste)

    def __repr__(self) -> str:
        dtype = "" if self.compute_dtype is None else f", compute_dtype={self.compute_dtype}"
        return f"BlockedBackend(block_size={self.block_size}{dtype}, waste={self.waste})"

    def _frame(self, call: AttentionCall, part: Pattern) -> Frame:
        size = self.block_size
        if not per_call(part):  # a layout per sequence or head has no plan to compare with
            size = part_block(part, call.q_len, call.kv_len, size, self.waste, call.device)
        return build_frame(part.stride, call.q_len, call.kv_len, size, size, call.device)

    def _plan(
        self, call: AttentionCall, part: Pattern, split_queries: bool = False
    ) -> tuple[Frame, list[GroupPlan]]:
        frame = self._frame(call, part)
        return frame, plan(part, frame, self.waste, split_queries)

    def scored_pairs(self, call: AttentionCall) -> int:
        return self.scored_and_shared(call)[0]

    def scored_and_shared(self, call: AttentionCall) -> tuple[int, bool]:
        """The scores computed per sequence and head, and whether every part runs key block by
        key block with runs shared by every sequence and head (``by_key``: one graph
        for the batch), the path that costs least per score (``auto``)."""
        B, H = call.q.shape[:2]
        if by_head(call):  # each head its own plan: their mean
            counted = [self.scored_and_shared(c)[0] for c in head_calls(call)]
            return round(sum(counted) / max(len(counted), 1)), False

        split = self._merges(call, call.pattern.parts())

        def pairs(part: Pattern) -> tuple[int, bool]:
            if not per_call(part):
                return sum(g.masked.numel() for g in self._plan(call, part, split)[1]), False
            if usable(call):
                return scored_by_key(call, part, self.block_size)
            return routed_pairs(part, self._frame(call, part), B, H, self.waste), False

        counted = [pairs(part) for part in call.pattern.parts()]
        return sum(n for n, _ in counted), all(shared for _, shared in counted)

    def forward(self, call: AttentionCall) -> tuple[Tensor, None]:
        dtype = self.compute_dtype
        if dtype is None:
            dtype = (
                torch.float32 if call.q.dtype in (torch.bfloat16, torch.float16) else call.q.dtype
            )
        if by_head(call):  # a layout per head: each head on its own plan, as a fixed pattern
            outs = [self.forward(c)[0] for c in head_calls(call)]
            return torch.cat(outs, dim=1), None
        parts = call.pattern.parts()
        if per_call(call.pattern):  # a layout per sequence and head (chosen by content or per head)
            fused = len(parts) == 1 and call.score.kind == "dot" and call.bias is None
            out = merge(
                [
                    self._routed(call, p, dtype, fused)
                    if per_call(p)
                    else self._explicit(call, p, dtype)
                    for p in parts
                ]
            )
        elif self._merges(call, parts):
            planned = [self._plan(call, p, split_queries=True) for p in parts]
            out = merged_blocked(call, planned, self._frame_inputs(call, dtype), dtype)
            out = no_pairs(call, dtype) if out is None else out
        elif len(parts) == 1 and call.score.kind == "dot":
            out = self._fused(call, parts[0], dtype)
        else:
            out = merge([self._explicit(call, part, dtype) for part in parts])
        return out.to(call.q.dtype), None

    @staticmethod
    def _inputs(
        call: AttentionCall, frame: Frame, q: Tensor, k: Tensor, dtype: torch.dtype
    ) -> Inputs:
        padded = None
        if call.key_padding_mask is not None:
            padded = frame.k.gather(call.key_padding_mask[:, :, None])[..., 0]
        v = repeat_kv(call.v.to(dtype), k.shape[1] // call.v.shape[1])  # additive k is per head
        return Inputs(frame.q.gather(q), frame.k.gather(k), frame.k.gather(v), padded)

    def _merges(self, call: AttentionCall, parts: tuple[Pattern, ...]) -> bool:
        """Whether the call runs as merged pieces (``merged``): where the kernel can
        (``merges_pieces``) and there is something to merge, several parts or a group whose keys
        come from several sources, or queries split from their blocks (``wide_queries``); or a
        gradient through overlapping key windows, which the merged path computes a chunk of rows
        at a time (``lse_merge.CHUNK_BYTES``), faster than one fused call for local's forward +
        backward on a CPU. Otherwise one fused call on the band's view is as fast (local's
        forward) or faster (block_local's forward + backward)
        (measured: eval/results/design-notes-cpu.md#band-backward-chunks)."""
        if not merges_pieces(call) or per_call(call.pattern):
            return False
        if len(parts) > 1:
            return True
        groups = self._plan(call, parts[0], split_queries=True)[1]
        grad = any(t.requires_grad for t in (call.q, call.k, call.v))
        return any(
            g.q_slot is not None
            or sum(1 for columns in g.widths if columns) > 1
            or (grad and g.window is not None and g.window.width > 1)
            for g in groups
        )

    def _frame_inputs(self, call: AttentionCall, dtype: torch.dtype):
        """q, k, v and the key padding in a frame's order, for ``merged_blocked``."""
        q, k = call.q.to(dtype), call.k.to(dtype)

        def inputs(frame: Frame) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
            i = self._inputs(call, frame, q, k, dtype)
            return i.q, i.k, i.v, i.padded

        return inputs

    # The fused path.

    def _fused(self, call: AttentionCall, part: Pattern, dtype: torch.dtype) -> Tensor:
        frame, groups = self._plan(call, part)
        if not groups:
            return no_pairs(call, dtype)
        inputs = self._inputs(call, frame, call.q.to(dtype), call.k.to(dtype), dtype)
        outs = [self._fused_group(call, frame, g, inputs) for g in groups]  # (B, H, R, bq, Dv)
        return in_order(frame, groups, outs, 0.0)

    def _fused_group(
        self, call: AttentionCall, frame: Frame, group: GroupPlan, inputs: Inputs
    ) -> Tensor:
        B, H = inputs.q.shape[:2]
        mask, has_key = self._fused_mask(call, group, inputs.padded, H, inputs.q.dtype)
        if group.window is not None:  # keys as overlapping windows, one sequence at a time
            per_sequence = [
                self._windowed(call, frame, group, inputs, b, mask[b % mask.shape[0]])
                for b in range(B)
            ]
            out = torch.stack(per_sequence) if B > 1 else per_sequence[0][None]  # (B, R, H, bq, Dv)
        else:

            def heads_inside(x: Tensor) -> Tensor:  # (B, H, R, L, D) -> (B * R, H, L, D)
                return x.transpose(1, 2).flatten(0, 1)

            q, k, v = group.gather(inputs.q, inputs.k, inputs.v, frame)
            out = torch.nn.functional.scaled_dot_product_attention(
                heads_inside(q), heads_inside(k), heads_inside(v),
                attn_mask=mask.expand(B, -1, -1, -1, -1).flatten(0, 1),
                dropout_p=call.dropout_p, scale=call.scale, enable_gqa=call.groups > 1,
            ).unflatten(0, (B, group.rows.numel()))  # fmt: skip
        if has_key is not None:
            out = out * has_key.to(out.dtype)
        return out.transpose(1, 2)  # (B, H, R, bq, Dv)

    @staticmethod
    def _fused_mask(
        call: AttentionCall, group: GroupPlan, padded: Tensor | None, H: int, dtype: torch.dtype
    ) -> tuple[Tensor, Tensor | None]:
        """The additive mask (0 allowed, -inf not), (B or 1, R, 1 or H, bq, W*bk), and where some
        query has no key at all, its (B or 1, R, 1, bq, 1) indicator to zero its output after the
        kernel (which would divide 0 by 0). Without padding or bias both come from the plan."""
        if padded is None and call.bias is None:
            mask, has_key = group.additive(dtype)
            return mask[None], None if has_key is None else has_key[None]
        masked = group.masked_with(padded)  # (B or 1, R, bq, W*bk)
        has_key = ~masked.all(dim=-1, keepdim=True)
        masked = masked & has_key  # a query with no key sees everything, then gets zero
        bias = torch.zeros((), dtype=dtype, device=masked.device)
        if call.bias is not None:
            heads = head_index(H, masked.device, 3)
            bias = (
                call.bias(heads, group.q_pos, group.k_pos).to(dtype).transpose(0, 1)
            )  # (R, H, ..)
        return bias.masked_fill(masked[:, :, None], float("-inf")), has_key[:, :, None]

    @staticmethod
    def _windowed(
        call: AttentionCall, frame: Frame, group: GroupPlan, inputs: Inputs, b: int, mask: Tensor
    ) -> Tensor:
        """Sequence b: (R, H, bq, Dv), its keys read from the group's sources (``block_plan``),
        concatenated where there are several (the CPU path, ``merged``, runs them apart)."""
        q = (
            inputs.q[b]
            .unflatten(1, (-1, frame.q.block))
            .narrow(1, group.window.first, group.rows.numel())
            .transpose(0, 1)
        )
        keys = group.key_sources(inputs.k[b], frame.k.block)
        values = group.key_sources(inputs.v[b], frame.k.block)
        if len(keys) > 1:
            keys, values = [torch.cat(keys, dim=2)], [torch.cat(values, dim=2)]
        return torch.nn.functional.scaled_dot_product_attention(
            q, keys[0], values[0], attn_mask=mask, dropout_p=call.dropout_p, scale=call.scale,
            enable_gqa=call.groups > 1,
        )  # fmt: skip

    # Layouts chosen by content (zoo.patterns.routed), gathered per sequence and head.

    def _routed(
        self, call: AttentionCall, part: Pattern, dtype: torch.dtype, fused: bool
    ) -> Partial:
        if usable(call):  # tiles by key block: the cost of the chosen pairs
            result = attention_by_key(call, part, dtype, self.block_size)
            return no_pairs_partial(call, dtype) if result is None else Partial(*result)
        q, k = call.q.to(dtype), call.k.to(dtype)
        frame = self._frame(call, part)
        if not fused:
            q, k = call.score.prepare(q, k)
        inputs = self._inputs(call, frame, q, k, dtype)
        result = routed_attention(
            call, part, frame, (inputs.q, inputs.k, inputs.v, inputs.padded), fused, self.waste
        )
        return no_pairs_partial(call, dtype) if result is None else Partial(*result)

    # The explicit path.

    def _explicit(self, call: AttentionCall, part: Pattern, dtype: torch.dtype) -> Partial:
        frame, groups = self._plan(call, part)
        if not groups:
            return no_pairs_partial(call, dtype)
        q, k = call.score.prepare(call.q.to(dtype), call.k.to(dtype))
        inputs = self._inputs(call, frame, q, k, dtype)
        sums = [self._explicit_group(call, frame, g, inputs) for g in groups]
        output, denominator, peak = (
            in_order(frame, groups, [s[i] for s in sums], fill)
            for i, fill in enumerate((0.0, 0.0, float("-inf")))
        )
        return Partial(output, denominator, peak)

    @staticmethod
    def _explicit_group(
        call: AttentionCall, frame: Frame, group: GroupPlan, inputs: Inputs
    ) -> tuple[Tensor, Tensor, Tensor]:
        q, k, v = group.gather(inputs.q, inputs.k, inputs.v, frame)  # (B, H, R, bq or W*bk, D)
        # The query heads of a key/value head are stacked as extra query rows (as FlashAttention
        # packs them): (B, H_kv, R, groups * bq, D) against keys (B, H_kv, R, W*bk, D), so each
        # key block is multiplied once per key/value head, never repeated.
        kv_heads = k.shape[1]
        rows = by_kv_head(q, kv_heads).flatten(3, 4)
        scores = call.score.pairwise(rows, k).unflatten(3, (-1, q.shape[3]))  # (B,Hkv,R,G,bq,W)
        if call.bias is not None:
            heads = head_index(q.shape[1], q.device, 3)
            bias = call.bias(heads, group.q_pos, group.k_pos)  # (H, R, bq, W*bk)
            scores = scores + by_kv_head(bias[None], kv_heads)
        masked = by_kv_head(group.masked_with(inputs.padded)[:, None], kv_heads)
        exp, denominator, peak = exp_and_mass(scores.masked_fill(masked, float("-inf")))
        if call.dropout_p:
            exp = dropout(exp, call.dropout_p)
        # Normalise after the product: a (bq, Dv) division instead of a (bq, W*bk) one.
        output = (exp.flatten(3, 4).to(v.dtype) @ v).unflatten(3, (-1, q.shape[3]))
        output = output / torch.where(denominator > 0, denominator, 1)[..., None]
        return by_query_head(output), by_query_head(denominator), by_query_head(peak)
