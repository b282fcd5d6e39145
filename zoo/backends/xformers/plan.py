"""Which xFormers kernel calls compute a pattern: pieces whose partial softmaxes merge into the
pattern's attention exactly, and whose backward calls add up to its gradient.

A piece is a range of queries against a range of keys, under at most one of xFormers' structured
masks (none, causal from the bottom right, a local window from the bottom right), optionally
repeated as windows moved on by a fixed step (xFormers runs them as a batch). Its role says what
it computes:

- ``merged``: its queries' partial attention, merged by log-sum-exp with the other pieces that
  hold them, and in the backward its share of dq, dk and dv;
- ``rows``: its queries' whole attention (no other piece holds them) and in the backward their
  dq only;
- ``keys`` (backward only): dk and dv of the first ``kept`` keys of each window, from every
  query that sees them; its other keys, pairs of the pattern too (so that no probability
  recomputed against the merged log-sum-exp exceeds one), only fill the call.

The pieces that compute outputs (merged, rows) never share a (query, key) pair and together allow
exactly the pattern's pairs; so do the pieces that compute key gradients (merged, keys) on their
kept keys. Tests check both on the dense masks.

Where a query sits in one piece and a key in one piece, its output and gradients come from one
kernel call, rounded once to bf16 or fp16 as a single FlashAttention call rounds them. Merged
pieces round each partial output and gradient first and their sum again, an error of up to about
an ulp where one call's is half of one: the H100 run of 2026-11-27 found block_local's causal dv
in bf16 one ulp off (0.0324, where 0.0229 was allowed: PyTorch's own error 0.0115, twice, plus
the floor), each key's gradient there the sum of three rounded calls. So block-local chunks run
by rows and by keys rather than merged. Global tokens cannot (FlashAttention's masks are bands,
and a band with global columns is none), so their pieces stay merged.

What has a plan:

- full, causal, local and sliding windows: one piece;
- a prefix of global tokens, alone or with a window (Longformer), merged: the global queries
  against every key, the other queries against the keys past the global ones under the window
  (if any), and the other queries against the global keys, unmasked. With more queries than keys
  the first queries sit before every key (negative positions): not global, they are other
  queries too, and only the part of a piece where some pair is allowed is kept;
- block-local chunks with n neighbours (BigBird's window; self-attention): each chunk's queries
  against all the keys they see, in one call (``rows``: windows of n + 1, or 2n + 1, chunks of
  keys, the chunks at the ends on their own); and each chunk of keys against all the queries that
  see it (``keys``: causal ones against the same n + 1 chunks of keys, squared, keeping the first
  chunk's gradient). With no neighbours, the chunks against themselves, merged (each query and
  key in one call already).

Positions align bottom-right, as everywhere in the zoo: query i sits at position i + Lk - Lq.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ...patterns import BlockLocal, Causal, Full, Global, Intersection, Local, Pattern, Union

Mask = None | str | tuple[int, int]  # None, "causal", or (window_left, window_right)


@dataclass(frozen=True)
class Piece:
    """Queries ``rows`` against keys ``keys`` (index ranges), allowing the pairs whose offset
    kv_pos - q_pos lies in [lo, hi] (None: unbounded). With ``count`` > 1, as many windows: the
    i-th is rows and keys moved on by i * ``step``. ``mask`` is the constraint as the xFormers
    mask of one window's slices (see ``slice_mask``); ``role`` and ``kept`` as in the module
    doc (``kept`` None: every key of a window)."""

    rows: tuple[int, int]
    keys: tuple[int, int]
    lo: int | None = None
    hi: int | None = None
    mask: Mask = None
    count: int = 1
    step: int = 0
    role: str = "merged"
    kept: int | None = None

    @property
    def empty(self) -> bool:
        return self.rows[0] >= self.rows[1] or self.keys[0] >= self.keys[1]

    @property
    def outputs(self) -> bool:
        """Whether it computes its queries' outputs (and dq)."""
        return self.role != "keys"

    @property
    def key_grads(self) -> bool:
        """Whether it computes dk and dv (of its kept keys)."""
        return self.role != "rows"

    @property
    def shape(self) -> tuple[int, int]:
        """(queries, keys) of one window."""
        return self.rows[1] - self.rows[0], self.keys[1] - self.keys[0]

    @property
    def kept_keys(self) -> int:
        return self.shape[1] if self.kept is None else self.kept


def plan_pieces(pattern: Pattern, q_len: int, kv_len: int) -> list[Piece] | str:
    """The pieces that compute ``pattern`` at these lengths, masks set, or why xFormers cannot."""
    pieces = _pieces(pattern, q_len, kv_len)
    if isinstance(pieces, str):
        return pieces
    pieces = [replace(p, mask=slice_mask(p, q_len, kv_len)) for p in pieces]
    for p in pieces:
        rows, keys = p.shape
        # FlashAttention (flash_api.cpp) turns window_right >= keys into keys, which bounds the
        # window where a slice has more than keys + 1 queries: such a window would lose pairs.
        if isinstance(p.mask, tuple) and p.mask[1] >= keys and rows - 1 > keys:
            return (
                f"FlashAttention cannot leave a window's right side at {p.mask[1]} with {rows} "
                f"queries and {keys} keys (it clamps it to the keys)"
            )
    return pieces


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
        return _block_local(core, q_len, kv_len, hi)
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
    end = ranges[0][1]
    g = min(end, kv_len)  # global keys; global positions past the keys exist only as queries
    # The global queries sit at positions 0 .. end - 1: rows first .. stop - 1. The rows before
    # them (more queries than keys: negative positions) and after them are the other queries.
    # Causal global rows see only keys below g, hence the shorter key range.
    first, stop = (min(q_len, max(0, position - (kv_len - q_len))) for position in (0, end))
    pieces = [Piece((first, stop), (0, g if hi is not None else kv_len), None, hi)]
    for rows in ((0, first), (stop, q_len)):
        pieces += [
            Piece(rows, (g, kv_len), -w.window_size[0], _min(w.window_size[1], hi)) for w in windows
        ]
        pieces.append(Piece(rows, (0, g), None, hi))
    pieces = [_trimmed(p, q_len, kv_len) for p in pieces]
    return [p for p in pieces if not p.empty]


def _trimmed(piece: Piece, q_len: int, kv_len: int) -> Piece:
    """The piece without the rows that none of its keys may attend to and the keys that none of
    its rows may attend to, so that its mask stays one xFormers has (a window's sides would turn
    negative where a piece's rows lie wholly before its keys). One pass suffices: a row kept has
    an allowed key between the first and the last kept row's, which is kept."""
    shift = kv_len - q_len  # row r sits at position r + shift
    (r0, r1), (k0, k1) = piece.rows, piece.keys
    rows, keys = [r0, r1], [k0, k1]
    if piece.hi is not None:  # k - (r + shift) <= hi
        rows[0], keys[1] = max(r0, k0 - piece.hi - shift), min(k1, r1 + shift + piece.hi)
    if piece.lo is not None:  # k - (r + shift) >= lo
        rows[1], keys[0] = min(r1, k1 - piece.lo - shift), max(k0, r0 + shift + piece.lo)
    return replace(piece, rows=tuple(rows), keys=tuple(keys))


def _block_local(pattern: BlockLocal, q_len: int, kv_len: int, hi: int | None):
    if q_len != kv_len:
        return f"it runs block_local only with as many queries as keys, not {q_len} and {kv_len}"
    b, n, length = pattern.block_size, pattern.neighbors, q_len
    chunks = -(-length // b)  # the last may be shorter

    def span(first: int, stop: int) -> tuple[int, int]:  # chunks first .. stop - 1, clipped
        return max(0, first * b), min(length, stop * b)

    if hi is not None:  # causal: chunks 0 .. n - 1 see every earlier key, a plain causal square
        head = span(0, n)
        by_rows = [(head, head, None)] if n and head[1] > 0 else []
        by_rows += [(span(c, c + 1), span(c - n, c + 1), None) for c in range(n, chunks)]
        # Key chunk j and the queries of chunks j .. j + n, against the keys of the same chunks
        # (a causal square); the last chunks of keys, which every later query sees, in one.
        tail = max(0, chunks - n - 1)
        by_keys = [(span(j, j + n + 1), span(j, j + n + 1), b) for j in range(tail)]
        by_keys.append((span(tail, chunks), span(tail, chunks), None))
    else:
        by_rows = [(span(c, c + 1), span(c - n, c + n + 1), None) for c in range(chunks)]
        by_keys = [(span(j - n, j + n + 1), span(j, j + 1), None) for j in range(chunks)]
    rows, keys = _windows(by_rows, b, hi, "rows"), _windows(by_keys, b, hi, "keys")
    # A call that is both (no neighbours, or a short sequence) runs once, merged: each of its
    # queries and keys is in no other.
    same = [p for p in rows if replace(p, role="keys") in keys]
    return [replace(p, role="merged") if p in same else p for p in rows] + [
        p for p in keys if replace(p, role="rows") not in same
    ]


def _windows(units: list[tuple], step: int, hi: int | None, role: str) -> list[Piece]:
    """Pieces of ``role`` for (rows, keys, kept) units in order: a unit that is the last one
    moved on by ``step`` (same shape and place) joins it as one more window."""
    pieces: list[Piece] = []
    for rows, keys, kept in units:
        kept = None if kept is not None and kept >= keys[1] - keys[0] else kept
        if pieces:
            last = pieces[-1]
            moved = last.count * step
            if (
                (rows[0] - moved, rows[1] - moved) == last.rows
                and (keys[0] - moved, keys[1] - moved) == last.keys
                and kept == last.kept
            ):
                pieces[-1] = replace(last, count=last.count + 1, step=step)
                continue
        pieces.append(Piece(rows, keys, None, hi, role=role, kept=kept))
    return [p for p in pieces if not p.empty]


def slice_mask(piece: Piece, q_len: int, kv_len: int) -> Mask:
    """The piece's constraint as an xFormers mask in the coordinates of one window's slices:
    bottom-right aligned within them, as xFormers' masks are."""
    rows, keys = piece.shape
    # kv_pos - q_pos in the whole call = (the same offset within the slices) + shift; every
    # window sits at the same place in both.
    shift = (piece.keys[0] - piece.rows[0]) - (kv_len - q_len) + (keys - rows)
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
