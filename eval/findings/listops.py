"""The ListOps ordering of Long Range Arena: full attention, BigBird and Longformer well above
local attention, which scores about what a constant guess does.

ListOps is hard for small models: LRA's Transformer reaches 36% after 5K steps at 2K tokens. A
CPU trains shorter sequences for fewer steps, so the judgement shows each variant's learning
curve and verdict (eval/harness/verdict.py) beside the claims. The label needs every token of the
expression, and the pooled output can only read it from a position that reaches them all: full
attention, Longformer's global token and BigBird's global blocks do within two layers; local
attention's blocks never do (it *cannot*). A variant that reaches the expression and scores short
of learned is *not learned*, whatever its loss did, and so is every claim that reads it, never
*disagrees*. "Local scores about a constant guess" is LRA's contrast with variants that learned
the task; it reads them too, since where none did, local's level is the level of the token
statistics every variant shares.
"""

from __future__ import annotations

from typing import Any

from ..harness.learned import record_verdict
from ..harness.plots import new_figure
from ..harness.report import fmt, mean
from .base import (
    MARGIN,
    NEAR_CHANCE,
    NOT_LEARNED,
    Claim,
    Finding,
    Judgement,
    by_variant,
    chance,
    not_run,
    training_of,
    verdict,
    verdict_all,
)

FULL, LOCAL, SPARSE = "full", "block_local", ("longformer", "bigbird")


def judge(chosen: dict[str, list[dict[str, Any]]], presets: dict[str, str]) -> Judgement:
    records = chosen["listops"]
    cells = by_variant(records)
    missing = [v for v in (FULL, LOCAL, *SPARSE) if v not in cells]
    if missing:
        return Judgement([not_run("the preset's cells", missing, presets["listops"])])
    accuracy = {v: mean([r["accuracy"][str(r["cell"]["train_len"])] for r in rs])
                for v, rs in cells.items()}  # fmt: skip
    level = chance(records)
    strong = (FULL, *SPARSE)
    claims = [
        Claim(
            f"full, Longformer and BigBird score well above local (by >= {MARGIN}; LRA: 36.37, "
            "35.63, 36.05 against 15.82)",
            ", ".join(f"{v} {fmt(accuracy[v])}" for v in (*strong, LOCAL)),
            verdict_all(
                [(accuracy[v] >= accuracy[LOCAL] + MARGIN, cells[v] + cells[LOCAL]) for v in strong]
            ),
        ),
        Claim(
            f"local scores about a constant guess (within {NEAR_CHANCE} of {level:.3f}; LRA: "
            "15.82, the constant guess about 17), where full, Longformer and BigBird learn",
            f"local {fmt(accuracy[LOCAL])}",
            verdict(
                abs(accuracy[LOCAL] - level) <= NEAR_CHANCE,
                cells[LOCAL] + [r for v in strong for r in cells[v]],
            ),
        ),
        Claim(
            f"full, Longformer and BigBird score alike (within {MARGIN}; LRA: 35.63-36.37)",
            ", ".join(f"{v} {fmt(accuracy[v])}" for v in strong),
            verdict(
                max(accuracy[v] for v in strong) - min(accuracy[v] for v in strong) <= MARGIN,
                [r for v in strong for r in cells[v]],
            ),
        ),
    ]
    from zoo.views.tables import markdown_table

    rows = [[v, fmt(accuracy[v]), reach_of(cells[v]), training_of(cells[v])]
            for v in (*strong, LOCAL)]  # fmt: skip
    table = markdown_table(
        ["variant", "accuracy", "whole expression within reach", "chosen lr: training, verdict"],
        rows,
    )
    depths = {v: by_depth(cells[v]) for v in (*strong, LOCAL)}
    levels = sorted({d for by in depths.values() for d in by})
    per_depth = markdown_table(
        ["variant", *(f"depth {d}" for d in levels)],
        [[v, *(fmt(by.get(d)) for d in levels)] for v, by in depths.items()],
    )
    fig = figure(cells)
    return Judgement(
        claims,
        [table, DEPTH + per_depth],
        [(fig, "listops_curves.png", "ListOps training loss")],
    )


def reach_of(records: list[dict[str, Any]]) -> str:
    """Whether some position reaches every token of the expression, over the depth slices of the
    records (eval/harness/needs.py): "every one", "none", or the reaches found."""
    found = sorted({s.reach for r in records for s in record_verdict(r).slices})
    if found == ["reachable"]:
        return "every one"
    if found == ["out of reach"]:
        return "none"
    return ", ".join(found) or "-"


DEPTH = (
    "Accuracy by the expression's nesting depth (the root operator is depth 1): a model that "
    "evaluates the tree keeps its accuracy as depth grows; one that reads statistics of the "
    "tokens (which digits and operators occur) does well on shallow trees only.\n\n"
)


def by_depth(records: list[dict[str, Any]]) -> dict[int, float]:
    """Accuracy per nesting depth at the train length (the ``depth`` slice), over records."""
    depths: dict[int, list[float]] = {}
    for r in records:
        slices = r.get("slices", {}).get(str(r["cell"]["train_len"]), {})
        for depth, value in slices.get("depth", {}).items():
            depths.setdefault(int(depth), []).append(value)
    return {d: mean(v) for d, v in sorted(depths.items())}


def figure(cells: dict[str, list[dict[str, Any]]]) -> Any:
    """The training loss of each variant's chosen cell against the fraction of steps, with the
    marginal loss (a model that ignores its input) as a line; each legend entry names the
    cell's verdict, a "not learned" one dotted."""
    fig, (ax,) = new_figure(1, width=6.5, height=4)
    marginal = []
    for variant, records in cells.items():
        for r in records:
            curve = r.get("loss_curve") or []
            xs = [(i + 0.5) / len(curve) for i in range(len(curve))]
            said = record_verdict(r).verdict
            ax.plot(xs, curve, linestyle=":" if said == NOT_LEARNED else "-",
                    label=f"{variant} (lr {r['cell']['train']['lr']:g}): {said}")  # fmt: skip
            marginal.append(r.get("marginal_loss"))
    level = mean(marginal)
    if level is not None:
        ax.axhline(level, color="black", linewidth=0.8, label=f"marginal ({level:.2f} nats)")
    ax.set(xlabel="fraction of training steps", ylabel="training loss (nats)",
           title="ListOps: training loss of each chosen cell")  # fmt: skip
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    return fig


FINDING = Finding(
    name="listops",
    title="The ListOps ordering",
    source="Tay et al., Long Range Arena, 2020, Table 1",
    published=(
        "ListOps accuracy (%): Transformer 36.37, Longformer 35.63, BigBird 36.05, Sparse "
        "Transformer 17.07, local attention 15.82; ten classes, the most frequent about 17% of "
        "labels. Expressions of 500 to 2000 tokens; 4 layers, d = 512 (or the smaller 2 layers, "
        "d = 64), 5K steps."
    ),
    configs={"listops": "eval/configs/findings/listops.yaml"},
    gpu_configs={"listops": "eval/configs/findings/listops_gpu.yaml"},
    judge=judge,
)
