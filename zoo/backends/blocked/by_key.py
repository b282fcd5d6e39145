"""The ``blocked`` backend on a layout chosen by content, key block by key block: the cost of
the (query, key) pairs that the queries chose, not of their union per query block.

MoBA's own kernel works this way. Each query's layout is read at one query per row
(``block_state`` on single-query spans), a slice of queries at a time, and kept as its allowed
pairs only: n * top_k for MoBA, where the per-query layout is n^2 / block. The (query, key
block) pairs are grouped by key block;
each key block is a *run*: the queries that need it, gathered, attend its keys (a view, no copy)
in one kernel call that also returns each row's log-sum-exp (``lse_kernel``); a query's
runs merge by log-sum-exp, as FlashAttention merges key blocks::

    q0 chose blocks {0, 2}, q1 {2, 3}, q2 {0, 2}
    runs (key block: queries)   0: q0 q2 | 2: q0 q1 q2 | 3: q1
    q0 = merge(run 0 row 0, run 2 row 0)

- Key blocks of runs: the kernel block coarsened up to 8x (512 keys at the default 64) while
  that fits the keys twice: MoBA's 512-key blocks are then one run each, and the kernel is
  faster per score on 512 keys than on 64
  (measured: eval/results/design-notes-cpu.md#by-key-run-blocks). A run never cuts a chosen
  block: against blocks of 256 it holds 256 keys (eval/results/moba-runs-cpu).
- FULL runs (every key of the block allowed for each of its queries) are masked by the keys'
  own padding only, or not at all. PARTIAL runs (the query's own block under causal rules, a
  window's edge) get a mask per row, read from the kernel blocks' states per 64-query block
  (FULL or EMPTY there holds for each of its queries): only PARTIAL kernel blocks are asked
  ``allowed_at`` key by key: 64 keys per query for the own block, not 512.
- Grouped-query heads: the query heads of one key/value head share runs, so a key block is
  read once per key/value head.
- A layout that is the same for every sequence and head (one graph for the batch, without key
  padding) is read once: its runs hold every sequence and head at once, one kernel call per key
  block, masks built once (they were built per sequence and head before, and a graph's masks
  per call were large: eval/results/design-notes-cpu.md#by-key-shared-masks).
- Backward: the kernel's backward per run with the query's merged output and log-sum-exp,
  which gives each run's share of the exact gradient. When the part's softmax mass is merged
  with other parts (``moba | strided``), the mass's gradient enters through an explicit
  recomputation of the run's probabilities.

Why by key block and not by query chunk: a chunk of queries against the union of what they
chose costs the union, which for causal MoBA on random inputs approaches every earlier block
(the ``chosen_union`` path, several times dense SDPA at 8K), and copying each
query's chosen keys costs top_k * b * D per query. Runs by key block cost the chosen pairs plus
the part of a PARTIAL run's block that is masked, gather only the queries, and materialise no
scores; each is one dense product, which a 512-key block keeps efficient. Tiles of 128 queries
x one key block in one batched kernel call were measured too: padding and key copies made them
slower. At 8K MoBA by key block is faster than dense SDPA, forward and backward, causal or not,
and far faster than the union (``eval/results/bench-routed-cpu``). Unions with a fixed pattern
take this path too: ``moba | local`` (a 1280-key window) runs far faster by key block than as
the union per query block. (Measured: eval/results/design-notes-cpu.md#by-key-against-union.)

Eager, dot-product scores without score bias or dropout, on a device and dtype that a kernel
with log-sum-exp serves (``lse_kernel``: PyTorch's flash kernel on a CPU, its memory-efficient
kernel on CUDA, which take a mask per run) (``usable``): the run count is data (a host
synchronisation per call), so fake tensors and traced graphs take the union path. Head sizes of
q and v may differ (zeros widen the narrower, on CUDA to a multiple of 8).
Memory: the pairs, the gathered queries, a PARTIAL run's (n, bk) mask, the kernel blocks'
states where a run's key block holds several (as flex's block mask), no scores.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from ...core.call import AttentionCall
from ...core.device_build import has_no_data
from ...layout.frames import Frame, build_frame
from ...patterns import EMPTY, FULL, PARTIAL, Intersection, Pattern
from ...patterns.routed import ChosenBlocks
from ..lse_kernel import LseKernel, kernel_for, runs_on
from ..lse_merge import explicit_backward
from .chosen_union import routed_state, with_padding

COARSE = 8  # kernel blocks per key block of a run (512 keys at the default 64)
STATE_CHUNK = 1 << 24  # per-query block states read at once (16 MB of int8)


def usable(call: AttentionCall) -> bool:
    """Whether this path runs the call (see the module docstring)."""
    return (
        runs_on(call.device, call.q.dtype)
        and not has_no_data(call.q)
        and call.score.kind == "dot"
        and call.bias is None
        and not call.dropout_p
        and not torch.compiler.is_compiling()
    )


@dataclass(frozen=True, eq=False)
class Runs:
    """A part's (query, key block) pairs for one call, grouped by key block: one kernel call
    per run, FULL runs (every key of the block allowed) before PARTIAL ones."""

    frame: Frame  # one query per block; key blocks of ``factor`` kernel blocks
    factor: int
    shape: tuple[int, int, int, int]  # B, H, query slots, key blocks
    rows: list[Tensor]  # (n,) flat (b, h, slot) queries of each run
    blocks: list[int]  # flat (b, h_kv, key block) of each run
    masks: list[Tensor | None]  # additive, (1, 1, 1, bk) or (1, 1, n, bk); None: all allowed
    has_key: Tensor  # (all runs' rows,) False for a query that the run's mask leaves keyless
    # one layout for every sequence and head: a run is its key block in each of them, its rows
    # every sequence's and head's (b, h, query) in that order, its mask the same for each
    shared: bool = False

    @property
    def queries(self) -> int:  # B * H * query slots: the rows of the flat outputs
        B, H, Sq, _ = self.shape
        return B * H * Sq


def runs(
    part: Pattern, call: AttentionCall, block: int, padding: Tensor | None, dtype: torch.dtype,
    masks_too: bool = True,
) -> Runs | None:  # fmt: skip
    """The runs of ``part`` for this call at kernel block ``block``; None if it has no pair.
    Without ``masks_too`` only their rows and blocks (what ``scored_by_key`` counts)."""
    B, H = call.q.shape[:2]
    kv_heads = call.k.shape[1]
    factor, frame, padded = _run_frame(part, call, block, padding)
    pairs, shared = _allowed_pairs(part, frame, padded, B, H)
    if shared:  # the runs of one sequence and head, for all of them (``Runs.shared``)
        B, H, kv_heads = 1, 1, 1
    Kb = frame.k.num_blocks
    shape = (B, H, frame.q.num_blocks, Kb)
    fine = None
    if factor > 1 and masks_too:
        fine = _kernel_block_states(part, call, block, padding, factor, (B, H, Kb))
    found = _pairs_by_key_block(pairs, frame, padded, shape, kv_heads, call.device)
    if found is None:
        return None
    pair, rows, blocks, counts, full_runs, key_ok = found
    masks, has_key = [], []
    if masks_too:
        # FULL runs: masked by padding only, which is not all of it (routed_state)
        masks += _padding_masks(key_ok[:full_runs], dtype)
        full_rows = sum(r.numel() for r in rows[:full_runs])
        has_key.append(torch.ones(full_rows, dtype=torch.bool, device=call.device))
        if full_runs < len(blocks):
            kind_masks, keyed = _partial_masks(
                part, frame, fine, tuple(x[full_rows:] for x in pair), factor, block, shape,
                key_ok[full_runs:], counts[full_runs:], [r.numel() for r in rows[full_runs:]],
                dtype,
            )  # fmt: skip
            masks += kind_masks
            has_key.append(keyed)
    none = torch.zeros(0, dtype=torch.bool, device=call.device)  # counted without masks
    has_key = torch.cat(has_key) if has_key else none
    if not shared:
        return Runs(frame, factor, shape, rows, blocks, masks, has_key)
    return _for_every_sequence_and_head(call, frame, factor, shape, rows, blocks, masks, has_key)


def _allowed_pairs(
    part: Pattern, frame: Frame, padded: Tensor | None, B: int, H: int
) -> tuple[tuple[Tensor, ...], bool]:
    """The (sequence, head, query slot, key block) pairs that ``part`` allows in ``frame`` (one
    query per block), each with its state (FULL or PARTIAL), as five (P,) tensors; and whether
    the layout is one for every sequence and head (``Runs.shared``: then b = h = 0).

    The states are read a slice of queries at a time, (B, H, slice, key blocks) within
    STATE_CHUNK: the whole per-query layout would be n^2 / block (537 MB at 128K tokens, 16
    heads, key blocks of 512), the pairs are n * top_k."""
    q_spans, k_spans = frame.q.spans(), frame.k.spans().row()
    step = max(1, STATE_CHUNK // max(1, B * H * frame.k.num_blocks))
    found, shared = [], False
    for start in range(0, frame.q.num_blocks, step):
        rows = slice(start, start + step)
        state = part.block_state(q_spans.map(lambda t, rows=rows: t[rows]).column(), k_spans)
        if start == 0:
            shared = padded is None and state.shape[:2] == (1, 1)
        state = with_padding(state, frame, *((1, 1) if shared else (B, H)), padded)
        b, h, i, j = (state != EMPTY).nonzero(as_tuple=True)
        found.append((b, h, i + start, j, state[b, h, i, j]))
    if len(found) == 1:  # no copy: each operation is host work on a GPU
        return found[0], shared
    return tuple(torch.cat(x) for x in zip(*found, strict=True)), shared


def _frame_of(
    part: Pattern, call: AttentionCall, padding: Tensor | None, q_block: int, k_block: int
) -> tuple[Frame, Tensor | None]:
    """``part``'s frame for this call at these block sizes, and its key padding by slot (None
    without padding)."""
    frame = build_frame(part.stride, call.q_len, call.kv_len, q_block, k_block, call.device)
    return frame, None if padding is None else frame.k.gather(padding[:, :, None])[..., 0]


def _run_frame(
    part: Pattern, call: AttentionCall, block: int, padding: Tensor | None
) -> tuple[int, Frame, Tensor | None]:
    """(factor, frame, its key padding) of the runs: one query per block, key blocks of
    ``factor`` kernel blocks, coarsened up to COARSE while that fits the keys twice (the kernel
    is faster per score on larger blocks); kernel blocks only in a regrouped token order."""
    factor, chosen = 1, _chosen_block(part)
    while factor < COARSE and 2 * factor * block <= call.kv_len:
        if chosen is not None and chosen % (2 * factor * block):  # would cut its blocks
            break
        factor *= 2
    frame, padded = _frame_of(part, call, padding, 1, factor * block)
    if not frame.k.identity:  # a regrouped order: kernel blocks only
        factor = 1
        frame, padded = _frame_of(part, call, padding, 1, block)
    return factor, frame, padded


def _chosen_block(part: Pattern) -> int | None:
    """The size of the key blocks that ``part`` chooses by content (MoBA's, a ``ChosenBlocks``
    alone or intersected with fixed members), else None. A run's key block holds whole chosen
    blocks only: one across two of them (512 keys against blocks of 256) is PARTIAL for almost
    every query, and each of its keys is then asked (eval/results/moba-runs-cpu)."""
    members = part.children if isinstance(part, Intersection) else (part,)
    sizes = [m.block_size for m in members if isinstance(m, ChosenBlocks)]
    return sizes[0] if len(sizes) == 1 else None


def _kernel_block_states(
    part: Pattern, call: AttentionCall, block: int, padding: Tensor | None, factor: int,
    shape: tuple[int, int, int],
) -> Tensor:  # fmt: skip
    """Inside a key block of ``factor`` kernel blocks, the states of its kernel blocks per query
    block of ``block`` queries, (B, H, Qb, Kb, factor) for ``shape`` (B, H, Kb). Where FULL or
    EMPTY there, so for each of its queries: only PARTIAL ones are asked key by key."""
    B, H, Kb = shape
    blocks_frame, blocks_padded = _frame_of(part, call, padding, block, block)
    fine = routed_state(part, blocks_frame, B, H, blocks_padded)  # (B, H, Qb, kernel blocks)
    fine = torch.nn.functional.pad(fine, (0, Kb * factor - fine.shape[-1]), value=EMPTY)
    return fine.unflatten(-1, (Kb, factor))  # (B, H, Qb, Kb, factor)


def _pairs_by_key_block(
    pair: tuple[Tensor, ...], frame: Frame, padded: Tensor | None,
    shape: tuple[int, int, int, int], kv_heads: int, device: torch.device,
) -> tuple | None:  # fmt: skip
    """The (query, key block) pairs (b, h, i, j, state) grouped into runs, FULL runs first:
    (the pairs ordered by run, each run's flat (b, h, slot) rows, its flat (b, h_kv, key
    block), the runs' row counts, how many runs are FULL, their keys' validity (R, bk)); None
    without a pair. The query heads of a key/value head share its runs, so each key block is
    read once per key/value head. One sort for both kinds, and one read of the runs (their key
    blocks and sizes) on the host."""
    b, h, i, j, state = pair
    if b.numel() == 0:
        return None
    B, H, Sq, Kb = shape
    group = H // kv_heads
    every = B * kv_heads * Kb
    # Pairs ordered by kind, (sequence, kv head, key block), then query: a run per key block.
    run = (b * kv_heads + h // group) * Kb + j + torch.where(state == FULL, 0, every)
    order = ((run * group + h % group) * Sq + i).argsort()
    pair, run = tuple(x[order] for x in pair), run[order]
    b, h, i, _, _ = pair
    runs_of, counts = torch.unique_consecutive(run, return_counts=True)
    runs_on_host, counts_on_host = torch.stack((runs_of, counts)).tolist()  # one read
    full_runs = sum(r < every for r in runs_on_host)
    run_blocks = runs_of % every
    bk = frame.k.block
    slot = (run_blocks % Kb)[:, None] * bk + torch.arange(bk, device=device)  # (R, bk)
    key_ok = frame.k.valid[slot]
    if padded is not None:
        key_ok = key_ok & ~padded[(run_blocks // (kv_heads * Kb))[:, None], slot]
    rows = ((b * H + h) * Sq + i).split(counts_on_host)
    blocks = [r % every for r in runs_on_host]
    return pair, rows, blocks, counts, full_runs, key_ok


def _padding_masks(key_ok: Tensor, dtype: torch.dtype) -> list[Tensor | None]:
    """FULL runs' masks: each run's keys' padding (1, 1, 1, bk), one row for all of its
    queries, or None where every key is valid (no mask for the kernel to add)."""
    bk = key_ok.shape[-1]
    every = key_ok.all(-1).tolist()
    if all(every):
        return [None] * len(every)
    additive = _additive(key_ok, dtype)  # one tensor for all runs, a view each: no op per run
    rows = additive.view(-1, 1, 1, 1, bk).unbind(0)
    return [None if all_valid else row for all_valid, row in zip(every, rows, strict=True)]


def _partial_masks(
    part: Pattern, frame: Frame, fine: Tensor | None, pair: tuple[Tensor, ...], factor: int,
    block: int, shape: tuple[int, int, int, int], key_ok: Tensor, counts: Tensor,
    sizes: list[int], dtype: torch.dtype,
) -> tuple[list[Tensor], Tensor]:  # fmt: skip
    """PARTIAL runs' masks, (1, 1, n, bk) each, a row per query from its kernel blocks' states
    (``fine``; the pairs' own states where a key block is one kernel block) and its keys'
    padding; and whether each row keeps a key (a keyless row must get weight 0)."""
    b, h, i, j, state = pair
    sub = fine[b, h, i // block, j] if fine is not None else state[:, None]  # (P, factor)
    ok = _partial_pairs(part, frame, sub, pair[:4], factor, shape)  # (P, bk)
    ok = ok & key_ok.repeat_interleave(counts, dim=0, output_size=sum(sizes))  # no sync
    masks = list(_additive(ok, dtype)[None, None].split(sizes, dim=2))  # views, ``counts``
    return masks, ok.any(-1)


def _for_every_sequence_and_head(
    call: AttentionCall, frame: Frame, factor: int, shape: tuple[int, int, int, int],
    rows: list[Tensor], blocks: list[int], masks: list[Tensor | None], has_key: Tensor,
) -> Runs:  # fmt: skip
    """Shared runs, read from one sequence and head (``shape`` (1, 1, Sq, Kb)), as runs of every
    sequence and head: each run's rows in the order (b, h, query), its masks the same for each."""
    _, _, Sq, Kb = shape
    B, H = call.q.shape[:2]  # each run for every sequence and head, in the order (b, h, query)
    every = torch.arange(B * H, device=call.device)[:, None] * Sq
    if has_key.numel():
        runs_keyed = has_key.split([r.numel() for r in rows])
        has_key = torch.cat([k.expand(B * H, -1).flatten() for k in runs_keyed])
    group = H // call.k.shape[1]  # a key/value head's query heads are extra query rows
    masks = [m if m is None or m.shape[2] == 1 else m.repeat(1, 1, group, 1) for m in masks]
    rows = [(every + r).flatten() for r in rows]
    return Runs(frame, factor, (B, H, Sq, Kb), rows, blocks, masks, has_key, shared=True)


def _partial_pairs(
    part: Pattern, frame: Frame, fine: Tensor, pair: tuple[Tensor, ...], factor: int,
    shape: tuple[int, int, int, int],
) -> Tensor:  # fmt: skip
    """(P, bk) allowed keys of PARTIAL (query, key block) pairs (b, h, i, j) of a call shaped
    (B, H, query slots, key blocks): from their kernel blocks' states (fine (P, factor)), the
    pattern asked key by key only inside PARTIAL kernel blocks, or, where it lists its pairs,
    each listed pair set in its place."""
    bk = frame.k.block
    sub = bk // factor
    ok = (fine == FULL).repeat_interleave(sub, dim=-1)  # (P, bk)
    listed = part.listed_pairs(shape[0]) if frame.k.identity and frame.q.identity else None
    if listed is not None:
        return _set_listed(ok, listed, pair, shape, bk)
    n, f = (fine == PARTIAL).nonzero(as_tuple=True)
    b, h, i, j = (x[n][:, None] for x in pair)
    slot = (j * factor + f[:, None]) * sub + torch.arange(sub, device=fine.device)  # (N, sub)
    inside = part.allowed_at(b, h, frame.q.position[i], frame.k.position[slot])
    ok.view(-1, factor, sub)[n, f] = inside
    return ok


def _set_listed(
    ok: Tensor, listed: tuple[Tensor, ...], pair: tuple[Tensor, ...],
    shape: tuple[int, int, int, int], bk: int,
) -> Tensor:  # fmt: skip
    """``ok`` with every listed pair (sequence, query, key), for every head, set True in the row
    of its (query, key block) pair where that is one of ``pair``: far faster than asking
    ``allowed_at`` for the 64 keys of each PARTIAL block
    (measured: eval/results/design-notes-cpu.md#by-key-listed-pairs)."""
    _, H, Sq, Kb = shape
    b, h, i, j = pair
    code = ((b * H + h) * Sq + i) * Kb + j  # (P,), unique
    order = code.argsort()
    known = code[order]
    seq, q, k = listed
    heads = torch.arange(H, device=seq.device)
    want = (((seq * H)[:, None] + heads) * Sq + q[:, None]) * Kb + (k // bk)[:, None]  # (E, H)
    at = torch.searchsorted(known, want.flatten()).clamp(max=known.numel() - 1)
    hit = known[at] == want.flatten()
    ok[order[at[hit]], (k % bk).repeat_interleave(H)[hit]] = True
    return ok


def _additive(ok: Tensor, dtype: torch.dtype) -> Tensor:
    return torch.zeros(ok.shape, dtype=dtype, device=ok.device).masked_fill_(~ok, float("-inf"))


def _key_blocks(r: Runs, x: Tensor) -> Tensor:
    """x (B, H_kv, slots, D) as the runs' key blocks, a view indexed by a run's ``block``: each
    (1, 1, bk, D) as the kernel reads it, or for shared runs (B, H_kv, bk, D). The backward adds
    into them."""
    blocks = x.unflatten(2, (-1, r.frame.k.block))  # (B, H_kv, Kb, bk, D)
    return blocks.movedim(2, 0) if r.shared else blocks.flatten(0, 2)[:, None, None]


def _each(r: Runs, q: Tensor, k: Tensor, v: Tensor) -> Iterator[tuple]:
    """Each run: (rows, queries (1, 1, n, D), or for a shared run (B, H_kv, heads per key/value
    head * n, D), keys, values (views), mask, block)."""
    # Views made by one operation for all runs (split, unbind), not one per run: on a GPU each
    # is host work, and a pass has thousands of runs.
    queries = q.reshape(r.queries, -1).index_select(0, torch.cat(r.rows))
    sizes = [rows.numel() for rows in r.rows]
    B, kv_heads = k.shape[:2]
    if r.shared:
        split = [qs.view(B, kv_heads, -1, qs.shape[-1]) for qs in queries.split(sizes)]
    else:
        split = queries.view(1, 1, *queries.shape).split(sizes, dim=2)
    k_blocks, v_blocks = _key_blocks(r, k).unbind(0), _key_blocks(r, v).unbind(0)
    for rows, qs, block, mask in zip(r.rows, split, r.blocks, r.masks, strict=True):
        yield rows, qs, k_blocks[block], v_blocks[block], mask, block


class _Attention(torch.autograd.Function):
    """(output (B*H*Sq, D), log-sum-exp (B*H*Sq,)) of q (B, H, Sq, D) against k and v
    (B, H_kv, Sk, D) on the runs; a query in no run gets zeros and -inf."""

    @staticmethod
    def forward(
        ctx, q: Tensor, k: Tensor, v: Tensor, r: Runs, kernel: LseKernel
    ) -> tuple[Tensor, Tensor]:
        outs, lses = [], []
        each = [
            (queries, keys, values, mask) for _, queries, keys, values, mask, _ in _each(r, q, k, v)
        ]
        for out, lse in kernel.forward_all(each, 1.0):
            outs.append(out)
            lses.append(lse)
        if r.shared:  # (B, H_kv, rows, D) each: in the order of the run's rows once flattened
            outs = [out.reshape(-1, out.shape[-1]) for out in outs]
            lses = [lse.flatten() for lse in lses]
        else:  # (1, 1, n, D) each: joined along the rows, no operation per run
            outs, lses = [torch.cat(outs, dim=2)[0, 0]], [torch.cat(lses, dim=2)[0, 0]]
        rows = torch.cat(r.rows)
        # A kernel gives a keyless row lse 0 or -inf and output 0 or NaN: its weight must be 0,
        # and it is kept out by torch.where (NaN * 0 is NaN).
        keyed = r.has_key
        lse = torch.cat(lses).masked_fill(~keyed, float("-inf"))
        top = lse.new_full((r.queries,), float("-inf")).scatter_reduce(0, rows, lse, "amax")
        top = torch.where(torch.isfinite(top), top, 0)
        weight = torch.exp(lse - top[rows])  # 0 for keyless rows
        total = weight.new_zeros(r.queries).index_add_(0, rows, weight)
        share = (weight / torch.where(total > 0, total, 1)[rows]).to(q.dtype)
        out = torch.where(keyed[:, None], torch.cat(outs) * share[:, None], 0)
        out = out.new_zeros(r.queries, out.shape[-1]).index_add_(0, rows, out)
        lse = top + torch.log(total)  # -inf where no key
        ctx.set_materialize_grads(False)
        ctx.runs, ctx.kernel = r, kernel
        ctx.save_for_backward(q, k, v, out, lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out: Tensor | None, grad_lse: Tensor | None) -> tuple:
        q, k, v, out, lse = ctx.saved_tensors
        r: Runs = ctx.runs
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        lse = torch.where(torch.isfinite(lse), lse, 0)  # a keyless row's probabilities stay 0
        dq, dk, dv = torch.zeros_like(out), torch.zeros_like(k), torch.zeros_like(v)
        each = list(_each(r, q, k, v))
        # Each tensor read for every run at once and cut into views, the gradients added back
        # at once: no operation per run (thousands of runs, each a kernel launch on a GPU).
        rows = torch.cat(r.rows)
        sizes = [x.numel() for x in r.rows]
        if r.shared:
            per_run = [x.index_select(0, rows).split(sizes) for x in (out, grad_out, lse)]
            runs = [
                (d_o.view(qs.shape), qs, ks, vs, o.view(qs.shape), m.view(qs.shape[:-1]), mask)
                for (_, qs, ks, vs, mask, _), o, d_o, m in zip(each, *per_run, strict=True)
            ]
        else:  # (1, 1, n, ...) views of one gather each: no operation per run
            per_run = [
                x.index_select(0, rows).view(1, 1, rows.numel(), *x.shape[1:]).split(sizes, dim=2)
                for x in (out, grad_out, lse)
            ]
            runs = [
                (d_o, qs, ks, vs, o, m, mask)
                for (_, qs, ks, vs, mask, _), o, d_o, m in zip(each, *per_run, strict=True)
            ]
        if grad_lse is None:
            grads = ctx.kernel.backward_all(runs, 1.0)
        else:  # the mass's gradient enters: d lse / d score = probability, explicitly
            grad_lses = grad_lse.index_select(0, rows).split(sizes)
            grads = [
                explicit_backward(*run[:6], run[6], 1.0, g.view(run[5].shape))
                for run, g in zip(runs, grad_lses, strict=True)
            ]
        dq_runs, dk_runs, dv_runs = zip(*grads, strict=True)
        if r.shared:
            dq.index_add_(0, rows, torch.cat([x.reshape(-1, x.shape[-1]) for x in dq_runs]))
        else:
            dq.index_add_(0, rows, torch.cat(dq_runs, dim=2)[0, 0])
        blocks = torch.tensor(r.blocks, device=dq.device)
        _key_blocks(r, dk).index_add_(0, blocks, torch.stack(dk_runs))
        _key_blocks(r, dv).index_add_(0, blocks, torch.stack(dv_runs))
        return dq.view(q.shape), dk, dv, None, None


def attention_by_key(
    call: AttentionCall, part: Pattern, dtype: torch.dtype, block: int
) -> tuple[Tensor, Tensor, Tensor] | None:
    """(output (B, H, Lq, Dv), softmax mass (B, H, Lq), row maximum (B, H, Lq)) over this part's
    keys, as ``blocked``'s explicit path returns them; None when the part allows no pair."""
    p = runs(part, call, block, call.key_padding_mask, dtype)
    if p is None:
        return None
    B, H, Sq, _ = p.shape
    q, k = call.score.prepare(call.q.to(dtype), call.k.to(dtype))
    v = call.v.to(dtype)
    # The kernel wants one head size (on CUDA a multiple of 8): zeros appended to q and k
    # leave the scores, to v the output's first Dv columns.
    kernel = kernel_for(call.device)
    width = kernel.widened(max(q.shape[-1], v.shape[-1]))
    q, k, v = (
        axis.gather(torch.nn.functional.pad(x, (0, width - x.shape[-1]))).contiguous()
        for axis, x in ((p.frame.q, q), (p.frame.k, k), (p.frame.k, v))
    )
    out, lse = _Attention.apply(q, k, v, p, kernel)
    out = out[:, : call.v.shape[-1]]

    def in_order(x: Tensor) -> Tensor:  # (B * H * Sq, ...) -> (B, H, Lq, ...)
        return p.frame.q.scatter(x.unflatten(0, (B, H, Sq)), dim=2)

    out, lse = in_order(out), in_order(lse)
    peak = lse.detach()
    finite = torch.isfinite(peak)
    mass = torch.where(finite, torch.exp(lse - torch.where(finite, peak, 0)), 0)
    return out, mass, peak


def scored_by_key(call: AttentionCall, part: Pattern, block: int) -> tuple[int, bool]:
    """Scores the runs compute per sequence and head (their mean): each run's queries times
    its key block; and whether the runs are shared by every sequence and head."""
    r = runs(part, call, block, call.key_padding_mask, call.q.dtype, masks_too=False)
    if r is None:
        return 0, False
    B, H = r.shape[:2]
    return round(sum(rows.numel() for rows in r.rows) * r.frame.k.block / (B * H)), r.shared
