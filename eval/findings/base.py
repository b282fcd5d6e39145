"""What a finding is: a published claim, the presets that test it, and the verdicts on its
parts, judged from the presets' results by the published protocol (each cell at the best of its
learning-rate sweep, eval/harness/selection.py).

A claim's verdict is ``not learned`` when a cell it reads did not learn a slice within its
pattern's reach (eval/harness/verdict.py: whatever its loss does, and whether or not the numbers
meet the claim: a model that did not learn what it can reach says nothing about what the variant
can do); otherwise ``agrees`` when the measured values meet it, and when they do not, ``not
converged`` if a cell it reads did not converge (eval/harness/convergence.py) and ``disagrees``
if every one did; ``not run`` when a preset has no results yet. A cell that fails only where its
pattern cannot reach (``cannot``) is a measurement, and its claims are judged on their numbers.
The thresholds that turn a paper's words into a test ("about 1.0", "near chance") are written
once, here, and shown with every verdict.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..harness.config import load_config
from ..harness.convergence import CONVERGED, training_state
from ..harness.learned import record_verdict
from ..harness.report import mean, read_results
from ..harness.run import RunConfig, results_file
from ..harness.selection import choose
from ..harness.verdict import NOT_LEARNED as CELL_NOT_LEARNED

AGREES, DISAGREES, NOT_CONVERGED, NOT_RUN = "agrees", "disagrees", "not converged", "not run"
NOT_LEARNED = "not learned"
# "about 1.0" in a paper's words: at least this accuracy.
NEAR_ONE = 0.9
# "near chance": within this of the accuracy of always answering the most frequent target.
NEAR_CHANCE = 0.1
# "better than": by at least this much accuracy.
MARGIN = 0.1


@dataclass
class Claim:
    """One published statement, what was measured for it, and the verdict."""

    claim: str
    measured: str
    verdict: str


@dataclass
class Judgement:
    """A finding's claims, the tables that show the measured values, and its figures (a
    matplotlib Figure, the file name to save it under, its caption)."""

    claims: list[Claim]
    tables: list[str] = field(default_factory=list)
    figures: list[tuple[Any, str, str]] = field(default_factory=list)
    measured_on: str = ""  # the machines, versions and commits of the records judged
    # role -> the chosen records not learned at their train length (to train further)
    not_learned: dict[str, list[dict[str, Any]]] = field(default_factory=dict)

    @property
    def verdict(self) -> str:
        verdicts = {c.verdict for c in self.claims}
        for verdict in (NOT_RUN, DISAGREES, NOT_LEARNED, NOT_CONVERGED):
            if verdict in verdicts:
                return verdict
        return AGREES


@dataclass
class Finding:
    """A published finding and the presets that reproduce it."""

    name: str
    title: str
    source: str  # the paper(s), with the table or figure
    published: str  # the published numbers, as markdown
    # role -> preset (eval/configs/findings/*.yaml); the judge reads records by role
    configs: dict[str, str]
    gpu_configs: dict[str, str]  # the same roles at the published size, for the GPU campaign
    # (role -> its chosen records, role -> preset) -> the judgement
    judge: Callable[[dict[str, list[dict[str, Any]]], dict[str, str]], Judgement]

    def results_path(self, config: str, root: Path) -> Path:
        """Where a preset's results are, relative to ``root`` (the repository)."""
        return results_file(load_config(RunConfig, root / config))

    def presets(self, gpu: bool = False) -> dict[str, str]:
        return self.gpu_configs if gpu else self.configs

    def evaluate(self, root: Path, gpu: bool = False) -> Judgement:
        """Judge the finding from its presets' results under ``root`` (the GPU twins' with
        ``gpu``); a preset not run yet gives no records, and the claims that read it are
        ``not run``, naming the command that runs it."""
        chosen = {}
        for role, config in self.presets(gpu).items():
            path = root / self.results_path(config, root)
            records = read_results(path) if path.exists() else []
            chosen[role] = [r for s in choose(records) for r in s.chosen]
        judgement = self.judge(chosen, self.presets(gpu))
        judgement.measured_on = provenance([r for rs in chosen.values() for r in rs])
        judgement.not_learned = {
            role: [r for r in records if not_learned([r])] for role, records in chosen.items()
        }
        return judgement


def provenance(records: list[dict[str, Any]]) -> str:
    """Where the records were measured: each distinct device, torch version, threads and commit."""
    seen = []
    for r in records:
        env = r.get("environment", {})
        where = (
            f"{env.get('device', '?')}, torch {env.get('torch', '?')}, "
            f"{env.get('threads', '?')} thread(s) per cell, commit {env.get('commit') or '?'}"
        )
        if where not in seen:
            seen.append(where)
    return "; ".join(seen)


def not_run(what: str, missing: list[str], config: str) -> Claim:
    """The claim for a preset whose cells have no successful results yet."""
    return Claim(what, f"no results for {', '.join(missing)}: python -m eval run {config}", NOT_RUN)


def not_learned(
    records: list[dict[str, Any]], at: int | None = None, keep: Callable[[str], bool] | None = None
) -> bool:
    """Whether a record is "not learned" (eval/harness/verdict.py) at test length ``at`` (its
    train length by default), on the slice values ``keep`` accepts (all by default)."""
    return any(
        r.get("status") == "ok" and record_verdict(r, at, keep).verdict == CELL_NOT_LEARNED
        for r in records
    )


def verdict(
    holds: bool,
    records: list[dict[str, Any]],
    at: int | None = None,
    keep: Callable[[str], bool] | None = None,
) -> str:
    """NOT_LEARNED when a record it reads is not learned (at test length ``at``, on the slice
    values ``keep`` accepts); else AGREES when the claim holds; otherwise NOT_CONVERGED if one
    of the records did not converge, else DISAGREES."""
    return verdict_all([(holds, records, at, keep)])


def verdict_all(parts: list[tuple]) -> str:
    """The verdict on a claim about several cells, each part (whether it holds, the records it
    reads[, the test length, the slice values judged]): NOT_LEARNED when a part reads a record
    that is not learned; else AGREES when every part holds, DISAGREES when a part fails on
    cells that converged, NOT_CONVERGED when the parts that fail have a cell that did not."""
    if any(not_learned(*part[1:]) for part in parts):
        return NOT_LEARNED
    failing = [records for holds, records, *_ in parts if not holds]
    if not failing:
        return AGREES
    if any(all(training_state(r) == CONVERGED for r in records) for records in failing):
        return DISAGREES
    return NOT_CONVERGED


def by_variant(records: list[dict[str, Any]], key: str = "variant") -> dict[str, list[dict]]:
    """Successful records grouped by a cell field (the variant or the encoding)."""
    out: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        if r.get("status") == "ok":
            out.setdefault(r["cell"][key], []).append(r)
    return out


def chance(records: list[dict[str, Any]]) -> float:
    """The accuracy of always answering the most frequent training target, over the records."""
    return mean([r.get("chance_accuracy") for r in records]) or 0.0


def training_of(records: list[dict[str, Any]]) -> str:
    """The training states and verdicts of the records, with the chosen learning rates."""
    return ", ".join(
        f"lr {r['cell']['train']['lr']:g}: {training_state(r)}, {record_verdict(r).verdict}"
        for r in records
    )
