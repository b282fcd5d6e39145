"""Whether a cell's training converged, read from its loss curve, so that a report never shows
"did not learn" as "cannot".

A trained cell records ``loss_curve`` (the training loss averaged over 20 equal spans of its
steps) and ``marginal_loss`` (the loss of a model that ignores its input and predicts the
training targets' class frequencies: their entropy). Its training is:

* ``no better than the marginal`` when the last span's loss is above 95% of the marginal loss:
  the model learned (next to) nothing about the inputs;
* ``still falling`` when the loss of the last tenth of the steps is more than 5% below that of
  the tenth before it, and lower by more than 1% of the marginal loss (so the noise of a loss
  near zero does not count): more steps would have helped;
* ``converged`` otherwise; ``unknown`` for records written before the curve was recorded.
"""

from __future__ import annotations

import statistics
from typing import Any

CONVERGED = "converged"
STILL_FALLING = "still falling"
AT_MARGINAL = "no better than the marginal"
UNKNOWN = "unknown"


def training_state(record: dict[str, Any]) -> str:
    """One of CONVERGED, STILL_FALLING, AT_MARGINAL or UNKNOWN for a result record."""
    curve, marginal = record.get("loss_curve"), record.get("marginal_loss")
    if record.get("status") != "ok" or not curve or len(curve) < 4 or not marginal:
        return UNKNOWN
    return curve_state(curve, marginal)


def curve_state(curve: list[float], marginal: float) -> str:
    """CONVERGED, STILL_FALLING or AT_MARGINAL for a loss curve (``train.loss_curve``) and the
    marginal loss."""
    if curve[-1] > 0.95 * marginal:
        return AT_MARGINAL
    return STILL_FALLING if loss_falls(curve, marginal) else CONVERGED


def loss_falls(curve: list[float], marginal: float) -> bool:
    """Whether the loss of the curve's last tenth fell from the tenth before it
    (``still_falling``), whatever its level: what training with ``until: learned`` reads from the
    curve of its steps so far before it stops. A curve of one point does not fall."""
    if len(curve) < 2:
        return False
    tenth = max(1, len(curve) // 10)
    late = statistics.fmean(curve[-tenth:])
    before = statistics.fmean(curve[-2 * tenth : -tenth])
    return still_falling(before, late, marginal)


def still_falling(before: float, late: float, marginal: float) -> bool:
    """Whether a loss that went from ``before`` to ``late`` (over equal spans of steps) still
    falls: by more than 5% of itself and by more than 1% of the marginal loss."""
    return before - late > 0.05 * before and before - late > 0.01 * marginal
