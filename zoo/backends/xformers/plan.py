"""Which xFormers kernel calls compute a pattern: disjoint pieces whose partial softmaxes merge into
the pattern's attention exactly.

A piece is a range of queries against a range of keys, under at most one of xFormers' structured
masks (none, causal from the bottom right, a local window from the bottom right), optionally cut
into aligned chunks that attend only to their partner chunk (xFormers runs them as a batch). The
pieces of a plan never share a (query, key) pair and together allow exactly the pattern's pairs;
tests check both on the dense masks.

What has a plan:

- full, causal, local and sliding windows: one piece;
- a prefix of global tokens, alone or with a window (Longformer): the global queries against every
  key, the other queries against the keys past the global ones under the window (if any), and the
  other queries against the global keys, unmasked;
- block-local chunks with n neighbours (BigBird's window; self-attention): for each chunk offset
  -n..n, the chunks against their partner chunks, plus the shorter last chunk on its own, so a
  length that is not a multiple of the block size keeps exactly its pattern.

Positions align bottom-right, as everywhere in the zoo: query i sits at position i + Lk - Lq.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ...patterns import BlockLocal, Causal, Full, Global, Intersection, Local, Pattern, Union

Mask = None | str | tuple[int, int]  # None, "causal", or (window_left, window_right)


@dataclass(frozen=True)
class Piece:
    """Queries ``rows`` against keys ``keys`` (index ranges), allowing the pairs whose offset
    kv_pos - q_pos lies in [lo, hi] (None: unbounded). With ``chunk``, rows and keys are cut into
    aligned chunks of that size and chunk c of the rows sees only chunk c of the keys. ``mask``
    is that constraint as the xFormers mask of the slices (see ``slice_mask``)."""

    rows: tuple[int, int]
    keys: tuple[int, int]
    lo: int | None = None
    hi: int | None = None
    chunk: int | None = None
    mask: Mask = None

    @property
    def empty(self) -> bool:
        return self.rows[0] >= self.rows[1] or self.keys[0] >= self.keys[1]


def plan_pieces(pattern: Pattern, q_len: int, kv_len: int) -> list[Piece] | str:
    """The pieces that compute ``pattern`` at these lengths, masks set, or why xFormers cannot."""
    pieces = _pieces(pattern, q_len, kv_len)
    if isinstance(pieces, str):
        return pieces
    pieces = [replace(p, mask=slice_mask(p, q_len, kv_len)) for p in pieces]
    for p in pieces:
        rows, keys = _slice_shape(p)
        # FlashAttention (flash_api.cpp) turns window_right >= keys into keys, which bounds the
        # window where a slice has more than keys + 1 queries: such a window would lose pairs.
        if isinstance(p.mask, tuple) and p.mask[1] >= keys and rows - 1 > keys:
            return (
                f"FlashAttention cannot leave a window's right side at {p.mask[1]} with {rows} "
                f"queries and {keys} keys (it clamps it to the keys)"
            )
    return pieces


def _slice_shape(piece: Piece) -> tuple[int, int]:
    """(queries, keys) of one kernel call's slice: the piece's, or one chunk pair's."""
    if piece.chunk is not None:
        return piece.chunk, piece.chunk
    return piece.rows[1] - piece.rows[0], piece.keys[1] - piece.keys[0]


def _pieces(pattern: Pattern, q_len: int, kv_len: int) -> list[Piece] | str:
    members = pattern.children if isinstance(pattern, Intersection) else (pattern,)
    hi = 0 if any(isinstance(m, Causal) for m in members) else None
    rest = [m for m in members if not isinstance(m, Causal | Full)]
    if not rest:
        return [Piece((0, q_len), (0, kv_len), None, hi)]
    if len(rest) > 1:
        return "it has no plan for an intersection of several sparse patterns"
    core = rest[0]
    if isinstance(core, Local):
        left, right = core.window_size
        return [Piece((0, q_len), (0, kv_len), -left, _min(right, hi))]
    if isinstance(core, Union | Global):
        return _window_and_globals(core, q_len, kv_len, hi)
    if isinstance(core, BlockLocal):
        return _chunks(core, q_len, kv_len, hi)
    return f"it has no plan for {type(core).__name__} patterns"


def _min(a: int | None, b: int | None) -> int | None:
    return a if b is None else b if a is None else min(a, b)


def _window_and_globals(core: Union | Global, q_len: int, kv_len: int, hi: int | None):
    members = core.children if isinstance(core, Union) else (core,)
    windows = [c for c in members if isinstance(c, Local)]
    globals_ = [c for c in members if isinstance(c, Global)]
    if len(windows) > 1 or len(globals_) != 1 or len(members) != len(windows) + 1:
        return "it composes a union only of one local window and global tokens"
    ranges = globals_[0]._ranges
    if len(ranges) != 1 or ranges[0][0] != 0:
        return "it composes global tokens only as a prefix of the sequence (global_tokens=n)"
    if q_len > kv_len:  # queries before the first key would be non-global rows above the global
        return f"it composes global tokens only with no more queries than keys ({q_len} > {kv_len})"
    end = ranges[0][1]
    g = min(end, kv_len)  # global keys; global positions past the keys exist only as queries
    # Queries at positions below `end` are global; with bottom-right alignment they are the first
    # end - (Lk - Lq) rows. Causal global rows see only keys below g, hence the shorter key range.
    first = min(q_len, max(0, end - (kv_len - q_len)))
    window = [Piece((first, q_len), (g, kv_len), -w.window_size[0], _min(w.window_size[1], hi))
              for w in windows]  # fmt: skip
    pieces = [
        Piece((0, first), (0, g if hi is not None else kv_len), None, hi),
        *window,
        Piece((first, q_len), (0, g), None, hi),
    ]
    return [p for p in pieces if not p.empty]


def _chunks(pattern: BlockLocal, q_len: int, kv_len: int, hi: int | None):
    if q_len != kv_len:
        return f"it runs block_local only with as many queries as keys, not {q_len} and {kv_len}"
    b, n = pattern.block_size, pattern.neighbors
    whole, tail = divmod(q_len, b)
    last = whole * b  # where the shorter last chunk starts (if tail)
    pieces = []
    for offset in range(-n, n + 1 if hi is None else 1):
        first, stop = max(0, -offset), min(whole, whole - offset)
        if stop > first:
            rows = (first * b, stop * b)
            keys = (rows[0] + offset * b, rows[1] + offset * b)
            pieces.append(Piece(rows, keys, None, hi, chunk=b))
        partner = whole + offset  # the chunk the last chunk sees at this offset
        if tail and 0 <= partner <= whole:
            keys = (partner * b, min(partner * b + b, q_len))
            pieces.append(Piece((last, q_len), keys, None, hi))
        mirror = whole - offset  # the whole chunk that sees the last chunk at this offset
        if tail and offset > 0 and 0 <= mirror < whole:
            pieces.append(Piece((mirror * b, mirror * b + b), (last, q_len), None, hi))
    return pieces


def slice_mask(piece: Piece, q_len: int, kv_len: int) -> Mask:
    """The piece's constraint as an xFormers mask in the coordinates of its slices (or of one chunk
    pair): bottom-right aligned within them, as xFormers' masks are."""
    q_span, k_span = piece.rows[1] - piece.rows[0], piece.keys[1] - piece.keys[0]
    # kv_pos - q_pos in the whole call = (the same offset within the slices) + shift. Chunked
    # pieces have equal spans, and chunk pairs sit at the same place in both.
    shift = (piece.keys[0] - piece.rows[0]) - (kv_len - q_len) + (k_span - q_span)
    rows, keys = _slice_shape(piece)
    lo = None if piece.lo is None or piece.lo - shift <= 1 - keys else piece.lo - shift
    hi = None if piece.hi is None or piece.hi - shift >= rows - 1 else piece.hi - shift
    if lo is None and hi is None:
        return None
    if lo is None and hi == 0:
        return "causal"
    left, right = (keys if lo is None else -lo), (rows if hi is None else hi)
    if left < 0 or right < 0:
        raise ValueError(f"{piece} needs a window xFormers has no mask for: ({left}, {right})")
    return (left, right)
