"""``zoo.check_pattern`` for a pattern chosen by content: its views on one bound input agree.

A routed pattern (``zoo.patterns.routed``) has no fixed views; bound to a call's q and k it has
per (sequence, head) ones, and backends trust them as they trust a fixed pattern's: ``blocked``
and ``flex`` skip the blocks that ``block_state`` calls EMPTY, ``blocked`` drops the mask on the
(query, key block) pairs it calls FULL. So the check binds the pattern to seeded random inputs
(2 sequences, 2 query heads over 1 key/value head, the second sequence's last third of keys
padded, and one example graph per sequence, ``example_graph``, for a pattern that reads the
call's ``edge_index`` such as ``graph``), under causal rules and not, and holds, per sequence and
head:

- ``dense`` equal to ``allowed_at`` on the grid;
- ``parts()`` disjoint, their union the pattern;
- ``block_state`` conservative in the natural order and each part's own, at every block size,
  one query per block included (the ``blocked`` backend's per-query layout): FULL only where
  every pair is allowed and no slot is padding, EMPTY only where none is allowed.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..layout.frames import build_frame
from ..patterns.base import EMPTY, FULL, Pattern, query_positions
from ..patterns.full import Causal
from ..patterns.routed import RouteInputs

CPU = torch.device("cpu")
B, H, KV_HEADS, DIM = 2, 2, 1, 8


def example_graph(nodes: int, clique: int = 24) -> Tensor:
    """(2, E) int64: a small example graph for a call that needs one (``variant="graph"``), with
    blocks of every state: a ring (each node and its two neighbours, both ways), one-way chords
    from each even node to the node a third of the way round, and a clique among the first
    ``clique`` nodes (blocks where every pair is an edge)."""
    node = torch.arange(nodes)
    ring = torch.stack([node, (node + 1) % nodes])
    even = node[::2]
    chords = torch.stack([even, (even + max(1, nodes // 3)) % nodes])
    first = torch.arange(min(clique, nodes))
    dense = torch.cartesian_prod(first, first).t()
    return torch.cat([ring, ring.flip(0), chords, dense], dim=1)


def bound_inputs(q_len: int, kv_len: int) -> RouteInputs:
    """Seeded q (B, H, q_len, DIM), k (B, KV_HEADS, kv_len, DIM), key padding, and a graph per
    sequence over the kv_len nodes (``example_graph``; the second sequence's nodes numbered
    backwards), read by the patterns that take the call's graph and ignored by the others."""
    generator = torch.Generator().manual_seed(q_len * 7919 + kv_len)
    q = torch.randn(B, H, q_len, DIM, generator=generator)
    k = torch.randn(B, KV_HEADS, kv_len, DIM, generator=generator)
    padding = torch.zeros(B, kv_len, dtype=torch.bool)
    padding[1, kv_len - kv_len // 3 :] = True
    graph = example_graph(kv_len)
    return RouteInputs(q, k, padding, edge_index=torch.stack([graph, kv_len - 1 - graph]))


def check_bound_views(pattern: Pattern, q_len: int, kv_len: int, blocks, fail) -> None:
    """Raise ``fail(message)`` at the first disagreement of ``pattern``'s views, bound to
    ``bound_inputs`` at this shape, causal and not."""
    inputs = bound_inputs(q_len, kv_len)
    for causal in (False, True):
        rules = "causal" if causal else "not causal"
        where = f"at q_len={q_len}, kv_len={kv_len}, {rules}"
        try:
            bound = (pattern & Causal() if causal else pattern).bind(inputs)
        except Exception as error:
            raise fail(f"bind raised {type(error).__name__} {where}: {error}", False) from error
        truth = _allowed(bound, q_len, kv_len)
        dense = torch.broadcast_to(bound.dense(q_len, kv_len), truth.shape)
        _first_difference("dense()", dense, truth, where, fail)
        parts = bound.parts()
        count = sum(_allowed(part, q_len, kv_len).to(torch.int32) for part in parts)
        if bool((count > 1).any()):
            raise fail(f"parts() overlap {where}; parts must be disjoint")
        _first_difference("the union of parts()", count > 0, truth, where, fail)
        for part in parts:
            part_truth = truth if len(parts) == 1 else _allowed(part, q_len, kv_len)
            for stride in sorted({1, part.stride}):
                for bq, bk in [*blocks, (1, blocks[0][1])]:
                    _check_blocks(part, part_truth, stride, bq, bk, where, fail)


def _allowed(pattern: Pattern, q_len: int, kv_len: int) -> Tensor:
    """(B, H, q_len, kv_len) from ``allowed_at``."""
    b, h = torch.arange(B).view(B, 1, 1, 1), torch.arange(H).view(1, H, 1, 1)
    q_pos, k_pos = query_positions(q_len, kv_len)[:, None], torch.arange(kv_len)[None, :]
    return torch.broadcast_to(pattern.allowed_at(b, h, q_pos, k_pos), (B, H, q_len, kv_len))


def _first_difference(view: str, got: Tensor, truth: Tensor, where: str, fail) -> None:
    if not torch.equal(got, truth):
        b, h, i, j = torch.nonzero(got != truth)[0].tolist()
        says = "allows" if got[b, h, i, j] else "rejects"
        raise fail(
            f"{view} {says} query {i} x key {j} of sequence {b}, head {h} {where}, but "
            f"allowed_at() {'rejects' if got[b, h, i, j] else 'allows'} it"
        )


def _check_blocks(part, truth: Tensor, stride: int, bq: int, bk: int, where: str, fail) -> None:
    q_len, kv_len = truth.shape[-2:]
    frame = build_frame(stride, q_len, kv_len, bq, bk, CPU)
    q, k = frame.q, frame.k
    state = part.block_state(q.spans().column(), k.spans().row())
    state = torch.broadcast_to(state, (B, H, q.num_blocks, k.num_blocks))
    valid = q.valid[:, None] & k.valid[None, :]
    tile = truth[:, :, q.index][..., k.index] & valid  # (B, H, q slots, k slots)
    tile = tile.unflatten(2, (-1, bq)).unflatten(4, (-1, bk))
    some = tile.any(5).any(3)
    every = tile.all(5).all(3) & valid.unflatten(0, (-1, bq)).unflatten(2, (-1, bk)).all(3).all(1)
    wrong = ((state == FULL) & ~every) | ((state == EMPTY) & some)
    if bool(wrong.any()):
        b, h, qb, kb = torch.nonzero(wrong)[0].tolist()
        claim = "FULL" if state[b, h, qb, kb] == FULL else "EMPTY"
        truth_words = "not every pair is allowed" if claim == "FULL" else "some pair is allowed"
        order = "" if stride == 1 else f", stride-{stride} token order"
        raise fail(
            f"block_state says {claim} for query block {qb} x key block {kb} of sequence {b}, "
            f"head {h} {where}, blocks {bq}x{bk}{order}, but {truth_words} there (a FULL block "
            "must have every pair allowed and no padding slot, an EMPTY block none allowed; "
            "PARTIAL is always safe)"
        )
