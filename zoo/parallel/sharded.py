"""The sharded call: ``zoo.attention(q, k, v, ..., cp_group=group)`` on one rank's shard.

Each rank holds an equal shard of one sequence (``zoo.parallel.shards``: contiguous, or head-tail
for causal load balance). The call

1. checks its arguments and then agrees with every rank of the group in one small collective
   (``all_gather_object``), so that a bad argument on any rank (shards of unequal lengths,
   another variant, a pattern that cannot be sharded) raises the same error on every rank before
   any exchange starts, and no rank is left waiting;
2. resolves the pattern at the GLOBAL length (random blocks and global tokens of the whole
   sequence, the same on every rank) and its exchange plan (``zoo.parallel.exchange_plan``);
3. turns q and k by their global positions (rope), zeroes padded keys, and posts the exchange
   of the key/value rows the plan names (``zoo.parallel.exchange``, differentiable);
4. runs the plan's calls (``exchange_plan.CallPlan``: per chunk it holds, its interior rows,
   whose query blocks read only its own keys, and its edge rows): the interior calls while the
   exchange is in flight, against its own keys; the edge calls once the keys have arrived. Each
   reads the run of keys from the first its rows read to the last, through ``AtPositions``
   (``zoo.parallel.at_positions``), which maps the call's indices to global positions for the
   pattern and the score bias (alibi, t5), and tells dense kernels where a call is plain
   causal attention (a chunk against every key up to its end);
5. where the plan ships wide query rows (a global token's row, which reads every key), leaves
   them out of those calls: they are computed as partials where their keys are and merged by
   log-sum-exp (``zoo.parallel.wide``), so no rank fetches every shard.

Every key a narrow query reads is in its row's call, so its softmax is already the whole row's;
only the wide rows merge partials (the house's one merge, ``zoo.backends.lse_merge``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..backends import Backend, resolve_backend
from ..core.arguments import check_bool, check_int
from ..core.call import check_key_padding_mask, check_qkv, unread_padding
from ..core.device_build import has_no_data, on_host
from ..core.narrowed import narrowed
from ..core.prepare import Encoding, attention_encoding, prepare_call
from ..core.resolve import call_pattern, concrete_params
from ..core.scores import AdditiveScore
from ..core.shape_cache import per_shape
from ..mechanisms.dispatch import is_mechanism
from ..patterns import Pattern, reads_graph
from .at_positions import AtPositions, at_global
from .exchange import finish_keys, gather_padding, in_order, start_keys, tie
from .exchange_plan import (
    PLAN_BLOCK,
    CallPlan,
    ExchangePlan,
    RankPlan,
    exchange_plan,
    pairs_per_rank,
)
from .routed_plan import bind_chunks, routed_plan, unshardable_reason
from .shards import ShardLayout, check_order
from .wide import wide_attention


@dataclass(frozen=True)
class ShardStats:
    """What one rank of a sharded call receives and computes."""

    rank: int
    world: int
    received_rows: int  # key/value rows fetched from other ranks (per sequence and head)
    # Bytes received, the whole batch: keys, values (and key padding) fetched, other ranks' wide
    # query rows to compute partials of, and the partials of its own wide rows.
    received_bytes: int
    sources: tuple[int, ...]  # the ranks it fetches keys from
    wide_rows: int  # query rows it ships to be computed where their keys are
    ship_to: tuple[int, ...]  # the ranks it ships them to
    interior_rows: int  # query rows it computes while the exchange is in flight, with overlap
    pairs: float  # (query, key) pairs its queries may attend, per head and sequence
    # Chosen by content: the figures are bounds (every other shard), the call knows its own.
    routed: bool = False


def on_q_device(function: Callable) -> Callable:
    """Run ``function(q, ...)`` with q's GPU as the current CUDA device: NCCL stages
    ``all_gather_object`` on the current device and ``batch_isend_irecv`` hangs where it is not
    the tensors' one, and a training script that put its tensors on ``cuda:LOCAL_RANK`` without
    ``torch.cuda.set_device`` would otherwise have every rank's agreement on GPU 0. (Autograd
    runs a GPU's backward on a thread whose current device is that GPU already.)"""

    @functools.wraps(function)
    def on_device(q, *args, **kwargs):
        if not (isinstance(q, Tensor) and q.is_cuda) or has_no_data(q):  # fake: no device
            return function(q, *args, **kwargs)
        with torch.cuda.device(q.device):
            return function(q, *args, **kwargs)

    return on_device


# An error a caller found on this rank before the call (``sharded_forward``: a learned table too
# short for the rank's positions, lengths out of range): the call's agreement raises it on every
# rank, where raising it at once would leave the others waiting in theirs.
_FOUND_BEFORE: ContextVar[Exception | None] = ContextVar("zoo_cp_found_before", default=None)


@contextmanager
def raised_by_the_call(problem: Exception | None) -> Iterator[None]:
    """Within it, a sharded call raises ``problem`` (if any) on every rank of its group."""
    token = _FOUND_BEFORE.set(problem)
    try:
        yield
    finally:
        _FOUND_BEFORE.reset(token)


@on_q_device
def context_parallel_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    group: dist.ProcessGroup,
    variant: str | Pattern,
    backend: str | Backend = "auto",
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    scale: float | None = None,
    score: AdditiveScore | None = None,
    pos: Encoding = None,
    order: str = "contiguous",
    plan_block: int = PLAN_BLOCK,
    overlap: bool | None = None,
    **params: object,
) -> Tensor:
    """This rank's shard of ``zoo.attention`` on the whole sequence (see the module docstring);
    q, k, v (B, H, s, D) and key_padding_mask (B, s) are this rank's shard. ``plan_block``: the
    positions per block of the exchange (smaller fetches fewer rows around a window's edge).
    ``overlap``: compute the rows that read no fetched key while the exchange is in flight, in
    calls of their own (True), or wait for the exchange and run a call per chunk (False); the
    same result. None (default): on a GPU, where NCCL moves the messages on a stream of its own;
    on a CPU a split measured no gain and costs a copy of the queries and the output."""
    check_group(group, q)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    problem, setup = _FOUND_BEFORE.get(), None
    try:
        # Checked here, so that every rank raises it: a plan_block below 1 was read as 1, and
        # 8.0 failed deep inside the plan (an IndexError, or one of repeat_interleave's).
        check_int("plan_block", plan_block)
        if overlap is not None:
            check_bool("overlap", overlap)
        setup = _setup(q, k, v, variant, causal, key_padding_mask, pos, order, params, world)
    except Exception as error:  # any error: raised on one rank alone, the others would wait
        problem = error if problem is None else problem
    fingerprint = _fingerprint(q, k, v, key_padding_mask, variant, causal, pos, order, params,
                               score)  # fmt: skip
    # dropout decides whether wide rows ship (ranks that differed took mismatched exchanges,
    # and gloo aborted every process); a scale that differed left the ranks' rows inconsistent
    options = (
        ("plan_block", plan_block), ("backend", str(backend)), ("dropout_p", repr(dropout_p)),
        ("scale", repr(scale)),
    )  # fmt: skip
    _agree(group, fingerprint + options, problem)
    pattern, encoding, padding = setup
    layout = ShardLayout(world, q.shape[2], order)
    heads = q.shape[1]
    overlap = q.is_cuda if overlap is None else overlap
    if encoding is not None and encoding.kind == "rotate":
        positions = layout.positions(rank).to(q.device)
        q, k = encoding.rotate(q, k, positions, positions)
    if padding is not None:
        k, v = unread_padding(k, padding), unread_padding(v, padding)
    if pattern.routed:  # chosen by content: the choice, then a plan of this call's own
        bound = bind_chunks(pattern, q, k, padding, causal, layout, rank, group)
        mine, sends = routed_plan(bound, layout, rank, plan_block, q.device, group)
        plan, pairs = None, ({}, {})
    else:
        ratio = ship_ratio(q, k, v) if dropout_p == 0 else None  # a partial has no dropout
        plan = exchange_plan(pattern, layout, plan_block, q.device, ratio)
        mine, sends, pairs = plan.ranks[rank], plan.sends(rank), head_pairs(plan, rank, k.shape[1])
    padding_all = None
    if padding is not None:
        padding_all = gather_padding(padding, sends, mine.fetch, mine.pieces, group)
    started, exchange = start_keys(k, v, sends, mine.fetch, group, *pairs)
    common = (variant, backend, causal, dropout_p, scale, score, encoding)

    def run(index: int, call: CallPlan, fetched: list[dict] | None) -> tuple[Tensor, Tensor]:
        """The call's rows against its run of keys: its own (interior), or of the keys it
        attends, own and ``fetched`` in position order (views of k and v where the run is
        all its own: their gradients then need no copy)."""
        if plan is None:  # routed: its chunk's choice, at the call's positions
            with on_host():
                chunk = int(mine.q_positions[call.rows[0]]) // layout.chunk
            wrapper = at_call(bound[chunk], mine, call, q.device, heads, q.shape[0])
        else:
            wrapper = rank_pattern(pattern, plan, rank, q.device, heads, index, overlap)
        held = call.first, call.stop - call.first
        if call.interior:
            k_run, v_run, held_padding = narrowed(k, 2, *held), narrowed(v, 2, *held), padding
        else:
            k_fetched, v_fetched = fetched
            run_of = (mine.pieces, call.first, call.stop)
            k_run, v_run = in_order(k, k_fetched, *run_of), in_order(v, v_fetched, *run_of)
            held_padding = padding_all
        held_padding = None if held_padding is None else narrowed(held_padding, 1, *held)
        out = _one_call(_take(q, call.rows), k_run, v_run, held_padding, wrapper, *common)
        return call.rows, out

    parts, waiting = [], []  # (rows of the shard, their output); calls that wait for the keys
    for index, call in enumerate(mine.calls if overlap else mine.serial_calls):
        if call.interior:  # while the exchange is in flight
            parts.append(run(index, call, None))
        else:
            waiting.append((index, call))
    *fetched, token = finish_keys(started, k, v, exchange)
    parts += [run(index, call, fetched) for index, call in waiting]
    if plan is not None and plan.ships:
        bias = encoding.bias if encoding is not None and encoding.kind == "bias" else None
        token = tie(token, _differentiable(q, k, v, score, encoding))
        wide_out, token = wide_attention(
            q, k, v, padding, pattern=pattern, plan=plan, rank=rank, after=token, group=group,
            scale=scale, score=score, bias=bias,
        )  # fmt: skip
        if wide_out is not None:
            parts.append((mine.wide_rows, wide_out))
    return _in_rows(parts) + token.to(q.dtype)


def _take(x: Tensor, rows: Tensor) -> Tensor:
    """x's rows (dim 2) named by ``rows`` (sorted, on the CPU): a view where they are one run."""
    with on_host():
        first, count, last = int(rows[0]), rows.numel(), int(rows[-1])
    if last - first + 1 == count:
        return narrowed(x, 2, first, count)
    return x.index_select(2, rows.to(x.device))


def _in_rows(parts: list[tuple[Tensor, Tensor]]) -> Tensor:
    """(B, H, s, Dv): the parts' outputs (B, H, rows, Dv), which together hold every row of the
    shard once (rows sorted, on the CPU), joined in row order by one ``cat`` of their runs of
    consecutive rows (a view where one part holds every row)."""
    runs = []  # (first row, the part's output for its run)
    for rows, part in parts:
        with on_host():
            breaks = (torch.nonzero(rows.diff() != 1).flatten() + 1).tolist()
            firsts = [int(rows[start]) for start in [0, *breaks]]
        for first, start, stop in zip(firsts, [0, *breaks], [*breaks, rows.numel()], strict=True):
            runs.append((first, narrowed(part, 2, start, stop - start)))
    runs.sort(key=lambda run: run[0])
    return runs[0][1] if len(runs) == 1 else torch.cat([run for _, run in runs], dim=2)


def ship_ratio(q: Tensor, k: Tensor, v: Tensor) -> float:
    """What shipping one query row costs in key/value rows fetched: the row, and its partial
    output and log-sum-exp back (float32, float64 for float64), over a key row and a value row."""
    partial_bytes = 8 if q.dtype == torch.float64 else 4
    shipped = q.shape[1] * (q.shape[3] * q.element_size() + (v.shape[3] + 1) * partial_bytes)
    return shipped / (k.shape[1] * (k.shape[3] + v.shape[3]) * k.element_size())


def _one_call(q, k, v, padding, wrapper, variant, backend, causal, dropout_p, scale, score,
              encoding) -> Tensor:  # fmt: skip
    """One ordinary call of queries q against the keys k, v through ``wrapper``."""
    call = prepare_call(
        q, k, v, variant=wrapper, key_padding_mask=padding, dropout_p=dropout_p, scale=scale,
        score=score,
    )  # fmt: skip
    call = replace(call, variant=_name(variant), causal=causal)
    if encoding is not None and encoding.kind == "bias":
        call = replace(call, bias=at_global(encoding.bias, wrapper), learned=tuple(
            encoding.parameters()))  # fmt: skip
    out, _ = resolve_backend(backend, call).forward(call)
    return out


def check_group(group: object, q: object) -> None:
    """Raise, on every rank alike, where ``group`` cannot carry this call's tensors: no process
    group, or a backend that does not run on q's device. Checked before any collective."""
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(
            "cp_group: torch.distributed is not initialised; call "
            "torch.distributed.init_process_group (torchrun sets its environment) first"
        )
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"cp_group must be a torch.distributed ProcessGroup (torch.distributed.group.WORLD, "
            f"or one from new_group), got {type(group).__name__}"
        )
    name = str(dist.get_backend(group))
    if not isinstance(q, Tensor):  # check_qkv says so, on every rank (the agreement)
        return
    if name == "nccl" and q.device.type != "cuda":
        raise ValueError(
            f"cp_group: its backend is nccl, which exchanges CUDA tensors, but q is on "
            f"{q.device}; move q, k, v to the rank's GPU, or use a gloo group for CPU tensors"
        )
    if name == "gloo" and q.device.type != "cpu":
        raise ValueError(
            f"cp_group: its backend is gloo, whose point-to-point calls take CPU tensors, but q "
            f"is on {q.device}; use an nccl group for GPU tensors"
        )


def _setup(q, k, v, variant, causal, key_padding_mask, pos, order, params, world):
    """(global pattern, encoding, key padding) after the checks that need no other rank."""
    check_qkv(q, k, v)
    if q.shape[2] != k.shape[2]:
        raise ValueError(
            f"q has {q.shape[2]} rows and k, v have {k.shape[2]}: with cp_group, q, k and v are "
            "this rank's shard of one sequence (self-attention), of one length"
        )
    reason = check_order(order, q.shape[2])
    if reason is not None:
        raise ValueError(reason)
    if is_mechanism(variant):
        raise ValueError(
            f"variant {variant!r} is a mechanism (zoo/mechanisms), which computes attention "
            "without a pattern of pairs, so there are no key blocks to exchange; context "
            "parallelism runs the masked-softmax variants (zoo.list_variants())"
        )
    length = q.shape[2] * world
    pattern = call_pattern(
        variant, causal, concrete_params(params), length, length, q.device, heads=q.shape[1]
    )
    if reads_graph(pattern):
        raise ValueError(
            f"variant {variant!r} reads a graph given with each call, which context parallelism "
            "does not shard (its edges cross shards as the data says); use a fixed-pattern or "
            "routed variant, or run it without cp_group"
        )
    reason = unshardable_reason(pattern) if pattern.routed else None
    if pattern.routed and has_no_data(q):
        raise ValueError(
            f"variant {variant!r} chooses its blocks by content: sharded, each call plans its "
            "exchange from the chosen blocks, which fake or meta tensors (torch.export, a CUDA "
            "path checked on a CPU) do not have; trace it without cp_group, or with real tensors"
        )
    if reason is not None:
        raise ValueError(
            f"variant {variant!r} chooses its blocks by content and cannot run sharded: {reason}; "
            "use moba (or a composition of it) or a fixed-pattern variant, or run it without "
            "cp_group"
        )
    padding = check_key_padding_mask(key_padding_mask, q.shape[0], k.shape[2], q.device)
    encoding = attention_encoding(pos, q, k, causal)
    if encoding is not None:
        encoding.check(q_len=length, kv_len=length, head_dim=q.shape[-1])
    return pattern, encoding, padding


def _differentiable(q, k, v, score, pos) -> tuple[Tensor, ...]:
    """The call's tensors that may record gradients: q, k, v, the score's and encoding's
    parameters (an additive score's weights, T5's table)."""
    modules = [m for m in (score, pos) if isinstance(m, nn.Module)]
    tensors = (q, k, v, *(p for m in modules for p in m.parameters()))
    return tuple(t for t in tensors if isinstance(t, Tensor))


def _fingerprint(q, k, v, padding, variant, causal, pos, order, params, score) -> tuple:
    """What every rank must agree on, by field: a rank that differs is named with the field."""
    recording = torch.is_grad_enabled() and any(
        t.requires_grad for t in _differentiable(q, k, v, score, pos)
    )
    return (
        ("q shape", _shape(q)), ("k shape", _shape(k)), ("v shape", _shape(v)),
        ("dtype", str(getattr(q, "dtype", None))),
        ("key_padding_mask shape", None if padding is None else _shape(padding)),
        ("variant", _name(variant)), ("causal", causal), ("cp_order", order),
        ("parameters", repr(sorted(params.items()))),
        ("pos", pos if pos is None or isinstance(pos, str) else type(pos).__name__),
        ("records gradients", recording),
    )  # fmt: skip


def _shape(x: object) -> tuple[int, ...] | str:
    """A tensor's shape, or the type of what is not one: _setup has then found the problem,
    which the agreement must still reach on every rank, not an AttributeError here on one."""
    return tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__


def _agree(group, fingerprint: tuple, problem: Exception | None) -> None:
    """One collective that every rank takes: raise the same error on every rank if any rank
    found a problem, or the ranks disagree on shapes or arguments."""
    mine = (fingerprint, None if problem is None else f"{type(problem).__name__}: {problem}")
    every: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    for index, (name, _) in enumerate(fingerprint):
        values = [theirs[0][index][1] for theirs in every]
        if any(value != values[0] for value in values):
            listed = ", ".join(f"rank {r}: {value}" for r, value in enumerate(values))
            hint = (
                "; every rank must hold an equal shard of the sequence: pad it to a multiple of "
                "the group's size and mark the padding in key_padding_mask"
                if "shape" in name
                else "; every rank must make the same call on its own shard"
            )
            raise ValueError(f"cp_group: the ranks differ in {name} ({listed}){hint}")
    failed = [(r, message) for r, (_, message) in enumerate(every) if message is not None]
    if problem is not None:
        raise problem
    if failed:
        r, message = failed[0]
        raise ValueError(f"cp_group: rank {r} of the group cannot make this call: {message}")


def _name(variant: object) -> str:
    return variant if isinstance(variant, str) else type(variant).__name__


@per_shape(maxsize=256)
def rank_pattern(
    pattern: Pattern, plan: ExchangePlan, rank: int, device: torch.device, heads: int, call: int,
    overlap: bool = True,
) -> AtPositions:  # fmt: skip
    """The ``AtPositions`` of the rank's call number ``call`` (of its calls with ``overlap``, or
    of its serial ones) on ``device``, once per plan: backends cache their masks and plans by
    the pattern's identity, so every later call of the rank finds them again."""
    mine = plan.ranks[rank]
    planned = (mine.calls if overlap else mine.serial_calls)[call]
    return at_call(pattern, mine, planned, device, heads if pattern.per_head else None)


def at_call(
    pattern: Pattern, mine: RankPlan, call: CallPlan, device: torch.device, heads: int | None,
    batch: int | None = None,
) -> AtPositions:  # fmt: skip
    """``pattern`` seen through ``call``'s rows and its run of keys (own keys for an interior
    call, else the keys the rank attends)."""
    held = mine.q_positions if call.interior else mine.kv_positions
    q_positions, kv_positions = mine.q_positions[call.rows], held[call.first : call.stop]
    wrapper = AtPositions(pattern, q_positions.to(device), kv_positions.to(device), heads, batch)
    # Its kind read from the plan's CPU positions, not the device's: no host sync, and it holds
    # where the device's tensors have no values (fake CUDA on a CPU).
    wrapper.__dict__["kind"] = AtPositions(pattern, q_positions, kv_positions).kind
    return wrapper


@per_shape(maxsize=256)
def head_pairs(plan: ExchangePlan, rank: int, kv_heads: int) -> tuple[dict, dict]:
    """(peer -> the (key/value head, row) pairs ``rank`` sends it, peer -> those it fetches
    from it), for the peers that need only some heads of some rows (a pattern drawn per head,
    BigBird's random blocks); the others send every head of their rows."""

    def pairs(readers: Tensor):
        if readers.shape[0] == 1:  # the same pattern for every head
            return None
        per_kv_head = readers.unflatten(0, (kv_heads, -1)).any(dim=1)  # a group's any head
        return None if bool(per_kv_head.all()) else torch.nonzero(per_kv_head, as_tuple=True)

    mine = plan.ranks[rank]
    sends = {peer.rank: pairs(peer.fetch_heads[rank]) for peer in plan.ranks
             if rank in peer.fetch}  # fmt: skip
    fetch = {owner: pairs(readers) for owner, readers in mine.fetch_heads.items()}
    return ({p: v for p, v in sends.items() if v is not None},
            {p: v for p, v in fetch.items() if v is not None})  # fmt: skip


def shard_stats(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    group: dist.ProcessGroup,
    variant: str | Pattern,
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
    pos: Encoding = None,
    order: str = "contiguous",
    plan_block: int = PLAN_BLOCK,
    dropout_p: float = 0.0,
    **params: object,
) -> ShardStats:
    """What this rank receives and computes in ``context_parallel_attention`` with the same
    arguments, from the plan alone: no collective, no data moved."""
    check_group(group, q)
    check_int("plan_block", plan_block)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    pattern, _, padding = _setup(q, k, v, variant, causal, key_padding_mask, pos, order, params,
                                 world)  # fmt: skip
    layout = ShardLayout(world, q.shape[2], order)
    if pattern.routed:  # chosen by content: the plan exists in the call only; at most
        others = (world - 1) * q.shape[2]  # every other shard, every pair
        row_bytes = k.shape[1] * (k.shape[-1] + v.shape[-1]) * k.element_size()
        return ShardStats(
            rank, world, others, q.shape[0] * others * (row_bytes + int(padding is not None)),
            tuple(r for r in range(world) if r != rank), 0, (), 0,
            float(q.shape[2] * layout.length), routed=True,
        )  # fmt: skip
    ratio = ship_ratio(q, k, v) if dropout_p == 0 else None
    plan = exchange_plan(pattern, layout, plan_block, q.device, ratio)
    mine = plan.ranks[rank]
    return ShardStats(
        rank, world, mine.received_rows, received_bytes(plan, rank, q, k, v, padding is not None),
        tuple(mine.fetch), mine.wide_rows.numel(), mine.ship_to, mine.interior_rows,
        pairs_per_rank(pattern, layout, rank, plan.block, q.device),
    )  # fmt: skip


def received_bytes(
    plan: ExchangePlan, rank: int, q: Tensor, k: Tensor, v: Tensor, padded: bool
) -> int:
    """Bytes ``rank`` receives in a call on shards shaped as q, k, v (the whole batch): the key
    and value rows it fetches, of the heads that read them (and their padding, one byte a row),
    the wide query rows shipped to it, and the partials of its own wide rows (float32, float64
    for float64)."""
    mine = plan.ranks[rank]
    fetched = head_pairs(plan, rank, k.shape[1])[1]
    key_bytes = (k.shape[-1] + v.shape[-1]) * k.element_size()
    head_rows = sum(fetched[p][0].numel() if p in fetched else k.shape[1] * rows.numel()
                    for p, rows in mine.fetch.items())  # fmt: skip
    query_bytes = q.shape[1] * q.shape[-1] * q.element_size()
    partial_bytes = q.shape[1] * (v.shape[-1] + 1) * (8 if q.dtype == torch.float64 else 4)
    shipped_in = sum(plan.shippers(rank).values())  # others' wide rows it computes partials of
    partials_in = mine.wide_rows.numel() * len(mine.ship_to)
    received = head_rows * key_bytes + mine.received_rows * int(padded)
    received += shipped_in * query_bytes
    return q.shape[0] * (received + partials_in * partial_bytes)
