"""Published findings the harness reproduces, each a preset (eval/configs/findings/) and a judge
that sets the measured values beside the published ones with a verdict (eval/findings/base.py).

``python -m eval findings`` writes ``eval/results/findings/report.md`` and its plots from the
presets' committed results; run a preset first with ``python -m eval run <its config>``.
"""

from __future__ import annotations

from .base import (
    AGREES,
    DISAGREES,
    NOT_CONVERGED,
    NOT_LEARNED,
    NOT_RUN,
    Claim,
    Finding,
    Judgement,
)
from .extrapolation import FINDING as EXTRAPOLATION
from .listops import FINDING as LISTOPS
from .mqar_gap import FINDING as MQAR_GAP

FINDINGS: dict[str, Finding] = {f.name: f for f in (MQAR_GAP, EXTRAPOLATION, LISTOPS)}

__all__ = [
    "AGREES", "DISAGREES", "FINDINGS", "NOT_CONVERGED", "NOT_LEARNED", "NOT_RUN", "Claim",
    "Finding", "Judgement",
]  # fmt: skip
