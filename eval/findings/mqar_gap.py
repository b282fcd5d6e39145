"""MQAR recall per gap (Zoology): full attention recalls at every distance, a sliding window only
within its reach, a routed pattern with the window's key budget beyond it.

The window's reach is computed from its pattern (eval/harness/reach.py, eval/harness/needs.py):
a query needs its key's first occurrence and the value after it, and ``depth`` stacked layers of
a causal window of the query and the ``w`` keys before it (``window_size: [w, 0]``) relay
information from up to ``depth * w`` positions back. A gap bucket (distances ``b`` to
``2b - 1``) is *within reach* when every evaluated query's key and value are within its reach,
*beyond* when none is; a bucket the reach cuts is judged in neither. Every claim also reads the
cells' verdicts (eval/harness/verdict.py): a window that has not learned the buckets within its
reach makes its claims "not learned", whatever its loss did; failing beyond its reach is what
it cannot do, the claim's point.
"""

from __future__ import annotations

from typing import Any

from ..harness.learned import record_verdict
from ..harness.plots import new_figure
from ..harness.reach import pattern_reach
from ..harness.report import fmt, mean
from ..harness.verdict import OUT_OF_REACH, REACHABLE
from .base import (
    MARGIN,
    NEAR_CHANCE,
    NEAR_ONE,
    NOT_LEARNED,
    Claim,
    Finding,
    Judgement,
    by_variant,
    chance,
    not_run,
    verdict,
)

FULL, WINDOW, ROUTED = "full", "local", "moba"
LAWS = {
    "zoology": "Zoology's gap law (power_a 0.01)",
    "uniform": "uniform gaps (power_a 1)",
    "spread": "pairs spread over the first half (kv_layout spread, power_a 0.01)",
}
# Where each preset's pairs lie, which is what MoBA's choice has to find.
PAIRS = {
    "zoology": "the pairs lie in its first blocks",
    "uniform": "the pairs lie in its first blocks",
    "spread": "each pair in a block of the first half: chosen by content",
}


def gap_accuracy(records: list[dict[str, Any]]) -> dict[int, float]:
    """Accuracy per gap bucket (its lower bound) at the train length, averaged over records."""
    buckets: dict[int, list[float]] = {}
    for r in records:
        gaps = r["slices"][str(r["cell"]["train_len"])].get("gap", {})
        for bucket, accuracy in gaps.items():
            buckets.setdefault(int(bucket), []).append(accuracy)
    return {b: mean(v) for b, v in sorted(buckets.items())}


def buckets(record: dict[str, Any]) -> tuple[list[int], list[int]]:
    """(within, beyond): the gap buckets whose every answer, and whose none, the cell's pattern
    reaches through its depth (a bucket the reach cuts is in neither)."""
    slices = record_verdict(record).slices
    within = sorted(int(s.value) for s in slices if s.reach == REACHABLE)
    beyond = sorted(int(s.value) for s in slices if s.reach == OUT_OF_REACH)
    return within, beyond


def span(record: dict[str, Any], depth: int) -> int | None:
    """How far back the last query of a cell's sequence reaches through ``depth`` layers of its
    pattern (None where the reach is not known from positions)."""
    cell = record["cell"]
    n = cell["train_len"]
    reach = pattern_reach(
        cell["variant"], cell["variant_params"], n, cell.get("causal", False), depth,
        cell["model"].get("heads", 1),
    )  # fmt: skip
    if reach.basis != "exact":
        return None
    return n - 1 - int(reach.matrix()[n - 1].nonzero().min())


def judge(chosen: dict[str, list[dict[str, Any]]], presets: dict[str, str]) -> Judgement:
    claims, rows, panels = [], [], []
    for role, law in LAWS.items():
        cells = by_variant(chosen[role])
        missing = [v for v in (FULL, WINDOW, ROUTED) if v not in cells]
        if missing:
            claims.append(not_run(f"{law}: the preset's cells", missing, presets[role]))
            continue
        gaps = {v: gap_accuracy(cells[v]) for v in (FULL, WINDOW, ROUTED)}
        window = cells[WINDOW][0]
        depth = window["cell"]["model"]["depth"]
        one_layer, stack = span(window, 1), span(window, depth)
        within, beyond = buckets(window)
        level = chance(chosen[role])
        full_low = min(gaps[FULL].values())
        # every bucket within reach, as full attention's every gap (a mean hid a bucket at 0.707)
        window_in = min((gaps[WINDOW][b] for b in within), default=None)
        window_out = mean([gaps[WINDOW][b] for b in beyond])
        routed_out = mean([gaps[ROUTED][b] for b in beyond])
        claims += [
            Claim(
                f"{law}: full attention recalls at every gap (about 1.0: >= {NEAR_ONE})",
                f"lowest bucket {fmt(full_low)}",
                verdict(full_low >= NEAR_ONE, cells[FULL]),
            ),
            Claim(
                f"{law}: a sliding window recalls within its reach (the buckets its pattern "
                f"reaches through {depth} layers: >= {NEAR_ONE})",
                f"lowest of buckets {within}: {fmt(window_in)}",
                verdict(window_in is not None and window_in >= NEAR_ONE, cells[WINDOW]),
            ),
            Claim(
                f"{law}: ... and is near chance beyond it (within {NEAR_CHANCE} of "
                f"{level:.3f})",
                f"buckets {beyond}: {fmt(window_out)}",
                verdict(window_out is not None and window_out <= level + NEAR_CHANCE,
                        cells[WINDOW]),
            ),
            Claim(
                f"{law}: with the window's key budget, MoBA recalls beyond the window's reach "
                f"better than the window (by >= {MARGIN}; {PAIRS[role]})",
                f"beyond: moba {fmt(routed_out)}, window {fmt(window_out)}",
                verdict(
                    None not in (routed_out, window_out) and routed_out >= window_out + MARGIN,
                    cells[ROUTED] + cells[WINDOW],
                ),
            ),
        ]  # fmt: skip
        values = sorted(gaps[FULL])
        said = {v: ", ".join(record_verdict(r).verdict for r in cells[v]) for v in gaps}
        for v in (FULL, WINDOW, ROUTED):
            lr = ", ".join(f"{r['cell']['train']['lr']:g}" for r in cells[v])
            rows.append([law, v, lr, said[v], *(fmt(gaps[v].get(b)) for b in values)])
        panels.append((law, gaps, one_layer, stack, level, said))
    tables = []
    if rows:
        from zoo.views.tables import markdown_table

        values = sorted({b for _, gaps, *_ in panels for b in gaps[FULL]})
        headers = ["gap law", "variant", "chosen lr", "verdict", *(f"gap {b}" for b in values)]
        tables.append(markdown_table(headers, [r + [""] * (len(headers) - len(r)) for r in rows]))
    figures = [(figure(panels), "mqar_gap.png", "MQAR accuracy per gap")] if panels else []
    return Judgement(claims, tables, figures)


def figure(panels: list[tuple]) -> Any:
    """Accuracy per gap bucket, one panel per gap law, the window's reach and chance marked, and
    each variant's verdict in its legend entry (a "not learned" one dotted, with crosses)."""
    fig, axes = new_figure(len(panels), width=5.5, height=4)
    for ax, (law, gaps, one_layer, stack, level, said) in zip(axes, panels, strict=True):
        for variant, marker in ((FULL, "o"), (WINDOW, "s"), (ROUTED, "^")):
            xs = sorted(gaps[variant])
            unlearned = NOT_LEARNED in said[variant]
            ax.plot(
                xs,
                [gaps[variant][x] for x in xs],
                marker="x" if unlearned else marker,
                linestyle=":" if unlearned else "-",
                label=f"{variant}: {said[variant]}",
            )
        for where, style, what in ((one_layer, ":", "one layer"), (stack, "--", "stacked")):
            if where is not None:
                ax.axvline(where, color="grey", linestyle=style,
                           label=f"window's reach, {what} ({where} back)")  # fmt: skip
        ax.axhline(level, color="black", linewidth=0.8, label=f"chance ({level:.3f})")
        ax.set(xscale="log", xlabel="gap from key to query (bucket's lower bound)",
               ylabel="accuracy", title=law, ylim=(-0.02, 1.02))  # fmt: skip
        ax.set_xticks(sorted(gaps[FULL]), labels=[str(b) for b in sorted(gaps[FULL])])
        ax.minorticks_off()
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small", loc="lower left")
    return fig


FINDING = Finding(
    name="mqar-gap",
    title="Multi-query associative recall per gap",
    source="Arora et al., Zoology, 2023 (MQAR)",
    published=(
        "Full attention solves MQAR, about 1.0 at every size from (N 64, 4 pairs) up. "
        "Not published, tested here from the patterns' reach: a sliding window recalls the "
        "keys within its reach through the model's depth and is near chance beyond it; MoBA, "
        "with the window's key budget, recalls beyond it. MQAR puts every key-value pair in "
        "the first 2 x pairs tokens, so MoBA's choice only has to find the blocks holding them "
        "(at N 64 with 4 pairs, 2 blocks of 4 of its top 4): a test of choosing those blocks. "
        "The spread preset (not Zoology's layout) puts each pair at a random place in the "
        "first half, where MoBA must choose the block that holds the query's key by content."
    ),
    configs={
        "zoology": "eval/configs/findings/mqar_gap_zoology.yaml",
        "uniform": "eval/configs/findings/mqar_gap_uniform.yaml",
        "spread": "eval/configs/findings/mqar_gap_spread.yaml",
    },
    gpu_configs={
        "zoology": "eval/configs/findings/mqar_gap_zoology_gpu.yaml",
        "uniform": "eval/configs/findings/mqar_gap_uniform_gpu.yaml",
        "spread": "eval/configs/findings/mqar_gap_spread_gpu.yaml",
    },
    judge=judge,
)
