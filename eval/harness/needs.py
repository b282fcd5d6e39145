"""Which positions each scored answer of a task needs: the pairs (query, source) a model must
join to answer it, read from each task's documented layout.

For a token head the query is the scored position; for a sequence head (ListOps, Pathfinder) it
is the pooled output, which some real position must have gathered (a mean of per-position
features followed by a linear layer cannot combine what no single position holds), so the answer
is reachable when some position reaches every needed one. The needed sets are the tokens whose
content the answer copies or looks up, and the markers that locate them:

* ``mqar``: the key's first occurrence and the value after it (the query is the repeated key);
  slice ``gap``.
* ``induction``: the first SPECIAL and the token after it; slice ``distance``.
* ``passkey``: the KEY marker and the digit the slot repeats; slice ``depth``.
* ``copy``: the data token the slot repeats; slice ``index``.
* ``selective_copy``: every position up to the data token the slot repeats (telling it is the
  i-th data token takes every position before it); slice ``index``.
* ``listops``: every real token (the value of the whole expression); slice ``depth``.
* ``pathfinder``: the components of foreground pixels that hold the two circles and every pixel
  within the joining distance of them (whether anything joins them); slice ``distance``.
* ``graph_hops``: every node within the hop class of the node (min(h, max_hops) hops: telling
  the distance is h takes the whole ball), through the graph's edges, which only a variant that
  reads the graph sees (``Needs.edges``: every answer but the source's own); slice ``hops``.

Reach is necessary, not sufficient: a pattern that reaches every needed position may still not
join them where they must meet, so "out of reach" is a proof that the pattern cannot answer and
"reachable" only that it is not ruled out.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from ..tasks import IGNORE, Batch, Task


@dataclass
class Needs:
    """What each scored answer of a batch needs, one row per answer in the row-major order of
    the scored targets: ``example`` (T,) its sequence; ``query`` (T,) the scored position, or -1
    for the pooled output of a sequence head; ``needed`` (T, L) the positions it needs;
    ``lengths`` (N,) the real (unpadded) length of each sequence; ``edges`` (T,) or None: which
    answers depend on the graph's edges (an attention input), which only a variant that reads the
    graph sees."""

    example: Tensor
    query: Tensor
    needed: Tensor
    lengths: Tensor
    edges: Tensor | None = None


def scored(batch: Batch) -> tuple[Tensor, Tensor]:
    """(sequence, position) of every scored target of a token head, row-major: the order in
    which ``batch.slices[name][targets != IGNORE]`` lists their slice values."""
    example, query = (batch.targets != IGNORE).nonzero(as_tuple=True)
    return example, query


def _positions(length: int, rows: list[Tensor]) -> Tensor:
    """(T, length) bool with True at each row's positions (each a (T,) tensor)."""
    needed = torch.zeros(rows[0].numel(), length, dtype=torch.bool)
    index = torch.arange(rows[0].numel())
    for positions in rows:
        needed[index, positions] = True
    return needed


def _token(task: Task, batch: Batch, rows: Callable[[Tensor, Tensor], list[Tensor]]) -> Needs:
    example, query = scored(batch)
    n, length = batch.inputs.shape
    needed = _positions(length, [query, *rows(example, query)])
    return Needs(example, query, needed, torch.full((n,), length))


def _mqar(task: Task, batch: Batch) -> Needs:
    # the even positions a pair may start at: the context's, or the first half's (spread)
    front = task.kv_layout == "front"
    slots = torch.arange(0, 2 * task.num_kv_pairs if front else task.seq_len // 2, 2)

    def rows(example: Tensor, query: Tensor) -> list[Tensor]:
        # the slot holding the query's key (no filler repeats a key), in either layout
        candidates = batch.inputs[example][:, slots]  # (T, slots)
        key = slots[(candidates == batch.inputs[example, query][:, None]).float().argmax(1)]
        return [key, key + 1]

    return _token(task, batch, rows)


def _first(batch: Batch, example: Tensor, token: int) -> Tensor:
    """The first position of ``token`` in each listed sequence."""
    return (batch.inputs[example] == token).float().argmax(1)


def _induction(task: Task, batch: Batch) -> Needs:
    from ..tasks.induction import SPECIAL

    def rows(example: Tensor, query: Tensor) -> list[Tensor]:
        first = _first(batch, example, SPECIAL)
        return [first, first + 1]

    return _token(task, batch, rows)


def _passkey(task: Task, batch: Batch) -> Needs:
    from ..tasks.passkey import KEY

    start = batch.inputs.shape[1] - task.num_digits  # the first answer slot

    def rows(example: Tensor, query: Tensor) -> list[Tensor]:
        key = _first(batch, example, KEY)
        return [key, key + 1 + (query - start)]

    return _token(task, batch, rows)


def _copy(task: Task, batch: Batch) -> Needs:
    m = task.num_tokens
    # slot i (at r + M + 1 + i) repeats x_i (at r + i): M + 1 positions back
    return _token(task, batch, lambda example, query: [query - m - 1])


def _selective_copy(task: Task, batch: Batch) -> Needs:
    example, query = scored(batch)
    n, length = batch.inputs.shape
    m = task.num_tokens
    index = query - (length - m)
    data = batch.meta["data_positions"][example, index]  # (T,)
    needed = torch.arange(length)[None, :] <= data[:, None]
    needed[torch.arange(query.numel()), query] = True
    return Needs(example, query, needed, torch.full((n,), length))


def _pooled(task: Task, batch: Batch) -> Needs:
    n, length = batch.inputs.shape
    lengths = (
        torch.full((n,), length) if batch.padding_mask is None else (~batch.padding_mask).sum(1)
    )
    needed = torch.arange(length)[None, :] < lengths[:, None]
    return Needs(torch.arange(n), torch.full((n,), -1), needed, lengths)


def _pathfinder(task: Task, batch: Batch) -> Needs:
    """The components of foreground pixels holding the two markers (cells up to gap + 1 apart,
    Chebyshev, adjacent: the task's own rule for "joined") and every pixel within gap + 1 of
    them, whose emptiness says that nothing joins more: the label depends on these alone."""
    from ..tasks.pathfinder import BACKGROUND, MARKER

    n, length = batch.inputs.shape
    images = batch.inputs.view(n, 1, task.size, task.size)
    foreground = (images != BACKGROUND).float()
    reach = task.gap + 1

    def dilate(cells: Tensor) -> Tensor:
        return torch.nn.functional.max_pool2d(cells, 2 * reach + 1, stride=1, padding=reach)

    component = (images == MARKER).float()
    while True:
        grown = dilate(component) * foreground
        if torch.equal(grown, component):
            break
        component = grown
    needed = dilate(component).view(n, length) > 0
    return Needs(torch.arange(n), torch.full((n,), -1), needed, torch.full((n,), length))


def _graph_hops(task: Task, batch: Batch) -> Needs:
    example, query = scored(batch)
    n, length = batch.inputs.shape
    # hop distances between every pair of nodes, up to max_hops (max_hops + 1: farther)
    far = task.max_hops + 1
    distance = torch.full((n, length, length), far)
    adjacency = torch.zeros(n, length, length)
    for b, edges in enumerate(batch.attention_inputs["edge_index"]):
        adjacency[b, edges[0], edges[1]] = 1.0
    frontier = torch.eye(length).expand(n, -1, -1).clone()
    seen = frontier.bool()
    distance[seen] = 0
    for hop in range(1, far):
        frontier = ((frontier @ adjacency) > 0) & ~seen
        distance[frontier] = hop
        seen |= frontier
        frontier = frontier.float()
    hops = batch.slices["hops"][example, query]
    needed = distance[example, query] <= hops.clamp(max=task.max_hops)[:, None]
    # every answer but the source's own (its token says it) depends on the edges: an isolated
    # node's class is the absence of any
    return Needs(example, query, needed, torch.full((n,), length), edges=hops != 0)


NEEDS: dict[str, Callable[[Task, Batch], Needs]] = {
    "mqar": _mqar,
    "induction": _induction,
    "passkey": _passkey,
    "copy": _copy,
    "selective_copy": _selective_copy,
    "listops": _pooled,
    "pathfinder": _pathfinder,
    "graph_hops": _graph_hops,
}

# The slice whose values a task's verdict reads: the one that sorts answers by how far their
# needed positions lie (or by how much of the input they need).
VERDICT_SLICE: dict[str, str] = {
    "mqar": "gap",
    "induction": "distance",
    "passkey": "depth",
    "copy": "index",
    "selective_copy": "index",
    "listops": "depth",
    "pathfinder": "distance",
    "graph_hops": "hops",
}


def needs(task_name: str, task: Task, batch: Batch) -> Needs | None:
    """The needs of every scored answer of ``batch``; None for a task without a rule here."""
    rule = NEEDS.get(task_name)
    return None if rule is None else rule(task, batch)
