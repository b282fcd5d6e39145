"""A machine-independent cost for the report's plots: attention (query, key) pairs per sequence at
the train length, for one head of one layer (every head and layer of the harness's models has the
same pattern, so the model's total is this times heads x depth).

How each kind of variant is counted (``PairCount.basis``):

* ``exact``: a fixed pattern (``local``, ``bigbird``, ``causal``, the 2-D patterns...): the
  allowed pairs of the variant's pattern with the cell's parameters, intersected with causal when
  the cell is causal, counted exactly by ``zoo.allowed_pairs`` (the count ``zoo.views.comparison``
  and the kernel benchmarks, ``eval.bench.sweep.allowed_pairs_for``, report). A 2-D pattern
  without ``grid`` in its parameters is counted on the square grid the zoo takes from the length,
  the grid the harness passes for square images (pathfinder).
* ``budget``: keys chosen by content, counted as the keys each query may attend, summed over
  queries. ``moba``: its own block (causally, when causal) and ``top_k - 1`` other blocks of
  ``block_size``, or every available key when fewer than ``top_k`` blocks are available (causal:
  exactly what the zoo attends; non-causal: an upper bound, as a short last block may be chosen).
  ``nsa``: the sum of its three branches' scores: compressed keys whose window has ended,
  ``select_count`` blocks of ``select_block`` (its own one causally) and the sliding ``window``.
* ``scores``: a mechanism that forms scores against other rows than the keys: ``linformer``,
  n x proj_len (each query against the projected keys); ``nystrom``, the entries of its three
  softmaxes, 2·n·m + m² with m = min(num_landmarks, n).
* ``flop-equivalent``: a mechanism that forms no scores: its cost per head over that of one
  pair, 4·d FLOPs (the benchmarks' 4·B·H·pairs·D). ``linear``: n·d (the registry's O(n·d²) / d);
  ``performer``: n·m (O(n·m·d) / d, m features, d·ln d by default). These two need the head
  width: a row or cell's ``head_dim``, or its ``model`` (dim / heads).
* ``unknown``: no count (``pairs`` is None), with the reason: a graph's pairs come with each
  input, the row lacks its variant parameters, a variant the zoo does not know.

``pair_count`` is cached per distinct cell (variant, parameters, train length, causal, head
width).
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from typing import Any

EXACT, BUDGET, SCORES, FLOP_EQUIVALENT, UNKNOWN = (
    "exact",
    "budget",
    "scores",
    "flop-equivalent",
    "unknown",
)


@dataclass(frozen=True)
class PairCount:
    """Attention pairs per sequence, one head of one layer, or None; ``basis`` says how they
    were counted (see the module docstring) and ``note`` says it in one line for a plot."""

    pairs: int | None
    basis: str
    note: str = ""


def cell_of(row: dict[str, Any]) -> tuple[str, dict[str, Any] | None, int, bool | None, int | None]:
    """(variant, variant parameters, train length, causal, head width) of a flat row of
    ``eval.harness.report.rows`` or of a results record's cell; a missing key is None."""
    head_dim = row.get("head_dim")
    model = row.get("model")
    if head_dim is None and isinstance(model, dict) and model.get("dim") and model.get("heads"):
        head_dim = model["dim"] // model["heads"]
    return (
        row["variant"],
        row.get("variant_params"),
        row["train_len"],
        row.get("causal"),
        head_dim,
    )


def pair_count(row: dict[str, Any]) -> PairCount:
    """The ``PairCount`` of a flat row or a cell (see ``cell_of`` for the keys read)."""
    variant, params, n, causal, head_dim = cell_of(row)
    if params is None:
        return PairCount(None, UNKNOWN, "the row holds no variant parameters")
    if causal is None:
        return PairCount(None, UNKNOWN, "the row does not say whether it is causal")
    return count_pairs(variant, params, n, causal, head_dim)


def attention_pairs(row: dict[str, Any]) -> int | None:
    """Attention pairs per sequence at the train length, one head of one layer, of a flat row
    or a cell; None where they cannot be counted (``pair_count`` says why)."""
    return pair_count(row).pairs


def count_pairs(
    variant: str,
    params: dict[str, Any],
    train_len: int,
    causal: bool,
    head_dim: int | None = None,
) -> PairCount:
    """The ``PairCount`` of a variant with these parameters at this length (cached per cell)."""
    frozen = json.dumps(params, sort_keys=True, default=repr)
    return _count(variant, frozen, int(train_len), bool(causal), head_dim)


@functools.lru_cache(maxsize=1024)
def _count(variant: str, frozen: str, n: int, causal: bool, head_dim: int | None) -> PairCount:
    import zoo

    params = json.loads(frozen)
    try:
        if variant in zoo.list_mechanisms():
            return _mechanism(
                variant, {**zoo.get_mechanism_spec(variant).parameters(), **params}, n, head_dim
            )
        if variant in zoo.list_modules():
            if variant == "nsa":
                return _nsa({**zoo.get_module_spec(variant).parameters(), **params}, n)
            return PairCount(None, UNKNOWN, f"{variant}: a module the cost does not count")
        if variant not in zoo.list_variants():
            return PairCount(None, UNKNOWN, f"{variant}: not a variant of the zoo")
        from zoo.functional import resolve_pattern

        pattern = resolve_pattern(variant, causal, dict(params))
        if pattern.routed:
            if variant == "moba":
                return _moba({**zoo.get_spec(variant).parameters(), **params}, n, causal)
            return PairCount(None, UNKNOWN, f"{variant}: pairs depend on each input")
        return PairCount(zoo.allowed_pairs(pattern, n, n), EXACT)
    except (ValueError, TypeError) as error:
        return PairCount(None, UNKNOWN, f"{variant}: {error}")


def _mechanism(variant: str, params: dict[str, Any], n: int, head_dim: int | None) -> PairCount:
    if variant == "linformer":
        k = int(params["proj_len"])
        return PairCount(n * k, SCORES, f"{variant}: n·proj_len scores (projected keys)")
    if variant == "nystrom":
        m = min(int(params["num_landmarks"]), n)
        return PairCount(
            2 * n * m + m * m, SCORES, f"{variant}: 2·n·m + m² scores (m = {m} landmarks)"
        )
    if variant == "linear":
        if head_dim is None:
            return PairCount(None, UNKNOWN, f"{variant}: needs the head width")
        return PairCount(
            n * head_dim, FLOP_EQUIVALENT, f"{variant}: n·d, FLOP-equivalent (O(n·d²) / d)"
        )
    if variant == "performer":
        m = params.get("num_features")
        if m is None:
            if head_dim is None:
                return PairCount(None, UNKNOWN, f"{variant}: needs the head width")
            m = int(head_dim * math.log(head_dim))
        return PairCount(
            n * int(m), FLOP_EQUIVALENT, f"{variant}: n·m, FLOP-equivalent (O(n·m·d) / d)"
        )
    return PairCount(None, UNKNOWN, f"{variant}: a mechanism the cost does not count")


def _moba(params: dict[str, Any], n: int, causal: bool) -> PairCount:
    b, k = int(params["block_size"]), int(params["top_k"])
    blocks = -(-n // b)
    total = 0
    for t in range(n):
        own = t // b
        if causal:
            total += t + 1 if own + 1 <= k else (k - 1) * b + t - own * b + 1
        else:
            total += n if blocks <= k else min(n, min(b, n - own * b) + (k - 1) * b)
    return PairCount(total, BUDGET, "moba: budget, top_k blocks of block_size keys per query")


def _nsa(params: dict[str, Any], n: int) -> PairCount:
    """NSA is causal by definition: query t's compressed, selected and window keys."""
    length, stride = int(params["block_length"]), int(params["block_stride"])
    block, count = int(params["select_block"]), int(params["select_count"])
    local, window = int(params["num_local"]), int(params["window"])
    windows = (n - length) // stride + 1 if n >= length else 0
    total = 0
    for t in range(n):
        total += 0 if t < length - 1 else min(windows, (t - length + 1) // stride + 1)
        own = t // block
        if own + 1 <= count:
            total += t + 1
        elif local >= 1:  # its own block is chosen: attended causally
            total += (count - 1) * block + t - own * block + 1
        else:
            total += count * block
        total += min(t + 1, window)
    return PairCount(
        total, BUDGET, "nsa: budget, compressed + select_count·select_block + window keys"
    )
