"""``zoo.check_pattern``: do a pattern's three views agree? The check the zoo's own tests apply.

A pattern answers the same question three ways (see ``zoo.patterns.base``): ``allowed`` pair by
pair, ``block_state`` block by block, ``dense`` as a whole matrix. Backends trust each: ``flex``
and ``blocked`` skip the blocks that ``block_state`` calls EMPTY and ``flex`` drops the mask on
those it calls FULL, so a wrong claim gives wrong outputs with no error. This module evaluates
``allowed`` on every pair at a range of shapes and checks, in words when it fails:

- ``dense(q_len, kv_len)`` and the FlexAttention ``mask_mod`` equal ``allowed`` on the grid;
- ``parts()`` are disjoint and their union is the pattern;
- ``block_state`` is conservative in every token order a backend uses (the natural order for the
  whole pattern; for each part the natural order, the part's own ``stride``, and the stride-3 order
  that a composition with a stride-3 member would run it in): a FULL block has every pair allowed
  and no padding slot, an EMPTY block has no pair allowed. PARTIAL is always acceptable: the mask
  then decides.

Each check runs on the pattern as ``specialize`` returns it for the shape, on the CPU. A pattern
chosen by content is bound to a seeded random input first and checked per sequence and head
(``zoo.testing.routed_views``; a pattern that reads the call's graph, ``graph``, on an example
graph). The zoo's own tests (tests/patterns/test_patterns.py) run the same function on every
variant.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor

from ..layout.frames import Axis, Frame, build_frame
from ..patterns.base import EMPTY, FULL, PARTIAL, Pattern, query_positions
from ..patterns.compose import memo_parts, order_key
from ..patterns.grid import Tiles
from .routed_views import check_bound_views

CPU = torch.device("cpu")
LENGTHS = (37, 100, 300, 600)
BLOCK_SIZES = (16, 32, 64, (16, 64), (64, 16))
OTHER_STRIDE = 3  # a token order that compositions with a stride-3 member use
STATES = {EMPTY: "EMPTY", PARTIAL: "PARTIAL", FULL: "FULL"}


class PatternCheckError(ValueError):
    """A pattern's views disagree; the message names the first disagreement in words."""


class NoLengthFits(PatternCheckError):
    """No length checked fits the pattern's parameters (a 2-D grid at a prime length): nothing
    was checked, which is no disagreement but no pass either."""


def shapes_of(lengths: Iterable[int | tuple[int, int]]) -> list[tuple[int, int]]:
    """(q_len, kv_len) pairs: a pair as given; a length n as (n, n), (1, n) (decoding),
    (2n/3, n) and (n, 2n/3) (fewer and more queries than keys)."""
    shapes: list[tuple[int, int]] = []
    for item in lengths:
        if isinstance(item, int):
            fewer = max(1, 2 * item // 3)
            candidates = [(item, item), (1, item), (fewer, item), (item, fewer)]
        else:
            q_len, kv_len = item
            candidates = [(int(q_len), int(kv_len))]
        for q_len, kv_len in candidates:
            if q_len < 1 or kv_len < 1:
                raise ValueError(f"lengths must be positive, got q_len={q_len}, kv_len={kv_len}")
            if (q_len, kv_len) not in shapes:
                shapes.append((q_len, kv_len))
    return shapes


def block_pairs(block_sizes: Iterable[int | tuple[int, int]]) -> list[tuple[int, int]]:
    """(query block, key block) sizes: a size b stands for (b, b)."""
    sizes = list(block_sizes)
    pairs = [(b, b) if isinstance(b, int) else (int(b[0]), int(b[1])) for b in sizes]
    if not pairs or any(min(pair) < 1 for pair in pairs):
        raise ValueError(f"block sizes must be positive, got {sizes!r}")
    return pairs


def resolve(pattern_or_name: str | Pattern, params: dict[str, object]) -> Pattern:
    """A Pattern as given, a registry variant by name, or a pattern family (a name registered
    with ``@zoo.register_pattern`` or ``package.module:factory``), with ``params``."""
    from ..core.arguments import suggest
    from ..patterns.families import build_family, list_families
    from ..registry import NAMESPACES, get_spec, list_attention, list_variants, registry

    if isinstance(pattern_or_name, Pattern):
        if params:
            raise TypeError(
                f"parameters {sorted(params)} apply to a variant name, not to a Pattern object"
            )
        return pattern_or_name
    if not isinstance(pattern_or_name, str):
        raise TypeError(
            "check_pattern takes a Pattern, a variant name or a pattern family name, got "
            f"{type(pattern_or_name).__name__}"
        )
    name = pattern_or_name
    # a variant's name (a mechanism's too) means the variant, whatever family shares it
    if name not in list_attention() and (":" in name or name in list_families()):
        return build_family(name, params)
    if name in list_variants() or registry().entry(name, NAMESPACES[0]) is not None:
        return get_spec(name).build(**params)  # a mechanism or a broken entry: its own error
    # families are names this takes too: a misspelt one is matched among them
    known = {*list_variants(), *list_families()}
    listing = "zoo.list_variants() and zoo.list_pattern_families()"
    message = suggest("variant or pattern family", name, known, listing)
    raise ValueError(message + registry().skipped_note())


def check_pattern(
    pattern_or_name: str | Pattern,
    *,
    lengths: Iterable[int | tuple[int, int]] = LENGTHS,
    block_sizes: Iterable[int | tuple[int, int]] = BLOCK_SIZES,
    **params: object,
) -> int:
    """Check that a pattern's three views agree; raise ``PatternCheckError`` at the first place
    they do not, e.g. "pattern 'my_band' disagrees with itself: block_state says FULL for query
    block 2 (positions 64..95) x key block 1 (positions 32..63) at q_len=100, kv_len=100, block 32,
    but allowed() rejects (q=70, k=40)".

    ``pattern_or_name``: a Pattern, a registry variant name, or a pattern family (registered with
    ``@zoo.register_pattern``, or ``package.module:factory``); ``params`` override a name's
    parameters. ``lengths``: ints n (checked as (n, n), (1, n), (2n/3, n) and (n, 2n/3)) or
    (q_len, kv_len) pairs. ``block_sizes``: ints or (query block, key block) pairs. The pattern
    is specialized for each shape first (random patterns draw there); a shape whose
    ``specialize`` raises ValueError (parameters that do not fit the lengths) is skipped.
    Returns the number of shapes checked.
    """
    if isinstance(pattern_or_name, str):
        given = ", ".join(f"{key}={value!r}" for key, value in params.items())
        label = f"{pattern_or_name!r}" + (f" ({given})" if given else "")
    else:
        label = _short(pattern_or_name)
    pattern = resolve(pattern_or_name, params)
    shapes, blocks = shapes_of(lengths), block_pairs(block_sizes)

    def fail(message: str, disagree: bool = True) -> PatternCheckError:
        verb = " disagrees with itself" if disagree else ""
        return PatternCheckError(f"pattern {label}{verb}: {message}")

    _check_hashable(pattern, "it", fail)
    checked, skipped = 0, []
    for q_len, kv_len in shapes:
        try:
            p = pattern.specialize(q_len, kv_len, CPU)
        except ValueError as error:  # e.g. graph at q_len != kv_len: not a shape it runs at
            skipped.append(f"q_len={q_len}, kv_len={kv_len}: {error}")
            continue
        except Exception as error:
            raise fail(
                f"specialize raised {type(error).__name__} at q_len={q_len}, kv_len={kv_len}: "
                f"{error}",
                disagree=False,
            ) from error
        if p.routed:  # chosen by content: the views of one bound input, per sequence and head
            check_bound_views(p, q_len, kv_len, blocks, fail)
        else:
            _check_shape(p, q_len, kv_len, blocks, fail)
            if p.per_head:  # drawn per query head: each head's views, as one layout each
                _check_heads(p, q_len, kv_len, blocks, fail)
        checked += 1
    if not checked:
        raise NoLengthFits(
            f"pattern {label} fits none of the lengths checked ({'; '.join(skipped)})"
        )
    return checked


HEADS = 3  # the query heads a pattern drawn per head is checked at


@dataclass(frozen=True, eq=False)
class OneHead(Pattern):
    """Head ``head`` of a layout drawn per query head (``Pattern.for_heads``), as a pattern of
    one layout, so that each head's views are checked as a fixed pattern's."""

    pattern: Pattern
    head: int

    @property
    def stride(self):  # type: ignore[override]
        return self.pattern.stride

    @property
    def kind(self) -> str:
        return self.pattern.kind

    def allowed(self, q_pos: Tensor, kv_pos: Tensor) -> Tensor:
        b, h = torch.tensor(0), torch.tensor(self.head)
        return self.pattern.allowed_at(b, h, q_pos, kv_pos)

    def block_state(self, q, k) -> Tensor:
        state = self.pattern.block_state(q, k)
        return state[0, self.head] if state.dim() == 4 else state

    def dense(self, q_len: int, kv_len: int) -> Tensor:
        dense = self.pattern.dense(q_len, kv_len)
        return dense[0, self.head] if dense.dim() == 4 else dense

    def parts(self) -> tuple[Pattern, ...]:
        return memo_parts(self, lambda: tuple(OneHead(p, self.head) for p in self.pattern.parts()))


def _check_heads(p: Pattern, q_len: int, kv_len: int, blocks, fail) -> None:
    """A pattern drawn per head: ``for_heads(HEADS)`` gives [1, H, ...] views, each head's
    agreeing with itself, and head 0's are the views of the pattern before ``for_heads``."""
    where = f"at q_len={q_len}, kv_len={kv_len}"
    drawn = _call(f"for_heads({HEADS})", where, fail, p.for_heads, HEADS)
    dense = _call("dense() of the heads", where, fail, drawn.dense, q_len, kv_len)
    if tuple(dense.shape) != (1, HEADS, q_len, kv_len):
        raise fail(
            f"for_heads({HEADS}).dense() has shape {tuple(dense.shape)}, not "
            f"[1, {HEADS}, {q_len}, {kv_len}] {where}",
            disagree=False,
        )
    _first_difference("head 0 of for_heads().dense()", dense[0, 0], p.dense(q_len, kv_len),
                      q_len, kv_len, fail)  # fmt: skip
    for h in range(HEADS):

        def fail_head(message: str, disagree: bool = True, h: int = h) -> PatternCheckError:
            return fail(f"head {h} of {HEADS}: {message}", disagree)

        _check_shape(OneHead(drawn, h), q_len, kv_len, blocks, fail_head)


def _short(pattern: object, limit: int = 80) -> str:
    text = repr(pattern)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _check_hashable(pattern: Pattern, what: str, fail) -> None:
    try:
        hash(pattern)
    except TypeError as error:
        raise fail(
            f"{what} is not hashable ({error}); backends cache layouts by pattern, so make it a "
            "frozen dataclass: @dataclass(frozen=True)",
            disagree=False,
        ) from error


def _grid(view: str, value: object, q_len: int, kv_len: int, fail) -> Tensor:
    """A view's answer on the whole grid, checked to be a bool tensor of that shape."""
    if not isinstance(value, Tensor) or value.dtype != torch.bool:
        kind = value.dtype if isinstance(value, Tensor) else type(value).__name__
        raise fail(f"{view} returned {kind}, not a bool tensor", disagree=False)
    try:
        return torch.broadcast_to(value, (q_len, kv_len))
    except RuntimeError:
        raise fail(
            f"{view} returned shape {tuple(value.shape)}, not [{q_len}, {kv_len}] (q_len x kv_len)",
            disagree=False,
        ) from None


def _call(view: str, where: str, fail, function, *args):
    """A view's answer, or a PatternCheckError naming the view when it raises."""
    try:
        return function(*args)
    except Exception as error:
        detail = f": {error}" if str(error) else ""
        raise fail(
            f"{view} raised {type(error).__name__} {where}{detail}", disagree=False
        ) from error


def _first_difference(view: str, got: Tensor, truth: Tensor, q_len: int, kv_len: int, fail):
    if not torch.equal(got, truth):
        i, j = torch.nonzero(got != truth)[0].tolist()
        says = "allows" if got[i, j] else "rejects"
        position = i + kv_len - q_len
        raise fail(
            f"{view} {says} query {i} (position {position}) x key {j} at q_len={q_len}, "
            f"kv_len={kv_len}, but allowed() {'rejects' if got[i, j] else 'allows'} it"
        )


def _check_shape(p: Pattern, q_len: int, kv_len: int, blocks, fail) -> None:
    """Every check of a pattern not chosen by content at one shape: its whole views, its parts,
    then ``block_state`` of each piece in each token order at each block size."""
    where = f"at q_len={q_len}, kv_len={kv_len}"
    q_pos, k_pos = query_positions(q_len, kv_len), torch.arange(kv_len)
    truth = _check_views(p, q_pos, k_pos, where, fail)
    parts = _call("parts()", where, fail, p.parts)
    part_truths = _check_parts(p, parts, truth, q_pos, k_pos, where, fail)
    pieces = _pieces(p, parts, part_truths, truth, fail)
    _check_block_states(pieces, blocks, q_len, kv_len, fail)


def _check_views(p: Pattern, q_pos: Tensor, k_pos: Tensor, where: str, fail) -> Tensor:
    """The allowed pairs (q_len, kv_len), checked to equal ``dense()`` and the ``mask_mod``
    that FlexAttention runs."""
    q_len, kv_len = q_pos.shape[0], k_pos.shape[0]
    allowed = _call("allowed()", where, fail, p.allowed, q_pos[:, None], k_pos[None, :])
    truth = _grid("allowed()", allowed, q_len, kv_len, fail)
    dense = _grid(
        "dense()", _call("dense()", where, fail, p.dense, q_len, kv_len), q_len, kv_len, fail
    )
    _first_difference("dense()", dense, truth, q_len, kv_len, fail)
    mask_mod = _call("mask_mod", where, fail, p.mask_mod, q_len, kv_len)
    flex = _call(
        "mask_mod", where, fail, mask_mod, 0, 0, torch.arange(q_len)[:, None], k_pos[None, :]
    )
    flex = _grid("mask_mod", flex, q_len, kv_len, fail)
    _first_difference("mask_mod", flex, truth, q_len, kv_len, fail)
    return truth


def _check_parts(
    p: Pattern, parts, truth: Tensor, q_pos: Tensor, k_pos: Tensor, where: str, fail
) -> list[Tensor]:
    """Each part's allowed pairs, checked like the pattern's: parts are disjoint pieces whose
    union is the pattern (backends run each on its own and add them up)."""
    if len(parts) == 1 and parts[0] is p:
        return [truth]
    q_len, kv_len = truth.shape
    part_truths, count = [], torch.zeros(q_len, kv_len, dtype=torch.int32)
    for n, part in enumerate(parts, start=1):
        name = f"part {n} of {len(parts)} ({_short(part, 60)})"
        _check_hashable(part, name, fail)
        allowed = _call(
            f"{name} allowed()", where, fail, part.allowed, q_pos[:, None], k_pos[None, :]
        )
        part_truth = _grid(f"{name} allowed()", allowed, q_len, kv_len, fail)
        part_dense = _call(f"{name} dense()", where, fail, part.dense, q_len, kv_len)
        part_dense = _grid(f"{name} dense()", part_dense, q_len, kv_len, fail)
        _first_difference(f"{name} dense()", part_dense, part_truth, q_len, kv_len, fail)
        part_truths.append(part_truth)
        count += part_truth
    overlap = torch.nonzero(count > 1)
    if overlap.numel():
        i, j = overlap[0].tolist()
        raise fail(
            f"parts() overlap at query {i} (position {i + kv_len - q_len}) x key {j} {where}; "
            "parts must be disjoint"
        )
    _first_difference("the union of parts()", count > 0, truth, q_len, kv_len, fail)
    return part_truths


def _pieces(p: Pattern, parts, part_truths: list[Tensor], truth: Tensor, fail) -> list[tuple]:
    """(piece, its allowed pairs, token order's stride, name in messages) for each piece in each
    token order a backend runs it in: flex runs the whole pattern in the natural order, blocked
    runs each part in its own order. A composition may run a piece in a third order
    (``p | strided(stride=3)`` excludes p's pairs in the stride-3 order), so that too."""
    pieces = [(p, truth, 1, "")] if len(parts) > 1 or parts[0] is not p else []
    for n, (part, part_truth) in enumerate(zip(parts, part_truths, strict=True), start=1):
        stride = part.stride
        if not isinstance(stride, Tiles) and (
            isinstance(stride, bool) or not isinstance(stride, int) or stride < 1
        ):
            raise fail(f"stride must be a positive int or Tiles, got {stride!r}", disagree=False)
        name = "" if part is p else f"part {n} of {len(parts)} ({_short(part, 60)}) "
        for s in sorted({1, stride, OTHER_STRIDE}, key=order_key):
            pieces.append((part, part_truth, s, name))
    return pieces


def _check_block_states(pieces: list[tuple], blocks, q_len: int, kv_len: int, fail) -> None:
    """``block_state`` of each piece in its token order at each block size; the prefix sums of
    a piece's pairs are computed once per (piece, order) and shared by the block sizes."""
    sums: dict[tuple, Tensor] = {}  # prefix sums per (piece, stride), see below
    for bq, bk in blocks:
        for part, part_truth, stride, name in pieces:
            frame = build_frame(stride, q_len, kv_len, bq, bk, CPU)
            # A tiled order depends on the block size too (each block is a tile).
            key = (id(part_truth), stride, (bq, bk) if isinstance(stride, Tiles) else None)
            if key not in sums:
                sums[key] = _prefix_sums(part_truth, frame)
            _check_blocks(part, part_truth, sums[key], frame, name, fail)


def _prefix_sums(truth: Tensor, frame: Frame) -> Tensor:
    """2-D prefix sums of the allowed pairs with tokens in the frame's order (by slot), which is
    the same for every block size: a block's tokens are then a contiguous range."""
    q_order, k_order = torch.argsort(frame.q.slot_of), torch.argsort(frame.k.slot_of)
    dtype = torch.int32 if truth.numel() < 2**31 else torch.int64
    sums = torch.zeros(truth.shape[0] + 1, truth.shape[1] + 1, dtype=dtype)
    sums[1:, 1:] = truth[q_order][:, k_order].to(dtype).cumsum(0).cumsum(1)
    return sums


def _block_bounds(axis: Axis) -> tuple[Tensor, Tensor]:
    """Each block's first and past-the-end token in the frame's order."""
    slots = torch.sort(axis.slot_of).values
    edges = torch.searchsorted(slots, torch.arange(axis.num_blocks + 1) * axis.block)
    return edges[:-1], edges[1:]


def _span_words(axis: Axis, block: int) -> str:
    valid = axis.valid.view(-1, axis.block)[block]
    pos = axis.position.view(-1, axis.block)[block][valid]
    if pos.numel() == 0:
        return "padding only"
    lo, hi = int(pos.min()), int(pos.max())
    words = f"position {lo}" if lo == hi else f"positions {lo}..{hi}"
    if axis.step > 1 and lo != hi:
        words += f" step {axis.step}"
    if not bool(valid.all()):
        words += f", {int((~valid).sum())} padding slots"
    return words


def _check_blocks(part, truth, sums: Tensor, frame: Frame, name: str, fail) -> None:
    """``block_state`` of one piece in one frame against the allowed pairs ``truth`` (``sums``:
    their prefix sums in the frame's order)."""
    q, k = frame.q, frame.k
    q_len, kv_len = truth.shape
    shape = (q.num_blocks, k.num_blocks)
    view = f"{name}block_state"
    where = f"at q_len={q_len}, kv_len={kv_len}, blocks {q.block}x{k.block}, stride {frame.stride}"
    state = _call(view, where, fail, part.block_state, q.spans().column(), k.spans().row())
    if not isinstance(state, Tensor) or state.shape != shape:
        got = tuple(state.shape) if isinstance(state, Tensor) else type(state).__name__
        raise fail(
            f"{view} returned {got}, not one state per query block x key block {list(shape)}",
            disagree=False,
        )
    state = state.to(torch.int64)
    odd = ~torch.isin(state, torch.tensor([EMPTY, PARTIAL, FULL]))
    if odd.any():
        value = int(state[odd][0])
        raise fail(f"{view} returned {value}; states are EMPTY, PARTIAL or FULL", disagree=False)
    # Allowed pairs per block from the prefix sums (frames of a large stride are mostly padding
    # slots, so the counts never materialize the frame's slot grid).
    (q0, q1), (k0, k1) = _block_bounds(q), _block_bounds(k)
    q_tokens, k_tokens = q1 - q0, k1 - k0
    q0, q1, k0, k1 = q0[:, None], q1[:, None], k0[None, :], k1[None, :]
    count = sums[q1, k1] - sums[q0, k1] - sums[q1, k0] + sums[q0, k0]
    some = count > 0
    every = (count == q_tokens[:, None] * k_tokens[None, :]) & (q_tokens == q.block)[:, None]
    every &= (k_tokens == k.block)[None, :]
    wrong = ((state == FULL) & ~every) | ((state == EMPTY) & some)
    if not wrong.any():
        return
    qb, kb = torch.nonzero(wrong)[0].tolist()
    claim = STATES[int(state[qb, kb])]
    order = "" if frame.stride == 1 else f", in the stride-{frame.stride} token order"
    if isinstance(frame.stride, Tiles):
        order = f", in the tiled token order {frame.stride}"
    if frame.stride not in (1, part.stride):
        order += f" (where a union or intersection with a stride-{frame.stride} pattern runs it)"
    block = f"block {q.block}" if q.block == k.block else f"blocks {q.block}x{k.block}"
    head = (
        f"{view} says {claim} for query block {qb} ({_span_words(q, qb)}) x key block {kb} "
        f"({_span_words(k, kb)}) at q_len={q_len}, kv_len={kv_len}, {block}{order}, but "
    )
    q_slots = torch.arange(qb * q.block, (qb + 1) * q.block)
    k_slots = torch.arange(kb * k.block, (kb + 1) * k.block)
    tile_valid = q.valid[q_slots][:, None] & k.valid[k_slots][None, :]
    tile = truth[q.index[q_slots]][:, k.index[k_slots]] & tile_valid
    if claim == "FULL":
        witness = torch.nonzero(tile_valid & ~tile)
        if not witness.numel():
            raise fail(
                head + "the block holds padding slots, and a block with padding may be at most "
                "PARTIAL (state_from in zoo.patterns.base takes care of it)"
            )
        tail = "allowed() rejects"
        hint = "a FULL block must have every pair allowed"
    else:
        witness = torch.nonzero(tile)
        tail = "allowed() accepts"
        hint = "an EMPTY block must have no pair allowed"
    i, j = witness[0].tolist()
    q_at, k_at = int(q.position[qb * q.block + i]), int(k.position[kb * k.block + j])
    raise fail(head + f"{tail} (q={q_at}, k={k_at}); {hint}, and PARTIAL is always safe")
