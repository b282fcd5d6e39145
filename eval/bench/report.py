"""What the benchmark derives from its cells: sparsity realization, fitted exponents, the goals.

Sparsity realization = (dense time / cell time) / (all pairs / allowed pairs): the speed-up over
the dense peer as a fraction of the speed-up that skipping the disallowed pairs could give; 1.0 is
ideal. The dense peer is ``sdpa_dense`` at the same point: SDPA without a mask, causal at causal
points. At a causal point FlashAttention already skips the blocks above the diagonal, so "all
pairs" is then the causal count n(n+1)/2: a causal sparse variant is measured against what a
causal dense kernel already saves, not against n^2.

Fitted exponent: the least-squares slope of log(value) against log(n) over the ``last`` largest
lengths that succeeded (3 by default): the growth the sweep actually shows at scale, printed
beside the complexity that registry.yaml states.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import zoo

Cell = dict[str, Any]
SeriesKey = tuple[str, str, str, bool]  # variant, backend, pass, causal

GOAL_VARIANTS = ("local", "longformer", "bigbird")


def all_pairs(n: int, causal: bool) -> int:
    """The pairs a dense kernel computes: n^2, or n(n+1)/2 for a causal point."""
    return n * (n + 1) // 2 if causal else n * n


def sparsity_realization(
    dense_ms: float | None, ms: float | None, total_pairs: int, pairs: int | None
) -> float | None:
    """(dense_ms / ms) / (total_pairs / pairs); None where a figure is missing."""
    if not dense_ms or not ms or not pairs or not total_pairs:
        return None
    return (dense_ms / ms) / (total_pairs / pairs)


def realize(cell: Cell, dense: Cell | None) -> None:
    """Fill a cell's dense_time_ms and sparsity_realization from the dense peer's cell."""
    if cell["status"] != "ok" or dense is None or dense["status"] != "ok":
        return
    cell["dense_time_ms"] = dense["time_ms"]
    cell["sparsity_realization"] = sparsity_realization(
        dense["time_ms"], cell["time_ms"], cell["all_pairs"], cell["allowed_pairs"]
    )


def fit_exponent(
    ns: Sequence[float], values: Sequence[float | None], last: int = 3
) -> float | None:
    """Slope of log(value) on log(n) over the ``last`` largest n with a positive value."""
    points = sorted((n, v) for n, v in zip(ns, values, strict=True) if v is not None and v > 0)
    points = points[-last:]
    if len({n for n, _ in points}) < 2:
        return None
    xs = [math.log(n) for n, _ in points]
    ys = [math.log(v) for _, v in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx


def series_name(cell: Cell) -> str:
    """The cell's backend, or its peer's name; "xformers (peer)" for a peer named as a zoo
    backend is (xFormers run bare beside the zoo's xformers backend), so that the two never
    share a series, a table row or a merge key."""
    name = cell["backend"]
    if cell.get("kind") == "peer" and name in (*zoo.list_backends(), "auto"):
        return f"{name} (peer)"
    return name


def series(cells: Sequence[Cell]) -> dict[SeriesKey, list[Cell]]:
    """Cells by (variant, backend or peer, pass, causal), each list sorted by n."""
    out: dict[SeriesKey, list[Cell]] = defaultdict(list)
    for c in cells:
        out[(c["variant"], series_name(c), c["pass"], c["causal"])].append(c)
    return {k: sorted(v, key=lambda c: c["n"]) for k, v in out.items()}


def backend_label(cells: Sequence[Cell]) -> str:
    """The backend's name, with the backends it chose for "auto": "auto (flex)"."""
    name = series_name(cells[0])
    chosen = sorted({c["resolved"] for c in cells if c["resolved"] and c["resolved"] != name})
    return f"{name} ({', '.join(chosen)})" if chosen else name


def stated_complexity(variant: str) -> str:
    try:
        if variant in zoo.list_mechanisms():
            return zoo.get_mechanism_spec(variant).complexity or "-"
        return zoo.get_spec(variant).complexity or "-"
    except ValueError:
        return "-"


def exponents(cells: Sequence[Cell], last: int = 3) -> list[dict[str, Any]]:
    """Fitted time and memory exponents of every series with at least two successful lengths."""
    rows = []
    for (variant, backend, pass_, causal), members in series(cells).items():
        ok = [c for c in members if c["status"] == "ok"]
        ns = [c["n"] for c in ok]
        time_exp = fit_exponent(ns, [c["time_ms"] for c in ok], last)
        if time_exp is None:
            continue
        memory_exp = fit_exponent(ns, [c["peak_memory_mb"] for c in ok], last)
        rows.append({
            "variant": variant, "backend": backend, "label": backend_label(members),
            "pass": pass_, "causal": causal, "time_exponent": time_exp,
            "memory_exponent": memory_exp, "lengths": sorted(ns)[-last:],
            "complexity": stated_complexity(variant),
        })  # fmt: skip
    return rows


def goal_line(label: str, value: float | None, op: str, target: float, unit: str = "") -> str:
    """'label: value (goal op target): met/missed by margin', or 'not measured'."""
    if value is None:
        return f"- {label}: not measured (goal {op} {target:g}{unit})"
    met = value <= target if op == "<=" else value >= target if op == ">=" else value < target
    margin = abs(target - value)
    verdict = "met" if met else "missed"
    goal = f"goal {op} {target:g}{unit}"
    return f"- {label}: {value:.3g}{unit} ({goal}): {verdict} by {margin:.3g}{unit}"


def _ok(cells: Sequence[Cell], variant: str, backend: str | None, pass_: str, causal: bool):
    """The successful cells of one series (any backend if None), by n."""
    found = [
        c for c in cells
        if c["status"] == "ok" and c["variant"] == variant and c["pass"] == pass_
        and c["causal"] == causal and backend in (None, c["backend"])
    ]  # fmt: skip
    return sorted(found, key=lambda c: c["n"])


def gpu_goals(cells: Sequence[Cell], exps: Sequence[dict[str, Any]]) -> list[str]:
    """The issue's GPU goals for local, longformer and bigbird with auto, fwd+bwd, each at the
    largest length where its figures exist."""
    lines = []
    for variant in GOAL_VARIANTS:
        for causal in sorted({c["causal"] for c in cells}):
            auto = _ok(cells, variant, "auto", "fwd+bwd", causal)
            if not auto:
                continue
            name = f"{variant}, auto, fwd+bwd, {'causal' if causal else 'non-causal'}"
            flex = {c["n"]: c for c in _ok(cells, variant, "flex_standard", "fwd+bwd", causal)}
            common = [c for c in auto if c["n"] in flex]
            ratio, at = None, ""
            if common:
                ratio = common[-1]["time_ms"] / flex[common[-1]["n"]]["time_ms"]
                at = f", n={common[-1]['n']}"
            lines.append(goal_line(f"{name}{at}: time / flex_standard", ratio, "<=", 1))
            realized = [c for c in auto if c["sparsity_realization"] is not None]
            value, at = None, ""
            if realized:
                value, at = realized[-1]["sparsity_realization"], f", n={realized[-1]['n']}"
            lines.append(goal_line(f"{name}{at}: sparsity realization", value, ">=", 0.7))
            fit = [
                e for e in exps
                if (e["variant"], e["backend"], e["pass"], e["causal"])
                == (variant, "auto", "fwd+bwd", causal)
            ]  # fmt: skip
            value = fit[0]["memory_exponent"] if fit else None
            over = f" over n={fit[0]['lengths']}" if fit else ""
            lines.append(goal_line(f"{name}: memory exponent{over}", value, "<=", 1.1))
            top = auto[-1]
            lines.append(
                goal_line(f"{name}, n={top['n']}: mask build", top["mask_build_ms"], "<", 10, " ms")
            )
    return lines or ["- no fwd+bwd cells of local, longformer or bigbird with backend auto"]


CPU_GOAL_VARIANTS = ("local", "longformer", "bigbird", "strided", "dilated", "block_local")
WINDOWED = ("local", "longformer", "bigbird", "dilated", "block_local")  # O(n) pairs


def _fit(exps, variant: str, backend: str, pass_: str, causal: bool) -> dict[str, Any] | None:
    found = [
        e for e in exps
        if (e["variant"], e["backend"], e["pass"], e["causal"]) == (variant, backend, pass_, causal)
    ]  # fmt: skip
    return found[0] if found else None


def cpu_goals(cells: Sequence[Cell], exps: Sequence[dict[str, Any]], n: int = 8192) -> list[str]:
    """The CPU goals of the blocked backend at n, for each variant the sweep holds: forward
    realization >= 0.5, forward + backward >= 0.4, forward time no more than compiled
    FlexAttention's (the faster of its two masks); time exponents <= 1.15 (windowed variants)
    and memory exponents <= 1.1, fitted over the sweep's largest lengths."""
    lines = []
    present = {c["variant"] for c in cells}
    for variant in [v for v in CPU_GOAL_VARIANTS if v in present]:
        for causal in sorted({c["causal"] for c in cells}):
            name = f"{variant}, blocked, {'causal' if causal else 'non-causal'}"
            for pass_, target in (("fwd", 0.5), ("fwd+bwd", 0.4)):
                at_n = [c for c in _ok(cells, variant, "blocked", pass_, causal) if c["n"] == n]
                value = at_n[0]["sparsity_realization"] if at_n else None
                lines.append(goal_line(f"{name}, {pass_}, n={n}: realization", value, ">=", target))
            mine = [c for c in _ok(cells, variant, "blocked", "fwd", causal) if c["n"] == n]
            flex = [
                c["time_ms"] for backend in ("flex", "flex_standard")
                for c in _ok(cells, variant, backend, "fwd", causal) if c["n"] == n
            ]  # fmt: skip
            ratio = mine[0]["time_ms"] / min(flex) if mine and flex else None
            lines.append(goal_line(f"{name}, fwd, n={n}: time / compiled flex", ratio, "<=", 1))
            for pass_ in ("fwd", "fwd+bwd"):
                fit = _fit(exps, variant, "blocked", pass_, causal)
                over = f" over n={fit['lengths']}" if fit else ""
                label = f"{name}, {pass_}"
                if variant in WINDOWED:
                    value = fit["time_exponent"] if fit else None
                    lines.append(goal_line(f"{label}: time exponent{over}", value, "<=", 1.15))
                value = fit["memory_exponent"] if fit else None
                lines.append(goal_line(f"{label}: memory exponent{over}", value, "<=", 1.1))
    return lines or ["- no cells of " + ", ".join(CPU_GOAL_VARIANTS) + " on blocked"]


def goals(cells: Sequence[Cell], exps: Sequence[dict[str, Any]], device_type: str) -> list[str]:
    """The goal lines that apply to this device, computed from the cells."""
    return gpu_goals(cells, exps) if device_type == "cuda" else cpu_goals(cells, exps)
