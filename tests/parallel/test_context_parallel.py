"""Context parallelism (``zoo.parallel``, ``zoo.attention(..., cp_group=)``) in 2 and 4 gloo
processes: each rank's shard of the output and of dq, dk, dv equals the one-process call on the
whole sequence, in float64, for every fixed-pattern variant, causal or not, padded or not, with
grouped-query heads, at a length that is not a multiple of the blocks; bad calls raise on every
rank; ``zoo.explain``'s bytes and pairs equal counts made from the dense mask.

One group of processes per world size runs every check (a process start costs seconds), each
rank writing its failures to a file that the tests read.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import socket
import time
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import FIXED_VARIANTS, GRAPH_VARIANTS, gpu, small_params, subprocess_timeout

import zoo
from zoo.backends.flex import FlexBackend
from zoo.core import shape_cache
from zoo.core.resolve import call_pattern
from zoo.functional import prepare_call, resolve_pattern
from zoo.layout.block_layout import specialized
from zoo.parallel import ShardLayout, exchange_plan, shard, shard_stats, unshard
from zoo.parallel.at_positions import AtPositions
from zoo.parallel.sharded import rank_pattern, ship_ratio
from zoo.patterns import Local, Moba
from zoo.patterns.routed import RouteInputs

LENGTH = 56  # 56 / 16 (block_size): the last pattern block ends mid-way; shards of 28 and 14
PLAN_BLOCK = 8  # shards of 14 (4 ranks) and chunks of 7 end mid-block
BATCH, HEADS, KV_HEADS, HEAD_DIM = 2, 4, 2, 8
VARIANTS = [name for name in FIXED_VARIANTS if name not in GRAPH_VARIANTS]
BACKENDS = ("reference", "blocked", "sdpa")  # flex: no backward on a CPU
ORDERS = ("contiguous", "head_tail")
ENCODINGS = (None, "rope", "alibi")
TOLERANCE = 1e-9  # float64


def cases() -> list[tuple]:
    """(variant, causal, padded, backend, order, pos): every variant, causal or not, padded or
    not; backends, orders and encodings in turn, so each meets each across the cases."""
    combos = itertools.product(VARIANTS, (False, True), (False, True))
    rotated = [
        (variant, causal, padded, BACKENDS[i % 3], ORDERS[(i // 3) % 2], ENCODINGS[i % 5 % 3])
        for i, (variant, causal, padded) in enumerate(combos)
    ]
    # Unpadded causal on sdpa runs each chunk's call without a mask (``causal_prefix``): the
    # rotation gives it contiguous shards only.
    return [*rotated, ("causal", True, False, "sdpa", "head_tail", "rope")]


def _inputs(length: int = LENGTH) -> tuple[torch.Tensor, ...]:
    """The whole sequence: q, k, v, key padding, and an output gradient (float64)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(BATCH, HEADS, length, HEAD_DIM, generator=g, dtype=torch.float64)
    k = torch.randn(BATCH, KV_HEADS, length, HEAD_DIM, generator=g, dtype=torch.float64)
    v = torch.randn(BATCH, KV_HEADS, length, HEAD_DIM, generator=g, dtype=torch.float64)
    padding = torch.zeros(BATCH, length, dtype=torch.bool)
    padding[0, 3] = padding[1, -9:] = True  # one key inside, and a tail over a shard's end
    grad = torch.randn(BATCH, HEADS, length, HEAD_DIM, generator=g, dtype=torch.float64)
    return q, k, v, padding, grad


def _error(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def _shard_errors(out, mine, reference, whole, rank, world, order) -> list[float]:
    """|error| of this rank's out, dq, dk, dv against its shard of the one-process call's."""
    errors = [_error(out, shard(reference.detach(), rank, world, order=order))]
    # A shard whose keys no query reads (causal `global`: only the global keys are read) gets
    # no gradient: None, PyTorch's zero.
    errors += [_error(torch.zeros_like(a) if a.grad is None else a.grad,
                      shard(b.grad, rank, world, order=order))
               for a, b in zip(mine, whole, strict=True)]  # fmt: skip
    return errors


def _check_matches(rank: int, world: int, group) -> list[str]:
    """Each case's shard of out, dq, dk, dv against the one-process reference call: every other
    case through ``zoo.attention`` (on a CPU: a call per chunk, after the exchange), whose plan
    blocks are whole chunks at this length, and the rest with ``overlap`` and plan blocks of
    PLAN_BLOCK, where a window's interior rows run while the exchange is in flight (and some
    case must have such rows)."""
    q, k, v, padding, grad = _inputs()
    failures, interior = [], 0
    for i, (variant, causal, padded, backend, order, pos) in enumerate(cases()):
        kwargs = dict(variant=variant, causal=causal, pos=pos, **small_params(variant))
        whole = [t.clone().requires_grad_() for t in (q, k, v)]
        reference = zoo.attention(
            *whole, backend="reference", key_padding_mask=padding if padded else None, **kwargs
        )
        reference.backward(grad)
        mine = [shard(t, rank, world, order=order).requires_grad_() for t in (q, k, v)]
        mask = shard(padding, rank, world, dim=1, order=order) if padded else None
        if i % 2:
            options = dict(group=group, order=order, plan_block=PLAN_BLOCK, key_padding_mask=mask)
            out = zoo.parallel.context_parallel_attention(*mine, backend=backend, overlap=True,
                                                          **options, **kwargs)  # fmt: skip
            interior += shard_stats(*[t.detach() for t in mine], **options, **kwargs).interior_rows
        else:
            out = zoo.attention(*mine, backend=backend, cp_group=group, cp_order=order,
                                key_padding_mask=mask, **kwargs)  # fmt: skip
        out.backward(shard(grad, rank, world, order=order))
        errors = _shard_errors(out, mine, reference, whole, rank, world, order)
        if max(errors) > TOLERANCE:
            case = f"{variant} causal={causal} padded={padded} {backend} {order} pos={pos}"
            shown = ", ".join(f"{e:.1e}" for e in errors)
            failures.append(f"rank {rank}: {case}: |error| out, dq, dk, dv = {shown}")
    if not interior:
        failures.append(f"rank {rank}: no case computed interior rows during the exchange")
    return failures


OVERLAP_LENGTH = 128  # shards of 64 or 32: four plan blocks or more, two in the interior


def _check_overlap(rank: int, world: int, group) -> list[str]:
    """The order of events on a rank whose window has interior rows: the exchange is posted,
    the interior rows' call runs, then the rank waits for the keys and runs the edge rows'
    call; in the backward, the edge call's gradients are posted back before the interior rows'
    backward runs, and waited for after it. That is the overlap, in both directions."""
    events: list[str] = []
    sharded, exchange = zoo.parallel.sharded, zoo.parallel.exchange
    one_call, post, wait = sharded._one_call, exchange.Pending.__init__, exchange.Pending.wait

    def recorded_call(q, *args):
        calls = sum(e.startswith("call") for e in events if "backward" not in e)
        q.register_hook(lambda _: events.append(f"call {calls} backward"))
        events.append(f"call {calls}")
        return one_call(q, *args)

    def recorded_post(self, *args):
        events.append("post")
        post(self, *args)

    def recorded_wait(self):
        events.append("wait")
        return wait(self)

    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, OVERLAP_LENGTH, 8, generator=g, dtype=torch.float64)
               for _ in range(3))  # fmt: skip
    mine = [shard(t, rank, world).requires_grad_() for t in (q, k, v)]
    sharded._one_call, exchange.Pending.__init__, exchange.Pending.wait = (
        recorded_call, recorded_post, recorded_wait)  # fmt: skip
    try:
        out = zoo.parallel.context_parallel_attention(
            *mine, group=group, variant="local", window_size=3, plan_block=PLAN_BLOCK,
            overlap=True,
        )  # fmt: skip
        out.sum().backward()
    finally:
        sharded._one_call, exchange.Pending.__init__, exchange.Pending.wait = one_call, post, wait
    expected = ["post", "call 0", "wait", "call 1",  # forward: interior, then edge rows
                "call 1 backward", "post", "call 0 backward", "wait"]  # fmt: skip
    if events != expected:
        return [f"rank {rank}: events {events}, expected {expected}"]
    return []


FLEX_VARIANTS = ("sliding_window", "causal", "longformer", "bigbird", "dilated", "neighborhood_2d")


def _check_flex(rank: int, world: int, group) -> list[str]:
    """Flex (its eager path: no backward on a CPU, and compiling each call would cost seconds)
    at 2 ranks, on a variant of each kind of plan (a halo, a causal prefix, global rows
    shipped, random blocks per head, a regrouped order, a 2-D grid), causal or not in turn,
    padded, both orders, in float32 (flex takes no float64): the forward equals the shard of
    the one-process call on the same backend within twice that call's own error against the
    float64 reference. The mask_mod reads the global positions each call maps its indices
    to. (Every variant would cost 2 to 5 minutes here: an eager flex call takes about a
    second on this CPU.)"""
    if world != 2:
        return []
    q, k, v, padding, _ = _inputs()
    flex, failures = FlexBackend(compile=False), []
    for i, variant in enumerate(FLEX_VARIANTS):
        causal, order = bool(i % 2), ORDERS[i // 2 % 2]
        kwargs = dict(variant=variant, causal=causal, key_padding_mask=padding,
                      **small_params(variant))  # fmt: skip
        whole = shard(zoo.attention(q, k, v, backend="reference", **kwargs), rank, world,
                      order=order)  # fmt: skip
        one = zoo.attention(*(t.float() for t in (q, k, v)), backend=flex, **kwargs)
        allowed = 2 * _error(shard(one, rank, world, order=order).double(), whole) + 1e-7
        kwargs["key_padding_mask"] = shard(padding, rank, world, dim=1, order=order)
        mine = [shard(t, rank, world, order=order).float() for t in (q, k, v)]
        out = zoo.parallel.context_parallel_attention(
            *mine, group=group, backend=flex, order=order, plan_block=PLAN_BLOCK,
            overlap=bool(i % 3), **kwargs,
        )  # fmt: skip
        error = _error(out.double(), whole)
        if not error <= allowed:
            failures.append(f"rank {rank}: flex {variant} causal={causal} {order}: {error:.1e} "
                            f"> {allowed:.1e}")  # fmt: skip
    return failures


MOBA = dict(variant="moba", block_size=4, top_k=3)  # blocks of 4 straddle chunks of 7 (4 ranks)
ROUTED_CASES = (  # (variant and parameters, causal, padded, backend, order, pos)
    (MOBA, True, True, "blocked", "contiguous", "rope"),
    (MOBA, False, False, "reference", "head_tail", None),
    (MOBA, True, False, "sdpa", "head_tail", "alibi"),
    (MOBA, False, True, "blocked", "contiguous", None),
    (dict(variant=Moba(block_size=4, top_k=2) | Local(window_size=5)), True, True, "blocked",
     "head_tail", None),
)  # fmt: skip


def _counting(start_keys, record: list):
    """``start_keys`` that records how many rows the rank fetches."""

    def counted(k, v, sends, fetch, *args):
        record.append(sum(rows.numel() for rows in fetch.values()))
        return start_keys(k, v, sends, fetch, *args)

    return counted


def _check_routed(rank: int, world: int, group) -> list[str]:
    """MoBA (and a union with a window), its blocks chosen from the block sums every rank adds
    up: each rank's shard of the output and of dq, dk, dv equals the one-process call (float64),
    causal or not, padded or not, both orders, overlapped and not; and the rows it fetches are
    the plan blocks of other ranks that hold a key its queries read in the one-process call's
    mask."""
    q, k, v, padding, grad = _inputs()
    failures = []
    for i, (variant, causal, padded, backend, order, pos) in enumerate(ROUTED_CASES):
        kwargs = dict(causal=causal, pos=pos, **variant)
        whole_mask = padding if padded else None
        whole = [t.clone().requires_grad_() for t in (q, k, v)]
        reference = zoo.attention(*whole, backend="reference", key_padding_mask=whole_mask,
                                  **kwargs)  # fmt: skip
        reference.backward(grad)
        mine = [shard(t, rank, world, order=order).requires_grad_() for t in (q, k, v)]
        mask = shard(padding, rank, world, dim=1, order=order) if padded else None
        sharded = zoo.parallel.sharded
        fetched, start = [], sharded.start_keys
        sharded.start_keys = _counting(start, fetched)
        try:
            out = zoo.parallel.context_parallel_attention(
                *mine, group=group, backend=backend, order=order, key_padding_mask=mask,
                plan_block=PLAN_BLOCK, overlap=bool(i % 2), **kwargs,
            )  # fmt: skip
        finally:
            sharded.start_keys = start
        out.backward(shard(grad, rank, world, order=order))
        errors = _shard_errors(out, mine, reference, whole, rank, world, order)
        case = f"{variant} causal={causal} padded={padded} {backend} {order} pos={pos}"
        if max(errors) > TOLERANCE:
            shown = ", ".join(f"{e:.1e}" for e in errors)
            failures.append(f"rank {rank}: {case}: |error| out, dq, dk, dv = {shown}")
        call = prepare_call(q, k, v, key_padding_mask=whole_mask, **kwargs)
        layout = ShardLayout(world, LENGTH // world, order)
        rows = layout.positions(rank)
        reads = call.pattern.dense(LENGTH, LENGTH)[:, :, rows].flatten(0, 2).any(dim=0)
        expected = _fetched_rows(reads, layout, rank, PLAN_BLOCK)
        if fetched != [expected]:
            failures.append(f"rank {rank}: {case}: fetched {fetched} rows, the mask says "
                            f"{expected}")  # fmt: skip
    return failures


WIDE_LENGTH, WIDE_BLOCK = 128, 8  # shards of 8 plan blocks or more: a global block is wide
WIDE_VARIANTS = {
    "longformer": dict(window_size=8),
    "bigbird": dict(block_size=8, random_blocks=1),
    # The registry's causal forms keep only the first global block, which reads no other
    # rank's keys; a global block at the end is what ships under causal.
    "global": dict(global_tokens=[0, WIDE_LENGTH // 8 - 1], block_size=8),
}


def _check_wide(rank: int, world: int, group) -> list[str]:
    """Wide query rows (a global token's, which reads every key) shipped to the ranks that hold
    their keys and merged by log-sum-exp: out, dq, dk, dv equal the one-process call, causal or
    not, padded, grouped heads, alibi and rope at global positions, in both orders; and some
    causal case and some bidirectional one do ship (else this checks nothing new)."""
    g = torch.Generator().manual_seed(1)
    q, k, v, grad = (
        torch.randn(BATCH, heads, WIDE_LENGTH, HEAD_DIM, generator=g, dtype=torch.float64)
        for heads in (HEADS, KV_HEADS, KV_HEADS, HEADS)
    )
    padding = torch.zeros(BATCH, WIDE_LENGTH, dtype=torch.bool)
    padding[0, 5] = padding[1, -20:] = True
    failures, shipped = [], {False: 0, True: 0}  # wide rows, by causality
    combos = itertools.product(WIDE_VARIANTS, (False, True), ORDERS)
    for i, (variant, causal, order) in enumerate(combos):
        padded, pos = i % 2 == 0, ENCODINGS[i % 3]
        kwargs = dict(variant=variant, causal=causal, pos=pos, **WIDE_VARIANTS[variant])
        mask = padding if padded else None
        whole = [t.clone().requires_grad_() for t in (q, k, v)]
        reference = zoo.attention(*whole, backend="reference", key_padding_mask=mask, **kwargs)
        reference.backward(grad)
        mine = [shard(t, rank, world, order=order).requires_grad_() for t in (q, k, v)]
        mine_mask = None if mask is None else shard(mask, rank, world, dim=1, order=order)
        options = dict(group=group, order=order, plan_block=WIDE_BLOCK, key_padding_mask=mine_mask)
        out = zoo.parallel.context_parallel_attention(*mine, backend=BACKENDS[i % 3], **options,
                                                      **kwargs)  # fmt: skip
        out.backward(shard(grad, rank, world, order=order))
        shipped[causal] += shard_stats(*[t.detach() for t in mine], **options, **kwargs).wide_rows
        errors = _shard_errors(out, mine, reference, whole, rank, world, order)
        if max(errors) > TOLERANCE:
            case = f"{variant} causal={causal} padded={padded} {order} pos={pos}"
            shown = ", ".join(f"{e:.1e}" for e in errors)
            failures.append(f"rank {rank}: wide rows: {case}: |error| out, dq, dk, dv = {shown}")
    counted = torch.tensor([shipped[False], shipped[True]])
    dist.all_reduce(counted, group=group)
    for causal, count in zip((False, True), counted.tolist(), strict=True):
        if count == 0:
            failures.append(f"rank {rank}: no case with causal={causal} shipped wide rows at "
                            f"{world} ranks")  # fmt: skip
    return failures


def _check_frozen(rank: int, world: int, group) -> list[str]:
    """Wide rows where k and v record no gradient: only q does, or only a T5 table. The rank that
    ships wide rows had recorded its swaps and the others had not (nothing of theirs recorded
    gradients), so one rank's backward waited for the others' messages forever. Now every
    backward ends, and dq and the table's all-reduced gradient equal the one-process call's."""
    g = torch.Generator().manual_seed(2)
    q, k, v, grad = (
        torch.randn(BATCH, heads, WIDE_LENGTH, HEAD_DIM, generator=g, dtype=torch.float64)
        for heads in (HEADS, KV_HEADS, KV_HEADS, HEADS)
    )
    failures = []
    for learning in ("q", "t5"):
        torch.manual_seed(0)
        t5 = zoo.build_encoding("t5", dim=HEADS * HEAD_DIM, num_heads=HEADS).double()
        kwargs = dict(variant="longformer", pos=t5 if learning == "t5" else None,
                      **WIDE_VARIANTS["longformer"])  # fmt: skip
        whole_q = q.clone().requires_grad_(learning == "q")
        reference = zoo.attention(whole_q, k, v, backend="reference", **kwargs)
        reference.backward(grad)
        wanted = whole_q.grad if learning == "q" else t5.weight.grad.clone()
        t5.zero_grad()
        mine = [shard(t, rank, world) for t in (q, k, v)]
        mine[0].requires_grad_(learning == "q")
        out = zoo.parallel.context_parallel_attention(
            *mine, group=group, plan_block=WIDE_BLOCK, **kwargs
        )
        out.backward(shard(grad, rank, world))
        if learning == "q":
            got, wanted = mine[0].grad, shard(wanted, rank, world)
        else:
            got = t5.weight.grad
            dist.all_reduce(got, group=group)
        errors = [_error(out, shard(reference.detach(), rank, world)), _error(got, wanted)]
        if max(errors) > TOLERANCE:
            failures.append(f"rank {rank}: only {learning} learning: |error| out, grad = {errors}")
    return failures


@dataclass(frozen=True)
class _BrokenOnRankZero(zoo.patterns.Local):
    """A window whose specialisation fails on rank 0 alone."""

    def specialize(self, q_len, kv_len, device=None):
        if dist.get_rank() == 0:
            raise RuntimeError("broken on rank 0")
        return super().specialize(q_len, kv_len, device)


def _check_errors(rank: int, world: int, group) -> list[str]:
    """Bad calls: each must raise on EVERY rank (none left waiting), naming what to fix (a
    plan_block below 1 was once read as 1); a good call afterwards still matches (no message of
    a failed call left in flight)."""
    q, k, v, padding, _ = _inputs()
    mine = [shard(t, rank, world) for t in (q, k, v)]
    short = [t[:, :, :-1] if rank == world - 1 else t for t in mine]
    odd = [t[:, :, :-1] for t in mine]
    bad_calls = {
        "unequal shards": (short, dict(variant="local"), "shape"),
        "graph variant": (mine, dict(variant="graph"), "reads a graph"),
        "mechanism": (mine, dict(variant="performer"), "mechanism"),
        "misspelt on one rank": (mine, dict(variant="locl" if rank == 1 else "local"), "variant"),
        "bad parameter": (mine, dict(variant="local", window_size=-1), "window_size"),
        "odd shard, head_tail": (odd, dict(variant="local", cp_order="head_tail"), "cp_order"),
        "return_weights": (mine, dict(variant="local", return_weights=True), "return_weights"),
        "padding shape": (mine, dict(variant="local", key_padding_mask=padding), "key_padding"),
        # Not a tensor: an AttributeError in the agreement's fingerprint ("'list' object has no
        # attribute 'shape'") once came before it, on the ranks that passed it only.
        "padding a list on one rank": (
            mine,
            dict(variant="local", key_padding_mask=[[False] * 7] * BATCH if rank == 0 else None),
            "key_padding_mask",
        ),
        "q a list": ([q.tolist(), *mine[1:]], dict(variant="local"), "q must be a torch.Tensor"),
        # dropout decides whether wide rows ship: ranks that differed took mismatched
        # exchanges and gloo aborted every process; a scale that differed ran inconsistently
        "dropout on one rank": (
            mine,
            dict(variant="longformer", dropout_p=0.1 if rank == 1 else 0.0),
            "differ in dropout_p",
        ),
        "scale on one rank": (mine, dict(variant="local", scale=0.5 + rank), "differ in scale"),
    }
    failures = []
    for name, (tensors, kwargs, words) in bad_calls.items():
        try:
            zoo.attention(*tensors, cp_group=group, **kwargs)
        except (ValueError, TypeError) as error:
            if words not in str(error):
                failures.append(f"rank {rank}: {name}: {words!r} not in: {error}")
        else:
            failures.append(f"rank {rank}: {name}: no error raised")
    for name, options, words in (
        ("plan_block 0", dict(plan_block=0), "plan_block must be positive, got 0"),
        ("plan_block 8.0", dict(plan_block=8.0), "plan_block must be an int, got 8.0"),
        ("overlap 'yes'", dict(overlap="yes"), "overlap must be True or False, got 'yes'"),
    ):
        try:
            zoo.parallel.context_parallel_attention(*mine, group=group, variant="local",
                                                    window_size=7, **options)  # fmt: skip
        except Exception as error:  # plan_block 8.0 once failed deep inside the plan
            if words not in str(error):
                failures.append(f"rank {rank}: {name}: {words!r} not in: {error}")
        else:
            failures.append(f"rank {rank}: {name}: no error raised")
    # An error of another kind on one rank alone (a pattern of the user's that fails there):
    # raised there before the agreement, it left the other ranks waiting.
    try:
        zoo.attention(*mine, cp_group=group, variant=_BrokenOnRankZero(7))
    except Exception as error:
        if "broken on rank 0" not in str(error):
            failures.append(f"rank {rank}: fails on one rank: {error}")
    else:
        failures.append(f"rank {rank}: fails on one rank: no error raised")
    # The module's own work before the call, failing on some ranks only (a learned table that
    # the last shard's positions pass), or unchecked when sharded (lengths past the sequence).
    x = torch.randn(BATCH, LENGTH, 16, dtype=torch.float64)
    for name, pos_params, valid_lens, words in (
        ("learned too short", {"max_len": LENGTH - 1}, None, f"max_len={LENGTH - 1}"),
        ("valid_lens past L", None, torch.tensor([LENGTH + 5, 3]), f"lie in [0, {LENGTH}]"),
    ):
        module = zoo.MultiHeadAttention(16, 4, variant="local", window_size=3, pos="learned",
                                        pos_params=pos_params, cp_group=group).double()  # fmt: skip
        try:
            module(shard(x, rank, world, dim=1), valid_lens=valid_lens)
        except ValueError as error:
            if words not in str(error):
                failures.append(f"rank {rank}: module, {name}: {words!r} not in: {error}")
        else:
            failures.append(f"rank {rank}: module, {name}: no error raised")
    try:
        shard_stats(*mine, group=group, variant="local", window_size=7, plan_block=-4)
    except ValueError as error:
        if "plan_block must be positive, got -4" not in str(error):
            failures.append(f"rank {rank}: shard_stats plan_block -4: {error}")
    else:
        failures.append(f"rank {rank}: shard_stats plan_block -4: no error raised")
    out = zoo.attention(*mine, variant="local", window_size=7, cp_group=group)
    whole = zoo.attention(q, k, v, variant="local", window_size=7, backend="reference")
    if _error(out, shard(whole, rank, world)) > TOLERANCE:
        failures.append(f"rank {rank}: the call after the errors does not match")
    return failures


def _fetched_rows(reads: torch.Tensor, layout: ShardLayout, rank: int, block: int) -> int:
    """Rows of other ranks' plan blocks that hold a key of ``reads`` [L]."""
    fetched = 0
    for chunk in range(layout.world * layout.chunks_per_rank):
        if layout.owner(chunk)[0] == rank:
            continue
        for lo in range(chunk * layout.chunk, (chunk + 1) * layout.chunk, block):
            hi = min(lo + block, (chunk + 1) * layout.chunk)
            fetched += (hi - lo) if bool(reads[lo:hi].any()) else 0
    return fetched


def _check_explain(rank: int, world: int, group) -> list[str]:
    """Bytes received and pairs per rank (``shard_stats``, the numbers ``zoo.explain`` prints)
    against counts made from the pattern's dense mask: a key block of the plan is fetched when
    some query of the rank may attend some key of it, for the key/value heads whose query heads
    do (and some case must fetch some rows for some heads only, else that goes unchecked)."""
    failures, some_heads = [], 0
    cases = [(variant, causal, order, small_params(variant), LENGTH) for variant, causal, order
             in itertools.product(("local", "sliding_window", "bigbird", "global", "full",
                                   "strided"), (False, True), ORDERS)]  # fmt: skip
    # BigBird over more blocks, as _check_wide runs it: its heads' random blocks differ there.
    cases += [("bigbird", causal, order, WIDE_VARIANTS["bigbird"], WIDE_LENGTH)
              for causal, order in itertools.product((False, True), ORDERS)]  # fmt: skip
    for variant, causal, order, params, length in cases:
        q, k, v, padding, _ = _inputs(length)
        call = prepare_call(q, k, v, variant=variant, causal=causal, **params)
        dense = call.pattern.dense(length, length).reshape(-1, length, length)  # [heads, L, L]
        layout = ShardLayout(world, length // world, order)
        rows = layout.positions(rank)
        block = min(PLAN_BLOCK, layout.chunk)
        # Which rows the plan ships (global blocks) is the plan's choice; what they and the
        # other rows then cost is counted here.
        mine = [shard(t, rank, world, order=order) for t in (q, k, v)]
        plan = exchange_plan(call.pattern, layout, PLAN_BLOCK, torch.device("cpu"),
                             ship_ratio(*mine))  # fmt: skip
        wide = plan.ranks[rank].wide_positions
        narrow = rows[~torch.isin(rows, wide)]
        reads = dense[:, narrow, :].any(dim=(0, 1))  # [L]: keys some head of its rows reads
        fetched = _fetched_rows(reads, layout, rank, block)
        # A key/value head's rows travel where one of its query heads reads them (a pattern
        # drawn per head: BigBird's random blocks); every head of a row for one pattern.
        per_head = dense.expand(HEADS, -1, -1)[:, narrow, :].unflatten(0, (KV_HEADS, -1))
        head_rows = sum(_fetched_rows(per_head[j].any(dim=(0, 1)), layout, rank, block)
                        for j in range(KV_HEADS))  # fmt: skip
        some_heads += head_rows < KV_HEADS * fetched
        shipped_in = sum(plan.shippers(rank).values()) * HEADS * HEAD_DIM  # others' wide rows
        partials_in = wide.numel() * len(plan.ranks[rank].ship_to) * HEADS * (HEAD_DIM + 1)
        expected_bytes = BATCH * (head_rows * 2 * HEAD_DIM * 8 + fetched  # float64, padding
                                  + (shipped_in + partials_in) * 8)  # fmt: skip
        expected_pairs = dense[:, rows, :].sum().item() / dense.shape[0]
        others = torch.ones(length, dtype=torch.bool)
        others[rows] = False  # keys of other ranks
        interior = 0  # rows of query blocks that read no other rank's key
        for chunk in rows.split(layout.chunk):  # blocks of the plan start at each chunk's start
            for in_block in chunk.split(block):
                interior += in_block.numel() * int(not dense[:, in_block][..., others].any())
        stats = shard_stats(
            *mine, group=group, variant=variant, causal=causal, order=order,
            key_padding_mask=shard(padding, rank, world, dim=1, order=order),
            plan_block=PLAN_BLOCK, **params,
        )  # fmt: skip
        got = (stats.received_rows, stats.received_bytes, stats.pairs, stats.interior_rows)
        counted = (fetched, expected_bytes, expected_pairs, interior)
        if got != counted:
            failures.append(
                f"rank {rank}: {variant} causal={causal} {order}: (rows, bytes, pairs, interior "
                f"rows) {got}, counted from the dense mask {counted}"
            )
    counted = torch.tensor([some_heads])
    dist.all_reduce(counted, group=group)
    if not counted.item():
        failures.append(f"rank {rank}: no case fetched a row for some heads only")
    q, k, v, *_ = _inputs()
    text = zoo.explain(*[shard(t, rank, world) for t in (q, k, v)], variant="full", cp_group=group)
    if f"rank {rank} of {world}" not in text or "bytes" not in text:
        failures.append(f"rank {rank}: zoo.explain says: {text}")
    return failures


def _check_module(rank: int, world: int, group) -> list[str]:
    """zoo.MultiHeadAttention on shards (absolute encoding at global positions, valid_lens of
    the whole sequences, grouped heads): each rank's output and the all-reduced parameter
    gradients equal the one-process module's."""
    failures = []
    for order, variant, pos in (("contiguous", "sliding_window", "sinusoidal"),
                                ("head_tail", "bigbird", "rope")):  # fmt: skip
        torch.manual_seed(1)
        module = zoo.MultiHeadAttention(
            16, 4, num_kv_heads=2, variant=variant, pos=pos, causal=True, **small_params(variant)
        ).double()
        x = torch.randn(BATCH, LENGTH, 16, dtype=torch.float64)
        valid_lens = torch.tensor([LENGTH, LENGTH - 9])
        whole = module(x, valid_lens=valid_lens)
        whole.pow(2).sum().backward()
        expected = {name: p.grad.clone() for name, p in module.named_parameters()}
        module.zero_grad()
        zoo.parallel.use_context_parallel(module, group, order)
        out = module(shard(x, rank, world, dim=1, order=order), valid_lens=valid_lens)
        out.pow(2).sum().backward()
        errors = [_error(out, shard(whole.detach(), rank, world, dim=1, order=order))]
        for name, p in module.named_parameters():
            dist.all_reduce(p.grad, group=group)  # what DDP does after the backward
            errors.append(_error(p.grad, expected[name]))
        if max(errors) > TOLERANCE:
            failures.append(f"rank {rank}: module {variant} {order} {pos}: max error {max(errors)}")
    return failures


CHECKS = {
    "matches": _check_matches,
    "overlap": _check_overlap,
    "flex": _check_flex,
    "routed": _check_routed,
    "wide": _check_wide,
    "frozen": _check_frozen,
    "errors": _check_errors,
    "explain": _check_explain,
    "module": _check_module,
}


def _worker(rank: int, world: int, port: int, folder: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        found = {name: check(rank, world, dist.group.WORLD) for name, check in CHECKS.items()}
    finally:
        dist.destroy_process_group()
    with open(f"{folder}/rank{rank}.json", "w") as file:
        json.dump(found, file)
    # Leave without the interpreter's teardown: gloo's threads, torn down by C++ static
    # destructors at exit, once crashed a rank ("terminate called without an active
    # exception") after its results were written. The results are on disk; nothing is left to do.
    os._exit(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _outcome(world: int, folder) -> dict[str, list[str]]:
    """Every check's failures over the ranks of one group of ``world`` processes."""
    context = mp.start_processes(
        _worker, args=(world, _free_port(), str(folder)), nprocs=world, join=False,
        start_method="spawn",
    )  # fmt: skip
    deadline = time.monotonic() + subprocess_timeout(120)
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"the {world} ranks did not finish in time: a rank is left waiting")
    found: dict[str, list[str]] = {name: [] for name in CHECKS}
    for rank in range(world):
        for name, failures in json.loads((folder / f"rank{rank}.json").read_text()).items():
            found[name] += failures
    return found


@pytest.mark.parametrize("world", (2, 4), ids=("2 ranks", "4 ranks"))
def test_every_check_holds_on_every_rank(world, tmp_path):
    """One group of processes runs every check of CHECKS on each rank (a process start costs
    seconds): ``matches``, every fixed variant equals the one-process call forward and backward;
    ``overlap``, the interior rows run while the exchange is in flight; ``flex``, flex's forward
    equals it; ``wide``, wide rows computed where their keys are; ``frozen``, also where k and v
    record no gradient; ``errors``, bad calls raise on every rank before any exchange;
    ``explain``, its bytes and pairs equal counts from the dense mask; ``module``, the module on
    shards equals one process. One test per world size, not one per check: a module fixture
    shared by tests was set up again by each pytest-xdist worker that ran one of them."""
    found = _outcome(world, tmp_path)
    failed = [f"{name}: {failure}" for name, failures in found.items() for failure in failures]
    assert not failed, "\n".join(failed)


def test_cases_cover_every_backend_order_and_encoding_for_every_variant_kind():
    seen = cases()
    assert {c[0] for c in seen} == set(VARIANTS)
    for index, options in ((3, BACKENDS), (4, ORDERS), (5, ENCODINGS)):
        assert {c[index] for c in seen} == set(options)


@pytest.mark.parametrize("order", ORDERS)
def test_shard_and_unshard_are_inverse(order):
    x = torch.arange(2 * 24 * 3).reshape(2, 24, 3)
    shards = [shard(x, r, 3, dim=1, order=order) for r in range(3)]
    assert torch.equal(unshard(shards, dim=1, order=order), x)
    if order == "head_tail":  # rank 0 holds the first and the last sixth
        assert shards[0][0, :, 0].tolist() == [0, 3, 6, 9, 60, 63, 66, 69]


def _received_rows(variant: str, length: int, world: int, **params) -> list[int]:
    pattern = resolve_pattern(variant, False, params)
    pattern = specialized(pattern, length, length, torch.device("cpu"))
    plan = exchange_plan(pattern, ShardLayout(world, length // world, "contiguous"), 64,
                         torch.device("cpu"))  # fmt: skip
    return [r.received_rows for r in plan.ranks]


def test_a_window_fetches_a_halo_constant_in_the_length():
    """A window of 100 keys fetches two blocks of 64 from each neighbour, at any length."""
    for length in (1024, 4096):
        rows = _received_rows("local", length, 4, window_size=100)
        assert rows == [128, 256, 256, 128]


def test_full_fetches_what_a_ring_passes():
    assert _received_rows("full", 1024, 4) == [768] * 4


def test_a_call_without_a_process_group_says_how_to_start_one():
    q = torch.randn(1, 1, 8, 4)
    with pytest.raises(ValueError, match="init_process_group"):
        zoo.attention(q, q, q, variant="local", cp_group=object())


GPU_CASES = (  # (variant, causal, order): a halo, per-head random blocks, causal without
    # a mask (causal_lower_right), global rows shipped as wide rows, MoBA
    ("sliding_window", True, "contiguous"),
    ("bigbird", False, "contiguous"),
    ("causal", True, "head_tail"),
    ("longformer", False, "contiguous"),
    ("moba", True, "head_tail"),  # blocks chosen by content, on what auto picks on a GPU
)


def _gpu_worker(rank: int, world: int, port: int) -> None:
    """On GPU ``rank`` with NCCL, in float32: the output and dq, dk, dv of a few variants,
    overlapped and not, against the float64 reference on the CPU, within float32's error. The
    tensors are put on the GPU and the current device is left at GPU 0 (no set_device), as a
    script that forgets it would."""
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        q, k, v, padding, grad = _inputs()
        for i, (variant, causal, order) in enumerate(GPU_CASES):
            kwargs = dict(variant=variant, causal=causal, **small_params(variant))
            whole = [t.clone().requires_grad_() for t in (q, k, v)]
            reference = zoo.attention(*whole, backend="reference", key_padding_mask=padding,
                                      **kwargs)  # fmt: skip
            reference.backward(grad)
            device = torch.device("cuda", rank)
            mine = [shard(t, rank, world, order=order).float().to(device).requires_grad_()
                    for t in (q, k, v)]  # fmt: skip
            mask = shard(padding, rank, world, dim=1, order=order).to(device)
            out = zoo.parallel.context_parallel_attention(
                *mine, group=dist.group.WORLD, order=order, key_padding_mask=mask,
                plan_block=PLAN_BLOCK, overlap=bool(i % 2), **kwargs,
            )  # fmt: skip
            out.backward(shard(grad, rank, world, order=order).float().to(device))
            cpu = [t.detach().double().cpu() for t in mine]
            for t, a in zip(cpu, mine, strict=True):
                t.grad = None if a.grad is None else a.grad.double().cpu()
            errors = _shard_errors(out.double().cpu(), cpu, reference, whole, rank, world, order)
            assert max(errors) < 1e-4, f"rank {rank}: {variant} causal={causal}: {errors}"
    finally:
        dist.destroy_process_group()


@gpu
@pytest.mark.parametrize("world", [1, 2])
def test_nccl_on_gpus_matches_one_process(world):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA GPUs (NCCL), this machine has "
                    f"{torch.cuda.device_count()}")  # fmt: skip
    mp.start_processes(_gpu_worker, args=(world, _free_port()), nprocs=world,
                       start_method="spawn")  # fmt: skip


@pytest.mark.parametrize("order", ORDERS)
def test_every_call_of_a_causal_shard_runs_as_causal_attention(order):
    """Each call of a rank reads the run of keys from the first its rows read to the last: under
    ``causal`` every key up to its chunk's end, its queries the last of them. That is causal
    attention aligned to the last keys, which dense kernels run without a mask, for each chunk
    of a head-tail shard too (a sliding window stays a pattern)."""
    kinds = {}
    for variant, params in (("causal", {}), ("sliding_window", {"window_size": 100})):
        pattern = resolve_pattern(variant, True, params)
        pattern = specialized(pattern, 1024, 1024, torch.device("cpu"))
        plan = exchange_plan(pattern, ShardLayout(4, 256, order), 64, torch.device("cpu"))
        kinds[variant] = [
            rank_pattern(pattern, plan, rank, torch.device("cpu"), 1, i, overlap).kind
            for overlap in (True, False) for rank, mine in enumerate(plan.ranks)
            for i, _ in enumerate(mine.calls if overlap else mine.serial_calls)
        ]  # fmt: skip
    calls = 4 if order == "contiguous" else 8  # a call per chunk, with overlap or not
    assert len(kinds["causal"]) == 2 * calls
    assert set(kinds["causal"]) == {"causal"}, kinds["causal"]
    assert set(kinds["sliding_window"]) == {"sparse"}


def test_a_choice_by_content_is_not_kept_by_the_per_shape_caches():
    """A chunk's MoBA choice seen through a shard is made for one call: the per-shape caches
    keep no entry of it (every call would leave its choice there), as they keep a fixed
    pattern's wrapper."""
    cpu, positions = torch.device("cpu"), torch.arange(16)
    q = torch.randn(1, 2, 16, 8)
    bound = resolve_pattern("moba", False, dict(block_size=4, top_k=2)).bind(RouteInputs(q, q))
    local = specialized(resolve_pattern("local", False, dict(window_size=3)), 16, 16, cpu)
    shape_cache.clear_all()  # a cache at its bound evicts an entry for each it adds
    before = shape_cache.stats()["entries"]
    call_pattern(AtPositions(bound, positions, positions, 2, 1), False, {}, 16, 16, cpu)
    assert shape_cache.stats()["entries"] == before
    call_pattern(AtPositions(local, positions, positions), False, {}, 16, 16, cpu)
    assert shape_cache.stats()["entries"] > before


@pytest.mark.parametrize(
    ("shards", "order", "words"),
    [
        ([torch.zeros(1, 4, 2), torch.zeros(1, 6, 2)], "contiguous", "lengths [4, 6]"),
        ([torch.zeros(1, 3, 2)] * 2, "head_tail", "odd"),
        ([torch.zeros(1, 4, 2)] * 2, "headtail", "order must be one of"),
        ([], "contiguous", "lengths []"),
    ],
    ids=("unequal", "odd head_tail", "misspelt order", "none"),
)
def test_unshard_refuses_shards_it_cannot_join(shards, order, words):
    """Joined anyway, unequal shards lost rows (4 + 6 came back as 8), an odd head-tail shard
    came back with rows dropped and out of order, and a misspelt order joined contiguously."""
    with pytest.raises(ValueError, match=re.escape(words)):
        unshard(shards, dim=1, order=order)


@pytest.mark.parametrize(
    ("rank", "world", "order", "words"),
    [
        (0, 2, "headtail", "order must be one of ('contiguous', 'head_tail'), got 'headtail'"),
        (2, 2, "contiguous", "rank 2 is not one of the 2 ranks"),
        (-1, 2, "contiguous", "rank -1 is not one of the 2 ranks"),
        (0, 0, "contiguous", "rank 0 is not one of the 0 ranks"),
    ],
    ids=("misspelt order", "rank past the last", "negative rank", "no ranks"),
)
def test_shard_names_a_bad_order_or_rank(rank, world, order, words):
    """A misspelt order was told to pad its length to a multiple of the world size; a rank out
    of range raised IndexError ('index out of range in self'), and no ranks ZeroDivisionError."""
    with pytest.raises(ValueError, match=re.escape(words)):
        shard(torch.zeros(1, 8, 2), rank, world, dim=1, order=order)
