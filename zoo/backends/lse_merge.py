"""Softmax attentions over disjoint sets of keys merged exactly by log-sum-exp into one, forward
and backward: the one merge of the blocked backend (its parts, its CPU pieces, its key-block runs),
the xformers backend (its pieces) and whatever else splits the keys.

A partial attention of some queries over some keys is its output (softmax over those keys @ their
values) and each query's log-sum-exp of scores over them (-inf where it has no key). Partials of
the same queries over disjoint keys merge as FlashAttention merges key blocks::

    out = sum_i exp(lse_i - lse) * out_i        lse = log sum_i exp(lse_i)

in three forms: ``combine_two`` (two partials, in place, for code outside autograd) and
``combine`` (a list of them, by it); ``merge`` (a list, differentiable: autograd takes the
gradient); ``merge_rows`` (partials of row ranges of the queries, into one output). ``partial``
makes a differentiable partial from dense masked scores, and ``kernel_partial`` the same through
the CPU kernel (context parallelism's wide query rows, ``zoo.parallel.wide``). A row that no part
lets attend gets lse -inf and zero output. The backward needs no merge of its own: given the
merged output and log-sum-exp of its rows (``lse_for_backward``), a partial's softmax is the
whole row's softmax restricted to its keys, so the partials' gradients (``explicit_backward``, or
a kernel's backward) add up to the exact gradient.

The blocked backend's path on a CPU (``merged_attention``) runs attention in pieces, each a block
of queries against one source of keys. It reads a query block's keys from up to three places
(``block_plan``: a band that is a strided view, shared blocks, gathered blocks), and a pattern of
several parts (a band and strided columns) in several token orders. Concatenating the sources
would copy the band; and parts in different orders cannot share one kernel call. Instead each
piece runs through the CPU FlashAttention kernel, which also returns every query's log-sum-exp,
and the pieces merge into the rows of the output they belong to (over the pieces that hold query
row r). Where a piece's rows lie on a grid of the output (rows offset + n * across + m * along: a
band's consecutive query blocks, a residue order's strided tokens), it reads and writes them as a
strided view of the output (``RowGrid``), in place; other pieces gather and scatter them by index.
The backward gives each piece the merged output and log-sum-exp of its rows; the gradients of
each piece's q, k and v flow back through their views and gathers by autograd.

The kernels are ATen's ``_scaled_dot_product_flash_attention_for_cpu`` and its backward, the ops
behind ``scaled_dot_product_attention`` on a CPU; they take a float mask, one head size for q, k
and v, and no dropout. Grouped k and v (fewer heads than q) run with the query heads of a
key/value head stacked as extra query rows, as FlashAttention packs them, so k and v are never
repeated.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .grouped_heads import fold_groups, unfold_groups
from .reference import exp_and_mass

if TYPE_CHECKING:  # the blocked backend's, which imports this module
    from .blocked.key_windows import KeyWindows
    from .blocked.row_grid import RowGrid

_forward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


@dataclass
class Piece:
    """Queries (N, H, M, D) against keys and values (N, H, m, D) under an additive mask
    (N or 1, H or 1, M, m); ``no_key`` (N or 1, 1, M) is True where the mask allows no key, and
    ``rows`` (N, M) names each query's row in the merged output (``rows == total`` drops it).
    Pieces with the same q and rows tensors (the same objects) are one group: the sources of a
    group's keys. ``fresh``: no earlier group holds any of its rows, so the group's result is
    written into them instead of merged with what they hold. ``window``: k and v are one
    sequence's keys and values (H, slots, D), which query block n reads as its window n (a band:
    no copy in the forward, and in the backward each chunk of rows adds its gradient straight
    into the keys'). ``grid``: the rows as a ``RowGrid``, where they lie on one."""

    q: Tensor
    k: Tensor
    v: Tensor
    mask: Tensor
    no_key: Tensor
    rows: Tensor
    fresh: bool = False
    window: KeyWindows | None = None
    grid: RowGrid | None = None

    def tensors(self) -> tuple[Tensor, ...]:
        return self.q, self.k, self.v, self.mask, self.no_key, self.rows

    def keys(self, first: int = 0, rows: int | None = None) -> tuple[Tensor, Tensor]:
        """k and v (N, H, m, D) as the kernel reads them, for query blocks first .. + rows - 1."""
        rows = self.q.shape[0] - first if rows is None else rows
        if self.window is None:
            return self.k.narrow(0, first, rows), self.v.narrow(0, first, rows)
        return self.window.view(self.k, rows, first), self.window.view(self.v, rows, first)


def merged_attention(pieces: list[Piece], total: int, scale: float) -> Tensor:
    """(total, H, Dv): each row's softmax over the keys of every piece that holds it, @ their
    values; zeros for a row that no piece lets attend."""
    # Each tensor goes in once (pieces share their queries, masks and rows; autograd.Function
    # under torch.compile takes no tensor twice); ``layout`` says which is which.
    tensors: list[Tensor] = []
    seen: dict[int, int] = {}
    layout = []
    for p in pieces:
        slots = []
        for t in p.tensors():
            if id(t) not in seen:
                seen[id(t)] = len(tensors)
                tensors.append(t)
            slots.append(seen[id(t)])
        layout.append((*slots, p.fresh, p.window, p.grid))
    return _Merged.apply(total, scale, tuple(layout), *tensors)


def _flat(x: Tensor) -> Tensor:
    """(N, H, M, ...) -> (N * M, H, ...): one entry per query row."""
    return x.transpose(1, 2).flatten(0, 1)


def _unflat(x: Tensor, like: Tensor) -> Tensor:
    """The inverse of ``_flat`` for a piece shaped like ``like`` (N, H, M, ...)."""
    return x.unflatten(0, (like.shape[0], like.shape[2])).transpose(1, 2)


def combine_two(
    out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor
) -> tuple[Tensor, Tensor]:
    """Two partials of the same rows merged: (out, lse), out written into out_a. b's share of the
    mass is exp(lse_b) / (exp(lse_a) + exp(lse_b)) = sigmoid(lse_b - lse_a), so the output is one
    ``lerp``, a single pass over the outputs (a weighted sum of exponentials took four), in place
    (out_a is a kernel's output, a gather or a view of the output's rows, used nowhere else: a
    fresh output would cost its pages). Where neither has a key (-inf - -inf = nan) the share is
    0 and the output a's zeros. Not for autograd: in place, and sigmoid's gradient at that nan is
    nan (``merge`` is)."""
    share = torch.sigmoid(lse_b - lse_a).nan_to_num(0.0)
    lse = torch.logaddexp(lse_a, lse_b)
    return out_a.lerp_(out_b, share[..., None]), lse


def combine(outs: list[Tensor], lses: list[Tensor]) -> tuple[Tensor, Tensor]:
    """Partials of the same rows merged by ``combine_two``, one after another, into outs[0]:
    (out, lse)."""
    out, lse = outs[0], lses[0]
    for part_out, part_lse in zip(outs[1:], lses[1:], strict=True):
        out, lse = combine_two(out, lse, part_out, part_lse)
    return out, lse


def merge(outs: Sequence[Tensor], lses: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
    """Partials of the same rows merged into fresh tensors, for autograd to differentiate:
    (out, lse). Each part's share is exp(lse_i - m) / sum_j exp(lse_j - m) for the largest lse m
    (detached: the shares do not depend on it); a part without a key, or a row without any, adds
    zero and takes zero gradient, never nan."""
    weights, lse = _weights(torch.stack(list(lses), dim=-1))
    out = sum(w[..., None] * o for w, o in zip(weights.unbind(-1), outs, strict=True))
    return out, lse


def _weights(lses: Tensor) -> tuple[Tensor, Tensor]:
    """Each partial's share of its row, for partials' log-sum-exps stacked on the last axis
    (..., P) -> (..., P), and the rows' merged log-sum-exp (...): exp(lse_i - m) / sum_j
    exp(lse_j - m) for the largest lse m (detached: the shares do not depend on it); zero for a
    part without a key, and for every part of a row without any (its lse -inf)."""
    peak = lses.amax(dim=-1, keepdim=True).detach()
    peak = torch.where(torch.isfinite(peak), peak, 0)
    shares = torch.exp(lses - peak)
    total = shares.sum(dim=-1, keepdim=True)
    has_key = total > 0
    total = torch.where(has_key, total, 1)
    lse = torch.where(has_key, peak + torch.log(total), -math.inf)
    return shares / total, lse[..., 0]


def merge_along(outs: Tensor, lses: Tensor) -> tuple[Tensor, Tensor]:
    """``merge`` of partials stacked on the last axis of ``lses`` (..., P) and the one before
    the values' of ``outs`` (..., P, Dv): one operation each over all P, not one per partial
    (the partials of a query's chosen key blocks, ``flex_chosen``)."""
    weights, lse = _weights(lses)
    return (weights[..., None] * outs).sum(dim=-2), lse


def partial(scores: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """One partial attention from its scores (..., M, m), -inf where a pair is not allowed, and
    values (..., m, Dv): (out (..., M, Dv), lse (..., M)), differentiable, for ``merge``. A row
    with no allowed key gets zero output and lse -inf, and zero gradients (never nan): the
    largest score is subtracted before exp and a zero mass is divided as one."""
    exp, total, peak = exp_and_mass(scores)
    has_key = total > 0
    total = torch.where(has_key, total, 1)
    out = (exp / total[..., None]) @ v
    return out, torch.where(has_key, peak + torch.log(total), -math.inf)


def kernel_partial(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float, causal: bool = False
) -> tuple[Tensor, Tensor]:
    """``partial`` through the CPU FlashAttention kernel, without scores in memory: q, k, v
    (B, H, M or m, D or Dv) with the same heads, ``mask`` additive (B or 1, H or 1, M, m), -inf
    where a pair is not allowed, or None (every pair); ``causal``: query i reads keys 0 .. i
    only (M == m). (out, lse), differentiable in both."""
    has_key = None
    if mask is not None:  # a row without a key: any key, then zeros and -inf
        has_key = torch.isfinite(mask).any(dim=-1).expand(*q.shape[:3])
        mask = torch.where(has_key[..., None], mask, 0)
    out, lse = _KernelPartial.apply(q, k, v, mask, scale, causal)
    if has_key is None:
        return out, lse
    return out * has_key[..., None], torch.where(has_key, lse, -math.inf)


class _KernelPartial(torch.autograd.Function):
    """The kernel's (out, lse) with the gradient of both. Its backward takes only out's gradient
    g, and computes d score = p * (g . v - rowsum(g * out)); lse's gradient adds p * g_lse. One
    more column does it: q and k get a zero (the scores stay), v a one and g the row's g_lse, so
    g . v gains g_lse; out gets a zero there, so the row sum does not. Head sizes are padded to
    one (the kernel takes one)."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float,
                causal: bool):  # fmt: skip
        size, dv = max(q.shape[-1], v.shape[-1]) + 1, v.shape[-1]
        q_, k_ = _padded(q, size), _padded(k, size)
        v_ = _padded(torch.cat([v, torch.ones_like(v[..., :1])], dim=-1), size)
        out, lse = _forward(q_, k_, v_, is_causal=causal, attn_mask=mask, scale=scale)[:2]
        ctx.save_for_backward(q_, k_, v_, out, lse, mask)
        ctx.scale, ctx.causal, ctx.sizes = scale, causal, (q.shape[-1], k.shape[-1], dv)
        return out[..., :dv], lse

    @staticmethod
    def backward(ctx, grad_out: Tensor, grad_lse: Tensor):
        q_, k_, v_, out, lse, mask = ctx.saved_tensors
        d, _, dv = ctx.sizes
        g = torch.zeros_like(out)
        g[..., :dv] = grad_out
        g[..., dv] = grad_lse
        kept = torch.zeros_like(out)
        kept[..., :dv] = out[..., :dv]
        dq, dk, d_v = _backward(g, q_, k_, v_, kept, lse, 0.0, ctx.causal, attn_mask=mask,
                                scale=ctx.scale)  # fmt: skip
        return dq[..., :d], dk[..., :d], d_v[..., :dv], None, None, None


def _padded(x: Tensor, size: int) -> Tensor:
    """x (..., D) with zero columns up to ``size``."""
    return torch.nn.functional.pad(x, (0, size - x.shape[-1]))


def merge_rows(
    rows: Sequence[tuple[int, int]], partials: Sequence[tuple[Tensor, Tensor]], q_len: int
) -> tuple[Tensor, Tensor]:
    """Partials of row ranges [start, stop) of q_len queries, each (out (B, stop - start, H, Dv),
    lse (B, H, stop - start)), merged where their ranges overlap: (out (B, q_len, H, Dv) in
    float32 or wider, lse (B, H, q_len)); rows no partial holds get zeros and -inf. Each merges
    into its rows of the output in place (``combine_two``): a pass over its own rows only."""
    out0, lse0 = partials[0]
    batch, heads, dv = out0.shape[0], lse0.shape[1], out0.shape[-1]
    dtype = torch.promote_types(out0.dtype, torch.float32)
    out = out0.new_zeros((batch, q_len, heads, dv), dtype=dtype)
    lse = lse0.new_full((batch, heads, q_len), -math.inf)
    for (start, stop), (part_out, part_lse) in zip(rows, partials, strict=True):
        held_out, held_lse = out[:, start:stop], lse[..., start:stop].transpose(1, 2)
        held_lse.copy_(combine_two(held_out, held_lse, part_out.to(dtype), part_lse.mT)[1])
    return out, lse


def lse_for_backward(lse: Tensor) -> Tensor:
    """The merged log-sum-exp as a partial's backward takes it: +inf where a row has no key, so
    every probability exp(score - lse) there is 0, and so is every gradient it adds."""
    return torch.where(torch.isfinite(lse), lse, math.inf)


# A piece with at most this many keys (Longformer's global column: one) runs as plain matrix
# products: the kernel's fixed cost per (row, head) made a 1-key piece at 8K tokens slow
# (measured: eval/results/design-notes-cpu.md#lse-merge-small-keys).
SMALL_KEYS = 16


def _piece_forward(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float):
    """(out, lse) of one piece, q folded to k's heads; lse -inf or 0 where a row has no key."""
    if k.shape[2] > SMALL_KEYS:
        return _forward(q, k, v, attn_mask=mask, scale=scale)
    scores = (q @ k.transpose(-1, -2)) * scale + mask
    lse = scores.logsumexp(dim=-1)
    weights = torch.exp(scores - torch.where(torch.isfinite(lse), lse, 0)[..., None])
    return weights @ v, lse


# A band's backward runs on at most this many bytes of window gradient at a time. The kernel
# returns zero-filled gradients of the k and v it read: for Longformer's band at 8K, windows of
# 70 MB each, which cost more in fresh pages than the products that fill them, so chunks of a
# few query blocks are faster than one call
# (measured: eval/results/design-notes-cpu.md#band-backward-chunks). A chunk's
# gradient stays in cache and is added into the keys' at once. Gathered pieces run whole: their
# gradients are the size of what they gathered, so chunks would only add a concatenation.
CHUNK_BYTES = 4 << 20


def _piece_backward(
    p: Piece, g: Tensor, out: Tensor, lse: Tensor, groups: int, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv of one piece (dk, dv shaped as p.k, p.v) given the merged output and
    log-sum-exp of its rows (lse = inf where a row has no key): its softmax is the whole row's,
    restricted to its keys. g, out and lse are the piece's rows, q's heads folded to k's."""
    q, mask = fold_groups(p.q, groups), fold_groups(p.mask, groups)
    if p.window is None:
        return _rows_backward(g, q, *p.keys(), out, lse, mask, scale)
    n = q.shape[0]
    step = max(1, CHUNK_BYTES // (p.keys(0, 1)[0].numel() * p.k.element_size()))
    dq, dk, dv = [], p.k.new_zeros(p.k.shape), p.v.new_zeros(p.v.shape)
    for first in range(0, n, step):
        rows = slice(first, min(first + step, n))
        k, v = p.keys(first, rows.stop - first)
        mask_rows = mask[rows] if mask.shape[0] > 1 else mask
        grads = _rows_backward(g[rows], q[rows], k, v, out[rows], lse[rows], mask_rows, scale)
        dq.append(grads[0])
        p.window.add_grad(dk, grads[1], first)
        p.window.add_grad(dv, grads[2], first)
    return torch.cat(dq), dk, dv


def _rows_backward(g, q, k, v, out, lse, mask, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """``_piece_backward`` for queries against the keys as the kernel reads them."""
    if k.shape[2] > SMALL_KEYS:
        return _backward(g, q, k, v, out, lse, 0.0, False, attn_mask=mask, scale=scale)
    return explicit_backward(g, q, k, v, out, lse, mask, scale)


def explicit_backward(
    g: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
    mask: Tensor | None, scale: float, grad_lse: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """dq, dk, dv of softmax(scale * q kᵀ + mask) v over some keys, from the probabilities
    recomputed against the row's merged ``lse`` (inf where a row has no key): what the kernel's
    backward computes, in plain products. ``grad_lse``: the gradient of the log-sum-exp itself,
    where a caller uses it (d lse / d score = probability)."""
    scores = (q @ k.transpose(-1, -2)) * scale
    weights = torch.exp((scores if mask is None else scores + mask) - lse[..., None])
    row = (g * out).sum(dim=-1)
    if grad_lse is not None:
        row = row - grad_lse
    d_scores = weights * (g @ v.transpose(-1, -2) - row[..., None])
    dv = weights.transpose(-1, -2) @ g
    return (d_scores @ k) * scale, (d_scores.transpose(-1, -2) @ q) * scale, dv


def _merge_into(out: Tensor, lse: Tensor, p: Piece, group_out: Tensor, group_lse: Tensor) -> None:
    """A group's output (N, H, M, Dv) and log-sum-exp (N, H, M) merged into the rows of out
    (total + 1, H, Dv) and lse (total + 1, H) that p's rows name: written where the group is
    ``fresh``, merged with what they hold otherwise."""
    if p.grid is not None:  # views of the output's rows: merged in place, never gathered
        n, m = p.rows.shape
        held_out, held_lse = p.grid.view(out, n, m), p.grid.view(lse, n, m)  # (N, M, H, ...)
        here_out, here_lse = group_out.transpose(1, 2), group_lse.transpose(1, 2)
        if p.fresh:
            held_out.copy_(here_out)
            held_lse.copy_(here_lse)
        else:  # combine_two lerps into held_out, the output's rows
            held_lse.copy_(combine_two(held_out, held_lse, here_out, here_lse)[1])
        return
    rows = p.rows.flatten()
    here_lse, here_out = _flat(group_lse[..., None])[..., 0], _flat(group_out)
    if not p.fresh:
        held = lse.index_select(0, rows), out.index_select(0, rows)
        here_out, here_lse = combine_two(held[1], held[0], here_out, here_lse)
    lse.index_copy_(0, rows, here_lse)
    out.index_copy_(0, rows, here_out)


def _rows_of(p: Piece, grad: Tensor, out: Tensor, lse: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The merged gradient, output and log-sum-exp of p's rows, shaped (N, H, M, ...) as p.q:
    strided views where the rows lie on a grid, gathered otherwise."""
    if p.grid is not None:
        n, m = p.rows.shape
        return tuple(p.grid.view(x, n, m).transpose(1, 2) for x in (grad, out, lse))
    # A dropped row (rows == total) reads the last row's g and out, not a zero row appended to
    # copies of both: its lse is inf, so every probability, and with it every gradient it
    # adds, is 0.
    rows = p.rows.flatten()
    real = rows.clamp(max=max(grad.shape[0] - 1, 0))
    return (
        _unflat(grad.index_select(0, real), p.q).contiguous(),
        _unflat(out.index_select(0, real), p.q).contiguous(),
        _unflat(lse.index_select(0, rows)[..., None], p.q)[..., 0].contiguous(),
    )


def _pieces(layout: tuple, tensors: tuple[Tensor, ...]) -> list[Piece]:
    return [
        Piece(*(tensors[i] for i in entry[:-3]), fresh=entry[-3], window=entry[-2], grid=entry[-1])
        for entry in layout
    ]


class _Merged(torch.autograd.Function):
    @staticmethod
    def forward(ctx, total, scale, layout, *tensors):
        pieces = _pieces(layout, tensors)
        first = pieces[0]
        heads, dv = first.q.shape[1], first.v.shape[-1]
        dtype = torch.float64 if first.q.dtype == torch.float64 else torch.float32
        out = first.q.new_zeros((total + 1, heads, dv), dtype=dtype)
        lse = out.new_full((total + 1, heads), -math.inf)
        # Pieces that share their queries (the sources of one group) merge elementwise; each
        # group then merges into its rows of the output, which another part may hold too.
        groups: dict[tuple[int, int], list[Piece]] = {}
        for slots, p in zip(layout, pieces, strict=True):
            groups.setdefault((slots[0], slots[5]), []).append(p)
        for members in groups.values():
            lses, outs = [], []
            for p in members:
                g = heads // p.k.shape[-3]
                o, l = _piece_forward(fold_groups(p.q, g), *p.keys(), fold_groups(p.mask, g), scale)
                outs.append(unfold_groups(o, g).to(dtype))
                lses.append(
                    unfold_groups(l, g).to(dtype).masked_fill(p.no_key, -math.inf)
                )  # the kernel says 0
            group_out, group_lse = combine(outs, lses)
            _merge_into(out, lse, members[0], group_out, group_lse)
        out = out[:total].to(first.q.dtype)
        lse[total] = -math.inf  # the row that dropped rows wrote: none of the output's
        lse = lse_for_backward(lse)
        ctx.save_for_backward(out, lse, *tensors)
        ctx.scale, ctx.layout = scale, layout
        return out

    @staticmethod
    def backward(ctx, grad):
        out, lse, *tensors = ctx.saved_tensors
        pieces = _pieces(ctx.layout, tensors)
        # Contiguous once: the kernel's backward reads a piece's rows of it many times (per
        # chunk of a band), and from a strided view (the caller's (B, H, L, D) gradient comes
        # transposed) local's backward was slower
        # (measured: eval/results/design-notes-cpu.md#lse-merge-contiguous-grad).
        grad = grad if grad.is_contiguous() else grad.contiguous()
        grads: list[Tensor | None] = [None] * len(tensors)

        def add(slot: int, value: Tensor) -> None:  # each value is a fresh tensor of ours
            grads[slot] = value if grads[slot] is None else grads[slot].add_(value)

        rows_of: dict[int, tuple[Tensor, Tensor, Tensor]] = {}  # a group's rows, read once
        for slots, p in zip(ctx.layout, pieces, strict=True):
            if slots[5] not in rows_of:
                rows_of[slots[5]] = _rows_of(p, grad, out, lse)
            g, o, piece_lse = rows_of[slots[5]]
            n = p.q.shape[1] // p.k.shape[-3]
            dq, dk, dv = _piece_backward(
                p, fold_groups(g, n), fold_groups(o, n), fold_groups(piece_lse, n), n, ctx.scale
            )
            for slot, value in zip(slots[:3], (unfold_groups(dq, n), dk, dv), strict=True):
                add(slot, value)
        return None, None, None, *grads
