"""``python -m eval findings [NAME ...] [--out DIR]``: each published finding beside what the
harness measured, with a verdict per claim (agrees / disagrees / not learned / not converged /
not run).

Reads the results of each finding's presets (eval/configs/findings/*.yaml, run with
``python -m eval run``) and writes ``report.md`` and the plots to ``--out``
(eval/results/findings by default).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from zoo.views.tables import markdown_table

from . import FINDINGS, Finding, Judgement

ROOT = Path(__file__).resolve().parents[2]


def section(finding: Finding, judgement: Judgement, out: Path, gpu: bool = False) -> str:
    """One finding's markdown: the claim and its source, the verdicts, the tables and plots."""
    commands = "\n".join(f"    python -m eval run {c}" for c in finding.presets(gpu).values())
    claims = markdown_table(
        ["claim", "measured", "verdict"],
        [[c.claim, c.measured, f"**{c.verdict}**"] for c in judgement.claims],
    )
    text = (
        f"## {finding.title}: {judgement.verdict}\n\n"
        f"**Published** ({finding.source}): {finding.published}\n\n"
        f"**Run:**\n\n{commands}\n\n"
        + (f"Measured on {judgement.measured_on}.\n\n" if judgement.measured_on else "")
        + f"{claims}\n"
    )
    text += further(finding, judgement, gpu)
    for table in judgement.tables:
        text += f"\n{table}\n"
    for fig, name, caption in judgement.figures:
        fig.savefig(out / name, dpi=100)
        text += f"\n![{caption}]({name})\n"
    return text


def further(finding: Finding, judgement: Judgement, gpu: bool = False) -> str:
    """The chosen cells that are not learned at their train length, each preset's with the
    command that trains them further (``train.until=learned``, four times the steps as budget)."""
    text = ""
    for role, records in judgement.not_learned.items():
        if not records:
            continue
        steps = max(r["cell"]["train"].get("steps", 0) for r in records)
        cells = ", ".join(
            f"{r['cell']['variant']}+{r['cell']['encoding']} (lr {r['cell']['train']['lr']:g}, "
            f"{r.get('steps_taken', r['cell']['train'].get('steps'))} steps)"
            for r in records
        )
        text += (
            f"\nNot learned at the train length ({finding.presets(gpu)[role]}): {cells}. "
            "Not a result; train further with\n\n"
            f"    python -m eval run {finding.presets(gpu)[role]} train.until=learned "
            f"train.max_steps={4 * steps}\n"
        )
    return text


def write_findings(names: list[str], out: Path, root: Path = ROOT, gpu: bool = False) -> str:
    """Judge the named findings from the results of their presets (or of their GPU twins) and
    write ``report.md`` and the plots to ``out``; returns the markdown."""
    out.mkdir(parents=True, exist_ok=True)
    parts = ["# Findings: published results beside the harness's\n"]
    parts.append(
        "Each cell at the best of its learning-rate sweep, judged against what its pattern "
        "reaches through the model's depth (eval/harness/verdict.py): *learned* (every slice well "
        "above chance), *cannot* (what it fails lies out of its reach) or *not learned* (a slice "
        "within reach short of learned, whatever the loss does). A claim that reads a cell not "
        "learned reads *not learned*: not a finding, with the command that trains it further; "
        "one that fails where a cell did not converge reads *not converged*; never *disagrees*. "
        "Thresholds: eval/findings/base.py, eval/harness/verdict.py.\n"
    )
    for name in names:
        finding = FINDINGS[name]
        parts.append(section(finding, finding.evaluate(root, gpu), out, gpu))
    text = "\n".join(parts)
    (out / "report.md").write_text(text)
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m eval findings", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "names", nargs="*", help=f"findings to judge (default all: {list(FINDINGS)})"
    )
    parser.add_argument(
        "--gpu", action="store_true", help="judge the GPU twins' results (the published sizes)"
    )
    parser.add_argument(
        "--out", default=None, help="default eval/results/findings (with --gpu: findings-gpu)"
    )
    args = parser.parse_intermixed_args(argv)  # options among the names
    default = "eval/results/findings-gpu" if args.gpu else "eval/results/findings"
    out = Path(args.out) if args.out else ROOT / default
    unknown = [n for n in args.names if n not in FINDINGS]
    if unknown:
        print(f"error: unknown finding(s) {unknown}; known: {list(FINDINGS)}", file=sys.stderr)
        return 2
    print(write_findings(args.names or list(FINDINGS), out, gpu=args.gpu))
    return 0
