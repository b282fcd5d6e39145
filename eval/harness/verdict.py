"""A cell's verdict at one length: what it learned, judged against what its pattern can reach.

A plateau is not a result. A loss that stopped falling says nothing about whether the model
*can* answer: MQAR learns through a phase transition, and before it the loss sits flat for
thousands of steps. What the harness knows that a generic trainer does not is the pattern: from
it each slice of the test set (MQAR's gap buckets, induction's distances, ...) is

* ``reachable``: every answer's needed positions are within its query's reach through the
  model's depth (eval/harness/reach.py, eval/harness/needs.py);
* ``out of reach``: no answer's are;
* ``partly``: some answers' are (the slice is not judged either way);
* ``content-dependent``: the pattern chooses its keys by content (MoBA), so the needed positions
  are among those it *may* choose, and whether it does is part of what it learns;
* ``unknown``: no reach is known (a task or variant the harness cannot read).

Each judged slice is at one of three levels of accuracy against chance ``c`` (the accuracy of
always answering the most frequent training target), over its ``n`` evaluated answers:

* ``at chance``: at most ``c + Z * sqrt(c (1 - c) / n)``: a guesser right with probability c
  scores above that once in about 740 slices (a one-sided normal tail at Z = 3 standard errors);
* ``learned``: at least ``c + LEARNED_SHARE * (1 - c)``, halfway from chance to every answer
  right, and above the chance bound: the model answers more than half of what it cannot guess;
* ``above chance``: between the two, something learned but not the slice.

A slice with fewer than ``MIN_EXAMPLES`` answers is not judged (too few for either bound).

The cell's verdict:

* ``not learned``: a reachable (or content-dependent) slice is not learned, whatever the loss
  does. Never a finding: the cell needs more training (``train.until: learned``).
* ``cannot``: every reachable slice is learned, and the slices it fails are out of reach: the
  pattern's limit, measured.
* ``learned``: every judged slice is learned.
* ``undecided``: no slice decides (none judged, or no reach known and a slice not learned).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

LEARNED, CANNOT, NOT_LEARNED, UNDECIDED = "learned", "cannot", "not learned", "undecided"
REACHABLE, PARTLY, OUT_OF_REACH, CONTENT_DEPENDENT, UNKNOWN_REACH = (
    "reachable", "partly", "out of reach", "content-dependent", "unknown",
)  # fmt: skip
AT_CHANCE, ABOVE_CHANCE = "at chance", "above chance"

# Standard errors above chance that an accuracy must pass not to be "at chance".
Z = 3.0
# "Well above chance": this share of the way from chance to every answer right.
LEARNED_SHARE = 0.5
# Slices with fewer evaluated answers are not judged.
MIN_EXAMPLES = 20


def chance_bound(chance: float, count: int) -> float:
    """The highest accuracy still ``at chance`` over ``count`` answers."""
    return chance + Z * math.sqrt(max(chance * (1 - chance), 0.0) / max(count, 1))


def learned_bound(chance: float) -> float:
    """The lowest accuracy that is ``learned``."""
    return chance + LEARNED_SHARE * (1 - chance)


def level(accuracy: float, chance: float, count: int) -> str:
    """LEARNED, AT_CHANCE or ABOVE_CHANCE for an accuracy over ``count`` answers."""
    if accuracy <= chance_bound(chance, count):
        return AT_CHANCE
    if accuracy >= learned_bound(chance):
        return LEARNED
    return ABOVE_CHANCE


def reach_label(in_reach: int | None, count: int, basis: str) -> str:
    """A slice's reach from how many of its ``count`` answers have their needs in reach
    (``in_reach`` None: unknown), and the reach's basis (eval/harness/reach.py)."""
    if in_reach is None or basis == "unknown":
        return UNKNOWN_REACH
    if in_reach == 0:
        return OUT_OF_REACH
    if in_reach < count:
        return PARTLY
    return CONTENT_DEPENDENT if basis == "content" else REACHABLE


@dataclass
class SliceVerdict:
    """One value of a slice: its accuracy, answers, reach, level and what it says (LEARNED,
    NOT_LEARNED, CANNOT, or None where it is not judged)."""

    name: str
    value: str
    accuracy: float
    count: int | None
    in_reach: int | None
    reach: str
    level: str | None
    says: str | None


@dataclass
class CellVerdict:
    """A cell's verdict at one length, the reason in words, and its slices."""

    verdict: str
    reason: str
    slices: list[SliceVerdict] = field(default_factory=list)

    def failing(self, says: str) -> list[str]:
        """The values of the slices that say ``says``."""
        return [s.value for s in self.slices if s.says == says]


def judge_slice(
    name: str,
    value: str,
    accuracy: float,
    count: int | None,
    in_reach: int | None,
    basis: str,
    chance: float,
) -> SliceVerdict:
    """What one slice value says about the cell (see the module docstring)."""
    known = count if count is not None else 0
    reach = reach_label(in_reach, known, basis) if count is not None else UNKNOWN_REACH
    if count is None or count < MIN_EXAMPLES:
        return SliceVerdict(name, value, accuracy, count, in_reach, reach, None, None)
    found = level(accuracy, chance, count)
    if reach == PARTLY:
        says = None
    elif found == LEARNED:
        says = LEARNED
    elif reach in (REACHABLE, CONTENT_DEPENDENT):
        says = NOT_LEARNED
    elif reach == OUT_OF_REACH:
        says = CANNOT
    else:  # unknown reach, not learned: cannot tell "not learned" from "cannot"
        says = UNDECIDED
    return SliceVerdict(name, value, accuracy, count, in_reach, reach, found, says)


def judge(slices: list[SliceVerdict]) -> CellVerdict:
    """The cell's verdict from its judged slices."""

    def named(items: list[SliceVerdict]) -> str:
        return ", ".join(f"{s.name} {s.value} {s.accuracy:.3f} ({s.level})" for s in items)

    missed = [s for s in slices if s.says == NOT_LEARNED]
    if missed:
        return CellVerdict(NOT_LEARNED, f"within reach: {named(missed)}", slices)
    if any(s.says == UNDECIDED for s in slices):
        undecided = [s for s in slices if s.says == UNDECIDED]
        return CellVerdict(UNDECIDED, f"reach unknown: {named(undecided)}", slices)
    # Out of reach yet above chance: what the pattern cannot carry reached the answer anyway
    # (a shortcut in the task?), said beside the verdict, which stands: a guesser passes the
    # chance bound once in about 740 slices.
    shortcut = [s for s in slices if s.reach == OUT_OF_REACH and s.level in (ABOVE_CHANCE, LEARNED)]
    note = f"; above chance out of reach (a shortcut in the task?): {named(shortcut)}"
    note = note if shortcut else ""
    beyond = [s for s in slices if s.says == CANNOT]
    if beyond:
        return CellVerdict(CANNOT, f"out of reach: {named(beyond)}{note}", slices)
    if any(s.says == LEARNED for s in slices):
        return CellVerdict(LEARNED, f"every judged slice learned{note}", slices)
    return CellVerdict(UNDECIDED, "no slice judged", slices)


def judge_cell(
    name: str,
    accuracies: dict[str, float],
    reach: dict[str, list[int | None]] | None,
    basis: str,
    chance: float,
    keep=None,
) -> CellVerdict:
    """The verdict of one slice family ``name`` at one length: ``accuracies`` value ->
    accuracy, ``reach`` value -> [answers in reach, answers] (None: unknown), ``basis`` the
    reach's, ``chance`` the constant guess; ``keep`` (a predicate on values) restricts the
    slices judged."""
    judged = []
    for value, accuracy in accuracies.items():
        if keep is not None and not keep(value):
            continue
        in_reach, count = (reach or {}).get(value, [None, None])
        judged.append(judge_slice(name, value, accuracy, count, in_reach, basis, chance))
    return judge(judged)
