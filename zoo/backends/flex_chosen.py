"""The ``flex`` backend on key blocks chosen by content (MoBA): the queries gathered by key block,
one kernel call, each query's blocks merged by log-sum-exp.

In the caller's order a kernel query block's 128 queries chose different key blocks, so its
block mask is the union of their choices, PARTIAL nearly everywhere, and the mask_mod runs for
every score of that union (MoBA at 16K: 275 ms on an H100 against 0.42 ms for block_local at the
same density). MoBA's own kernel, and this path, make each (query, chosen block) pair a row::

    q0 chose blocks {0, 2}, q1 {2, 3}, q2 {0, 2}          blocks of 4 keys, kernel blocks of 4
    rows    q0 q2 . . | q0 q1 q2 . | q1 . . .            sorted by block, each padded to a
    block       0     |     2      |    3                kernel query block: one block each
    q0 = merge(row 0, row 4)

- The rows are sorted by key block, and each block's rows padded to whole kernel query blocks,
  so each kernel query block attends the kernel key blocks of one chosen block: FULL, where the
  mask_mod never runs, except where a fixed member of the pattern cuts into the block (MoBA's own
  block under causal rules: its rows are a segment of their own, PARTIAL), where the block holds
  key padding, or where it does not fill its kernel blocks (a block size that is no multiple of
  the kernel's, the last block).
- The kernel runs once on the gathered queries (B, H, rows, D) and the caller's k and v, and
  returns each row's log-sum-exp; a query's rows merge by it (``lse_merge.merge_along``), so the
  gradient flows through the gather, the kernel and the merge by autograd. On a GPU the merge is
  one compiled graph (``zoo.core.fused``), its backward another.
- Rows: the pairs (queries x chosen blocks: n * top_k) plus at most one partly filled kernel
  block per segment; the count is a bound fixed by the shapes, so nothing waits on the device,
  and fake tensors and traced graphs run it. Kernel query blocks past the used rows attend no key.
- The rows' bookkeeping (a sort of the pairs, their rows, the block lists, and for a call that
  records gradients the transposed lists backward reads: about 100 small operations) runs as
  one compiled graph on a GPU (``zoo.core.fused``), where eagerly each would be a launch and
  host work; the block mask holds its tensors as they are.
- Eager flex (``compile=False``, tests) scores every row against every key: the rows make it
  slower than the union there; the path is for the compiled kernel.

Where it runs (``FlexBackend.gathers``): a pattern that is one ``ChosenBlocks``, alone or
intersected with fixed patterns the same for every head (``moba & causal``), chosen for the
call's queries (not against a cache: decoding has its own path), where the kernel returns its
log-sum-exp (not compiled on a CPU) and where the rows' bound of scored pairs is under the whole
grid (``gathered_pays``). A union with a fixed pattern (``moba | local``) keeps the union's block
mask.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch import Tensor

from ..core.call import AttentionCall
from ..core.fused import fused
from ..layout.block_layout import used_first_unsorted
from ..patterns import EMPTY, FULL, PARTIAL, Pattern, Spans
from ..patterns.compose import Intersection
from ..patterns.routed import ChosenBlocks
from .flex_kernel import _flex_module
from .lse_merge import merge_along


def chosen_parts(pattern: Pattern) -> tuple[ChosenBlocks, Pattern | None] | None:
    """(the chosen blocks, the fixed members intersected with them or None) of a pattern this path
    runs; None for any other."""
    if isinstance(pattern, ChosenBlocks):
        chosen, fixed = pattern, ()
    elif isinstance(pattern, Intersection):
        routed = [c for c in pattern.children if c.routed]
        fixed = tuple(c for c in pattern.children if not c.routed)
        if len(routed) != 1 or not isinstance(routed[0], ChosenBlocks):
            return None
        if any(c.per_head for c in fixed):
            return None
        chosen = routed[0]
    else:
        return None
    if isinstance(chosen.offset, Tensor):  # chosen against a cache: the decoding path's
        return None
    rest = None if not fixed else fixed[0] if len(fixed) == 1 else Intersection(fixed)
    return chosen, rest


def gathered_rows(q_len: int, slots: int, blocks: int, block: int, fixed: bool = True) -> int:
    """The gathered rows' bound: every pair (``slots`` per query), and one partly filled kernel
    block per segment: each chosen block's rows (FULL and PARTIAL ones apart where a ``fixed``
    member cuts into blocks), and the empty slots'."""
    segments = (2 if fixed else 1) * blocks + 1
    return block * (-(-q_len * slots // block) + segments - 1)


def gathered_pays(
    call: AttentionCall, chosen: ChosenBlocks, fixed: Pattern | None, block: int
) -> bool:
    """Whether the rows' bound of scored pairs, every row against the kernel key blocks of one
    chosen block, is under the whole grid q_len x kv_len (the union's own count would cost the
    per-query layout to find: on random inputs it is nearly the grid)."""
    slots, cut = chosen.picks.shape[-1], fixed is not None
    rows = gathered_rows(call.q_len, slots, chosen.blocks, block, cut)
    return rows * _width(chosen.block_size, block) * block < call.q_len * call.kv_len


def _width(chosen_block: int, block: int) -> int:
    """The most kernel key blocks that one chosen block touches."""
    if chosen_block % block == 0:
        return chosen_block // block
    if block % chosen_block == 0:
        return 1
    return chosen_block // block + 2


Lists = tuple[Tensor, Tensor]  # a block mask's (counts, indices) of one kind of block


@dataclass(frozen=True, eq=False)
class GatheredRows:
    """One call's rows (``B, H, R``): the query each row holds, the row of each (query, pick
    slot) pair, and the block mask over the rows and the keys."""

    row_query: Tensor  # (B, H, R) int64: the query index of each row (0 in a padding row)
    pair_row: Tensor  # (B, H, Lq * slots) int64: the row of each (query, pick slot) pair
    block_mask: object  # flex's BlockMask over (R, kv_len)
    slots: int  # pick slots per query: min(top_k, key blocks)


def gathered_rows_of(call: AttentionCall, block: int, fuse: bool = True) -> GatheredRows:
    """The rows of ``call`` (its pattern one that ``chosen_parts`` takes) at kernel blocks of
    ``block``. Their bookkeeping (about 100 small operations) is one compiled graph on a GPU
    (``zoo.core.fused``) unless ``fuse`` is False."""
    parts = chosen_parts(call.pattern)
    assert parts is not None
    chosen, fixed = parts
    keep = kept_keys(call, block)
    size, offset = chosen.block_size, int(chosen.offset)
    layout = _row_layout if fuse else _row_layout.fn
    # The transposed block lists, which only backward reads, made with the rest of the layout;
    # in a caller's traced graph from_kv_blocks makes them, inside that graph, as it always did.
    transposed = call.needs_grad and SKIPS_Q_BLOCKS and not torch.compiler.is_compiling()
    row_query, pair_row, row_block, partial, full, by_key = layout(
        chosen.picks, keep, fixed, chosen.blocks, size, call.kv_len, offset, block, transposed
    )

    def chosen_mask(b, h, q_idx, kv_idx):
        allowed = (kv_idx // size == row_block[b, h, q_idx]) & keep[b, kv_idx]
        if fixed is not None:
            allowed = allowed & fixed.allowed_at(b, h, row_query[b, h, q_idx] + offset, kv_idx)
        return allowed

    build = _flex_module().BlockMask.from_kv_blocks
    skip = SKIPS_Q_BLOCKS and (transposed or not call.needs_grad)
    options = {"compute_q_blocks": False} if skip else {}
    block_mask = build(
        *partial, *full, BLOCK_SIZE=block, mask_mod=chosen_mask,
        seq_lengths=(row_query.shape[-1], call.kv_len), **options,
    )  # fmt: skip
    if transposed:  # what from_kv_blocks computes eagerly (about 60 operations at 16K)
        (block_mask.q_num_blocks, block_mask.q_indices), by_key_full = by_key
        block_mask.full_q_num_blocks, block_mask.full_q_indices = by_key_full
    return GatheredRows(row_query, pair_row, block_mask, chosen.picks.shape[-1])


@fused
def _row_layout(
    picks: Tensor, keep: Tensor, fixed: Pattern | None, nb: int, size: int, kv_len: int,
    offset: int, block: int, transposed: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Lists, Lists, tuple[Lists, Lists] | None]:  # fmt: skip
    """The rows of a choice ``picks`` (B, H, Lq, slots) of ``nb`` blocks of ``size`` keys:
    (row_query, pair_row (see ``GatheredRows``), each row's chosen block (B, H, R) int32, the
    kernel key blocks of each kernel query block, PARTIAL and FULL, as flex's
    ``BlockMask.from_kv_blocks`` takes them: (counts, indices) each, and where ``transposed``
    the kernel query blocks of each kernel key block, PARTIAL and FULL, as it would compute
    them (else None))."""
    picks = picks.long()
    B, H, q_len, slots = picks.shape
    device = picks.device
    segment = _segments(picks, nb, size, fixed, offset, kv_len)
    flat = segment.flatten(2)  # (B, H, P), P = q_len * slots in query order
    pairs = flat.shape[-1]
    by_segment, order = flat.sort(dim=-1, stable=True)
    segments = 2 * nb + 1
    counts = torch.zeros(B, H, segments, dtype=torch.long, device=device)
    counts.scatter_add_(-1, flat, torch.ones_like(flat))
    padded = (counts + block - 1) // block * block
    first = counts.cumsum(-1) - counts  # a segment's first pair in the sorted order
    first_row = padded.cumsum(-1) - padded  # its first row
    rank = torch.arange(pairs, device=device) - first.gather(-1, by_segment)
    row = first_row.gather(-1, by_segment) + rank  # of each sorted pair
    rows = gathered_rows(q_len, slots, nb, block, fixed is not None)
    row_query = torch.zeros(B, H, rows, dtype=torch.long, device=device)
    row_query.scatter_(-1, row, order // slots)
    row_segment = torch.full((B, H, rows), 2 * nb, dtype=torch.long, device=device)
    row_segment.scatter_(-1, row, by_segment)
    pair_row = torch.empty_like(row).scatter_(-1, order, row)
    partial, full, by_key = _block_lists(row_query, row_segment, keep, fixed, offset, size, nb,
                                         kv_len, block, transposed)  # fmt: skip
    return row_query, pair_row, (row_segment // 2).to(torch.int32), partial, full, by_key


def _segments(
    picks: Tensor, nb: int, size: int, fixed: Pattern | None, offset: int, kv_len: int
) -> Tensor:
    """(B, H, Lq, k) each pair's segment: 2 * j for a FULL pair of chosen block j, 2 * j + 1 for
    a PARTIAL one (a fixed member cuts into the block), 2 * nb for an empty slot or an EMPTY
    pair."""
    used = picks < nb
    partial = torch.zeros_like(used)
    if fixed is not None:
        q_len = picks.shape[2]
        position = (torch.arange(q_len, device=picks.device) + offset)[:, None].expand_as(picks)
        lo = picks.clamp(max=nb - 1) * size
        hi = torch.clamp(lo + size, max=kv_len) - 1
        every = torch.ones_like(used)
        state = fixed.block_state(
            Spans(position, position, 1, every), Spans(lo, hi, 1, every)
        ).expand_as(picks)
        used = used & (state != EMPTY)
        partial = state == PARTIAL
    return torch.where(used, 2 * picks + partial, 2 * nb)


def kept_keys(call: AttentionCall, block: int) -> Tensor:
    """(B, kv blocks * block) bool, the keys in whole blocks of ``block``: True at each key that
    is neither padding nor past kv_len."""
    B, kv_len = call.q.shape[0], call.kv_len
    slots = -(-kv_len // block) * block
    keep = torch.zeros(B, slots, dtype=torch.bool, device=call.device)
    if call.key_padding_mask is None:
        keep[:, :kv_len] = True
    else:
        keep[:, :kv_len] = ~call.key_padding_mask.to(call.device)
    return keep


def _block_lists(
    row_query: Tensor, row_segment: Tensor, keep: Tensor, fixed: Pattern | None, offset: int,
    size: int, nb: int, kv_len: int, block: int, transposed: bool = False,
) -> tuple[Lists, Lists, tuple[Lists, Lists] | None]:  # fmt: skip
    """The kernel key blocks over the rows, (counts, indices) of the PARTIAL ones and of the FULL
    ones: each kernel query block attends the kernel key blocks of its segment's chosen block,
    FULL where every key there is the block's, kept, and the segment FULL; the mask_mod reads
    each row's block and query. Where ``transposed``, also the kernel query blocks of each
    kernel key block, PARTIAL and FULL (``by_key``), else None."""
    B, H, _ = row_query.shape
    kv_blocks = keep.shape[1] // block
    segment = row_segment[..., ::block]  # (B, H, Qb): a kernel block's rows are one segment's
    chosen = segment // 2
    lo = chosen * size
    hi = torch.clamp(lo + size, max=kv_len)  # one past the block's last key
    width = min(_width(size, block), kv_blocks)
    candidate = (lo // block)[..., None] + torch.arange(width, device=keep.device)
    inside = candidate <= ((hi - 1) // block)[..., None]
    inside = inside & (segment < 2 * nb)[..., None]
    candidate = candidate.clamp(max=kv_blocks - 1)
    kept = keep.view(B, kv_blocks, block)
    flat = candidate.flatten(2)  # (B, H, Qb * width)
    some = kept.any(-1)[:, None].expand(B, H, kv_blocks).gather(-1, flat).view_as(candidate)
    every = kept.all(-1)[:, None].expand(B, H, kv_blocks).gather(-1, flat).view_as(candidate)
    whole = (candidate * block >= lo[..., None]) & ((candidate + 1) * block <= hi[..., None])
    full = (segment % 2 == 0)[..., None]
    if fixed is not None:  # where it cuts a PARTIAL segment's block, per kernel key block
        cut = _fixed_state(fixed, row_query, row_segment, segment, candidate, offset, kv_len, block)
        inside = inside & (cut != EMPTY)
        full = full | (cut == FULL)
    full = every & whole & full
    state = torch.where(inside & some, torch.where(full, FULL, PARTIAL), EMPTY)

    def listed(kind: int) -> tuple[Tensor, Tensor]:
        chosen_kind = state == kind
        first = torch.sort((~chosen_kind).to(torch.int8), dim=-1, stable=True).indices
        index = candidate.gather(-1, first)
        # BlockMask reads kv_indices as one row of the whole (query blocks, key blocks) grid
        index = torch.nn.functional.pad(index, (0, kv_blocks - width))
        return chosen_kind.sum(-1).to(torch.int32), index.to(torch.int32).contiguous()

    def by_key(kind: int) -> Lists:
        """What ``BlockMask.from_kv_blocks`` computes from ``listed(kind)`` (flex's
        ``_transpose_ordered``, a stable descending argsort of the 0/1 grid): per kernel key
        block, how many kernel query blocks attend it, and those first in ascending order, then
        the others (without a sort: ``used_first_unsorted``)."""
        # Scattered in key-block order, not read transposed afterwards: Inductor's Triton code
        # for that transposed read failed on CUDA (torch 2.11; get_block_shape: 'list indices
        # must be integers or slices, not NoneType'), and the rows' graph went eager
        q_blocks = state.shape[2]
        dense = torch.zeros(B, H, kv_blocks + 1, q_blocks, dtype=torch.int32, device=keep.device)
        hits = torch.where(state == kind, candidate, kv_blocks).transpose(-1, -2)
        dense.scatter_(-2, hits, 1)  # one past the last key block: dropped
        hit = dense[..., :kv_blocks, :]  # (B, H, kv blocks, Qb)
        order = used_first_unsorted(hit)
        return hit.sum(-1).to(torch.int32), order.to(torch.int32).contiguous()

    by_keys = (by_key(PARTIAL), by_key(FULL)) if transposed else None
    return listed(PARTIAL), listed(FULL), by_keys


def _takes_compute_q_blocks() -> bool:
    """Whether this torch's ``BlockMask.from_kv_blocks`` takes ``compute_q_blocks``."""
    try:
        build = _flex_module().BlockMask.from_kv_blocks
    except ImportError:  # no FlexAttention: the backend says so (FlexBackend.unavailable)
        return False
    return "compute_q_blocks" in inspect.signature(build).parameters


# Settled on import: found inside a traced graph, it guarded that graph and recompiled it once.
SKIPS_Q_BLOCKS = _takes_compute_q_blocks()


def _fixed_state(
    fixed: Pattern, row_query: Tensor, row_segment: Tensor, segment: Tensor, candidate: Tensor,
    offset: int, kv_len: int, block: int,
) -> Tensor:  # fmt: skip
    """(B, H, Qb, width) the fixed members' state on each kernel query block's candidate key
    blocks, over the range of its rows' positions: a range holds every row, so its EMPTY and FULL
    are true of the rows (the own block under causal rules: the key blocks after a kernel block's
    last query are EMPTY, those before its first FULL, not PARTIAL as the segment is)."""
    B, H, rows = row_query.shape
    position = (row_query + offset).view(B, H, -1, block)
    real = row_segment.view(B, H, -1, block) == segment[..., None]  # not a padding row
    lo = torch.where(real, position, kv_len + rows).amin(-1, keepdim=True)
    hi = torch.where(real, position, -1).amax(-1, keepdim=True)
    # A FULL segment's rows need no cut (``full`` holds already): the range of its first row
    # only, so that a pattern without formulas (derived states: every pair of the range) stays
    # cheap where a segment's rows come from all over the sequence.
    cut = (segment % 2 == 1)[..., None]
    lo, hi = torch.where(cut, lo, position[..., :1]), torch.where(cut, hi, position[..., :1])
    every = torch.ones_like(candidate, dtype=torch.bool)
    k_lo = candidate * block
    k_hi = torch.clamp(k_lo + block, max=kv_len) - 1
    return fixed.block_state(Spans(lo, hi, 1, every), Spans(k_lo, k_hi, 1, every))


def gather_queries(q: Tensor, rows: GatheredRows) -> Tensor:
    """q (B, H, Lq, D) -> the rows' queries (B, H, R, D)."""
    index = rows.row_query[..., None].expand(*rows.row_query.shape, q.shape[-1])
    return q.gather(2, index)


def merged_per_query(
    out: Tensor, lse: Tensor, rows: GatheredRows, dtype: torch.dtype, fuse: bool = True
) -> Tensor:
    """The rows' outputs (B, H, R, Dv) and log-sum-exps (B, H, R) -> each query's output
    (B, H, Lq, Dv) in ``dtype``: its rows, one per pick slot, merged by log-sum-exp
    (``lse_merge.merge_along``). One compiled graph on a GPU (``zoo.core.fused``), and one for
    its backward, where eagerly the merge was about 25 operations and launches each way; eager
    where ``fuse`` is False."""
    merge = _merge_pairs if fuse else _merge_pairs.fn
    return merge(out, lse, rows.pair_row, rows.slots, dtype)


@fused
def _merge_pairs(
    out: Tensor, lse: Tensor, pair_row: Tensor, slots: int, dtype: torch.dtype
) -> Tensor:
    """``merged_per_query`` of the rows of each (query, pick slot) pair ``pair_row``."""
    B, H, pairs = pair_row.shape
    per_query = (B, H, pairs // slots, slots)
    index = pair_row[..., None].expand(*pair_row.shape, out.shape[-1])
    outs = out.gather(2, index).view(*per_query, out.shape[-1])
    merged, _ = merge_along(outs, lse.gather(2, pair_row).view(per_query))
    return merged.to(dtype)
