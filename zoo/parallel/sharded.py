"""The sharded call: ``zoo.attention(q, k, v, ..., cp_group=group)`` on one rank's shard.

Each rank holds an equal shard of one sequence (``zoo.parallel.shards``: contiguous, or head-tail
for causal load balance). The call

1. checks its arguments and then agrees with every rank of the group in one small collective
   (``all_gather_object``), so that a bad argument on any rank (shards of unequal lengths,
   another variant, a pattern that cannot be sharded) raises the same error on every rank before
   any exchange starts, and no rank is left waiting;
2. resolves the pattern at the GLOBAL length (random blocks and global tokens of the whole
   sequence, the same on every rank) and its exchange plan (``zoo.parallel.exchange_plan``);
3. turns q and k by their global positions (rope), zeroes padded keys, and fetches the key/value
   rows the plan names (``zoo.parallel.exchange``, differentiable);
4. runs ONE ordinary call of its queries against the keys it holds and fetched, through
   ``AtPositions`` (``zoo.parallel.at_positions``), which maps the call's indices to global
   positions for the pattern and the score bias (alibi, t5);
5. where the plan ships wide query rows (a global token's row, which reads every key), leaves
   them out of that call: they are computed as partials where their keys are and merged by
   log-sum-exp (``zoo.parallel.wide``), so no rank fetches every shard.

Every key a narrow query reads is in the one call, so its softmax is already the whole row's;
only the wide rows merge partials (the house's one merge, ``zoo.backends.lse_merge``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import Tensor

from ..backends import Backend, resolve_backend
from ..core.call import check_key_padding_mask, check_qkv, unread_padding
from ..core.prepare import Encoding, attention_encoding, prepare_call
from ..core.resolve import call_pattern, concrete_params
from ..core.scores import AdditiveScore
from ..core.shape_cache import per_shape
from ..mechanisms.dispatch import is_mechanism
from ..patterns import Pattern, reads_graph
from .at_positions import AtPositions, at_global
from .exchange import gather_keys, gather_padding
from .exchange_plan import PLAN_BLOCK, ExchangePlan, exchange_plan, pairs_per_rank
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
    pairs: float  # (query, key) pairs its queries may attend, per head and sequence


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
    **params: object,
) -> Tensor:
    """This rank's shard of ``zoo.attention`` on the whole sequence (see the module docstring);
    q, k, v (B, H, s, D) and key_padding_mask (B, s) are this rank's shard. ``plan_block``: the
    positions per block of the exchange (smaller fetches fewer rows around a window's edge)."""
    check_group(group, q)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    problem, setup = None, None
    try:
        setup = _setup(q, k, v, variant, causal, key_padding_mask, pos, order, params, world)
    except (TypeError, ValueError) as error:
        problem = error
    fingerprint = _fingerprint(q, k, v, key_padding_mask, variant, causal, pos, order, params)
    options = (("plan_block", plan_block), ("backend", str(backend)))
    _agree(group, fingerprint + options, problem)
    pattern, encoding, padding = setup
    layout = ShardLayout(world, q.shape[2], order)
    ratio = ship_ratio(q, k, v) if dropout_p == 0 else None  # a partial has no dropout
    plan = exchange_plan(pattern, layout, plan_block, q.device, ratio)
    mine = plan.ranks[rank]
    sends = plan.sends(rank)
    wrapper = rank_pattern(pattern, plan, rank, q.device, q.shape[1])
    if encoding is not None and encoding.kind == "rotate":
        positions = mine.q_positions.to(q.device)
        q, k = encoding.rotate(q, k, positions, positions)
    if padding is not None:
        k, v = unread_padding(k, padding), unread_padding(v, padding)
    own = torch.cat([k, v], dim=-1)  # one message per peer for both
    keys = gather_keys(own, sends, mine.fetch, mine.pieces, group)
    k_all, v_all = keys.split([k.shape[-1], v.shape[-1]], dim=-1)
    padding_all = None
    if padding is not None:
        padding_all = gather_padding(padding, sends, mine.fetch, mine.pieces, group)
    rest = (k_all, v_all, padding_all, wrapper, variant, backend, causal, dropout_p, scale, score,
            encoding)  # fmt: skip
    if not plan.ships:
        return _one_call(q, *rest)
    bias = encoding.bias if encoding is not None and encoding.kind == "bias" else None
    wide_out, token = wide_attention(
        q, k, v, padding, pattern=pattern, plan=plan, rank=rank, after=keys, group=group,
        scale=scale, score=score, bias=bias,
    )  # fmt: skip
    narrow = mine.narrow_rows.to(q.device)
    out = q.new_zeros(*q.shape[:3], v.shape[-1])  # (B, H, s, Dv)
    if narrow.numel():  # a shard of wide rows only runs no call
        out = out.index_copy(2, narrow, _one_call(q.index_select(2, narrow), *rest))
    if wide_out is not None:
        out = out.index_copy(2, mine.wide_rows.to(q.device), wide_out)
    return out + token.to(out.dtype)  # the token ties every exchange's backward to the output


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
    if pattern.routed or reads_graph(pattern):
        what = "a graph given with each call" if reads_graph(pattern) else "its blocks by content"
        raise ValueError(
            f"variant {variant!r} chooses {what}, which context parallelism does not shard yet "
            "(its plan would depend on every rank's data); use a fixed-pattern variant, or run "
            "it without cp_group"
        )
    padding = check_key_padding_mask(key_padding_mask, q.shape[0], k.shape[2], q.device)
    encoding = attention_encoding(pos, q, k, causal)
    if encoding is not None:
        encoding.check(q_len=length, kv_len=length, head_dim=q.shape[-1])
    return pattern, encoding, padding


def _fingerprint(q, k, v, padding, variant, causal, pos, order, params) -> tuple:
    """What every rank must agree on, by field: a rank that differs is named with the field."""
    return (
        ("q shape", tuple(q.shape)), ("k shape", tuple(k.shape)), ("v shape", tuple(v.shape)),
        ("dtype", str(q.dtype)),
        ("key_padding_mask shape", None if padding is None else tuple(padding.shape)),
        ("variant", _name(variant)), ("causal", causal), ("cp_order", order),
        ("parameters", repr(sorted(params.items()))),
        ("pos", pos if pos is None or isinstance(pos, str) else type(pos).__name__),
    )  # fmt: skip


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
    pattern: Pattern, plan: ExchangePlan, rank: int, device: torch.device, heads: int
) -> AtPositions:
    """The rank's ``AtPositions`` on ``device``, once per plan: backends cache their masks and
    plans by the pattern's identity, so every later call of the rank finds them again."""
    mine = plan.ranks[rank]
    return AtPositions(
        pattern, mine.q_positions[mine.narrow_rows].to(device), mine.kv_positions.to(device),
        heads if pattern.per_head else None,
    )  # fmt: skip


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
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    pattern, _, padding = _setup(q, k, v, variant, causal, key_padding_mask, pos, order, params,
                                 world)  # fmt: skip
    layout = ShardLayout(world, q.shape[2], order)
    ratio = ship_ratio(q, k, v) if dropout_p == 0 else None
    plan = exchange_plan(pattern, layout, plan_block, q.device, ratio)
    mine = plan.ranks[rank]
    return ShardStats(
        rank, world, mine.received_rows, received_bytes(plan, rank, q, k, v, padding is not None),
        tuple(mine.fetch), mine.wide_rows.numel(), mine.ship_to,
        pairs_per_rank(pattern, layout, rank, plan.block, q.device),
    )  # fmt: skip


def received_bytes(
    plan: ExchangePlan, rank: int, q: Tensor, k: Tensor, v: Tensor, padded: bool
) -> int:
    """Bytes ``rank`` receives in a call on shards shaped as q, k, v (the whole batch): the key
    and value rows it fetches (and their padding, one byte a row), the wide query rows shipped
    to it, and the partials of its own wide rows (float32, float64 for float64)."""
    mine = plan.ranks[rank]
    row_bytes = k.shape[1] * (k.shape[-1] + v.shape[-1]) * k.element_size() + int(padded)
    query_bytes = q.shape[1] * q.shape[-1] * q.element_size()
    partial_bytes = q.shape[1] * (v.shape[-1] + 1) * (8 if q.dtype == torch.float64 else 4)
    shipped_in = sum(plan.shippers(rank).values())  # others' wide rows it computes partials of
    partials_in = mine.wide_rows.numel() * len(mine.ship_to)
    received = mine.received_rows * row_bytes + shipped_in * query_bytes
    return q.shape[0] * (received + partials_in * partial_bytes)
