"""What the host knows of a decoding step without reading a device tensor: how many keys a query
may attend at most, so that a step packs its allowed keys to a width known in advance.

A step that asks the device (``counts.max()``, ``nonzero``) waits for it: on a GPU each such read
is a synchronisation, and a one-token step is all host work and small kernels. So the widths of a
step come from Python ints that the cache keeps (``KVCache.longest``) and from tables computed
once per pattern and length on the CPU:

- ``query_bounds``: for a fixed pattern, the most keys any query at a position up to n may attend
  (any head, for a pattern drawn per head), n = 0 .. max_len - 1, and the fewest a query at n
  attends (over the heads). Counted as ``zoo.layout.block_layout.allowed_pairs`` counts pairs,
  one query at a time: each disjoint part of the pattern in its own token order, full blocks by
  size, partial blocks by evaluating the mask on them alone, empty blocks never (at 64K
  positions, 0.1 s for a window, 1.4 s for BigBird's 16 heads of random blocks). The cache keeps
  every key a later query may attend (``zoo.patterns.retention``), each in a slot of its own, so
  these count the cache's allowed slots too: a step packs them to the most (``sdpa``), and a
  query whose fewest equals the slots in use attends all of them (no mask).
- ``latest_runs``: for a fixed pattern of one layout, whether a query at n attends exactly its
  latest keys (as many as ``query_bounds`` counts): a cache that holds them in its first slots
  (a block-local ring at a block's start) is then read there without a mask.
- ``routed_most``: for a pattern chosen by content, the most keys its choice can hold, from the
  family's ``most_keys`` (MoBA: ``top_k`` blocks of ``block_size``, its own among them, only up
  to the query where the host knows its position), or None.
"""

from __future__ import annotations

from array import array

import torch
from torch import Tensor

from ..core.device_build import on_host
from ..core.shape_cache import per_shape
from ..layout.block_layout import build_layout
from ..layout.frames import build_frame
from ..patterns import FULL, PARTIAL, Pattern, Spans
from ..patterns.compose import Intersection, Union

BLOCK = 64  # positions per block of the counting grid
CHUNK = 1 << 22  # pairs evaluated at once


@per_shape(maxsize=64)
def query_bounds(pattern: Pattern, length: int) -> tuple[Tensor, Tensor]:
    """(most, least), each (length,) int64 on the CPU: most[n] the most keys (at positions
    0 .. length - 1) that a query at a position up to n may attend, over every head of a
    pattern drawn per head; least[n] the fewest a query at n attends, over the heads.
    ``pattern`` is fixed (not chosen by content), specialised to ``length``, on the CPU."""
    device = torch.device("cpu")
    total = torch.zeros(1, length, dtype=torch.long)
    for part in pattern.parts():
        frame = build_frame(part.stride, length, length, BLOCK, BLOCK, device)
        state = build_layout(part, frame).state
        q_blocks, k_blocks = state.shape[-2:]
        state = state.reshape(-1, q_blocks, k_blocks)  # (1 or H, query blocks, key blocks)
        q_pos, q_ok = frame.q.position.view(-1, BLOCK), frame.q.valid.view(-1, BLOCK)
        k_pos, k_ok = frame.k.position.view(-1, BLOCK), frame.k.valid.view(-1, BLOCK)
        # Every query of a block counts the keys of its full blocks...
        full = (state == FULL).long() @ k_ok.sum(1)  # (1 or H, query blocks)
        counts = full[:, :, None].expand(-1, -1, BLOCK).clone()  # (1 or H, query blocks, BLOCK)
        # ... and those its own row allows in each partial block.
        heads, rows, cols = torch.nonzero(state == PARTIAL, as_tuple=True)
        step = max(CHUNK // (BLOCK * BLOCK), 1)
        for start in range(0, heads.numel(), step):
            h, qb, kb = (t[start : start + step] for t in (heads, rows, cols))
            hit = part.allowed_at(
                torch.zeros_like(h)[:, None, None], h[:, None, None], q_pos[qb][:, :, None],
                k_pos[kb][:, None, :],
            )  # fmt: skip
            per_query = (hit & k_ok[kb][:, None, :]).sum(2)  # (N, BLOCK)
            counts.index_put_((h, qb), per_query, accumulate=True)
        counts = counts.flatten(1)[:, q_ok.flatten()]  # (1 or H, length): valid slots only
        order = frame.q.position.view(-1)[q_ok.flatten()]
        placed = torch.zeros_like(counts)
        placed[:, order] = counts  # back in position order
        total = total + placed
    return total.amax(0).cummax(0).values, total.amin(0)


@per_shape(maxsize=64)
def latest_runs(pattern: Pattern, length: int) -> Tensor:
    """(length,) bool on the CPU: True at n where a query at n attends exactly its least[n]
    latest positions, n - least[n] + 1 .. n (``query_bounds``' fewest, the exact count for a
    pattern of one layout): a block-local query's own block so far, a window's keys. The
    pattern's ``block_state`` on that one run of keys says FULL, and the count says nothing
    else is allowed; a family whose formula says PARTIAL there is left out (sound, not exact).
    ``pattern`` is fixed, of one layout for every head, specialised to ``length``, on the
    CPU."""
    _, least = query_bounds(pattern, length)
    query = torch.arange(length)
    complete = torch.ones(length, dtype=torch.bool)
    state = pattern.block_state(
        Spans(query, query, 1, complete), Spans(query - least + 1, query, 1, complete)
    )
    return (state == FULL) & (least > 0)


def host_ints(t: Tensor) -> array:
    """A real CPU tensor's values as a compact array of Python ints, read outside the caller's
    modes (a fake mode would make the tensor fake, its values unreadable)."""
    with on_host():
        return array("q", t.tolist())


def host_bools(t: Tensor) -> bytes:
    """A real CPU bool tensor's values as bytes (0 or 1 each), read as ``host_ints`` reads."""
    with on_host():
        return bytes(t.to(torch.uint8).tolist())


def routed_most(pattern: Pattern, position: int | None = None) -> int | None:
    """The most keys a pattern chosen by content lets one query (at ``position``, where the host
    knows it) attend: a routed family's ``most_keys`` (MoBA's), causal attention ``position + 1``,
    an intersection the least of its members' bounds, a union their sum; None where no bound is
    known."""
    children = getattr(pattern, "children", None)
    if children is not None:
        bounds = [routed_most(c, position) for c in children]
        if isinstance(pattern, Intersection):
            known = [b for b in bounds if b is not None]
            return min(known) if known else None
        if isinstance(pattern, Union) and all(b is not None for b in bounds):
            return sum(bounds)  # type: ignore[arg-type]
        return None
    if pattern.kind == "causal":
        return None if position is None else position + 1
    most_keys = getattr(pattern, "most_keys", None)  # a routed family's own bound (Moba)
    return most_keys(position) if pattern.routed and most_keys is not None else None
