"""Extrapolation of positions (Mamba's induction table; ALiBi): trained at one length, tested at
2x to 8x, absolute positions fail first, rotary soon after, distance biases hold.

The verdicts read each encoding's accuracy at the train length and at every test length ("2x" is
the first test length at least twice the train length, and so on).

And what each cell learned (eval/harness/verdict.py), where its pattern (full causal attention)
reaches every distance at every length. Every claim reads its cells at the train length, where
they must have learned for anything after to mean something. A claim about an encoding of
*distance* (rotary, the biases) at a longer length also reads that encoding's cells there, on
the distances seen in training (buckets wholly below the train length), whether the claim is
that accuracy holds or that it falls: a miss there is "not learned" at that length (more keys to
spread attention over), which says nothing of how the encoding reaches distances never trained
on, so it neither agrees nor disagrees. Absolute positions are judged on their numbers: at a
longer length the query's own position was never trained on, at any distance, and that is what
their claim is about.
"""

from __future__ import annotations

from typing import Any

from ..harness.learned import record_verdict
from ..harness.plots import new_figure
from ..harness.report import fmt, mean
from .base import (
    NEAR_ONE,
    NOT_RUN,
    Claim,
    Finding,
    Judgement,
    by_variant,
    chance,
    not_learned,
    not_run,
    verdict_all,
)

ABSOLUTE, ROTARY, BIASES = ("sinusoidal", "learned"), "rope", ("alibi", "t5")


def curve(records: list[dict[str, Any]]) -> dict[int, float]:
    """Accuracy per test length, averaged over the records."""
    lengths: dict[int, list[float]] = {}
    for r in records:
        for length, accuracy in r["accuracy"].items():
            lengths.setdefault(int(length), []).append(accuracy)
    return {n: mean(v) for n, v in sorted(lengths.items())}


def at(points: dict[int, float], train_len: int, factor: int) -> float | None:
    """Accuracy at the first tested length at least ``factor`` times the train length."""
    length = length_at(points, train_len, factor)
    return None if length is None else points[length]


def length_at(points: dict[int, float], train_len: int, factor: int) -> int | None:
    """The first tested length at least ``factor`` times the train length."""
    longer = [n for n in points if n >= factor * train_len]
    return min(longer) if longer else None


def trained(train_len: int):
    """The distance buckets wholly below the train length: distances seen in training."""
    return lambda bucket: 2 * int(bucket) - 1 < train_len


def ordered(at: dict[str, float | None]) -> bool:
    """Distance biases above rotary above absolute positions, in accuracy ``at`` a length."""
    if at[ROTARY] is None:
        return False
    return min(at[e] or 0 for e in BIASES) > at[ROTARY] > max(at[e] or 0 for e in ABSOLUTE)


def judge(chosen: dict[str, list[dict[str, Any]]], presets: dict[str, str]) -> Judgement:
    records = chosen["extrapolation"]
    cells = by_variant(records, key="encoding")
    missing = [e for e in (*ABSOLUTE, ROTARY, *BIASES) if e not in cells]
    if missing:
        return Judgement([not_run("the preset's cells", missing, presets["extrapolation"])])
    train_len = records[0]["cell"]["train_len"]
    curves = {e: curve(cells[e]) for e in cells}
    one = {e: curves[e][train_len] for e in curves}
    x2, x4, x8 = ({e: at(curves[e], train_len, f) for e in curves} for f in (2, 4, 8))
    second, fourth, eighth = (length_at(curves[ROTARY], train_len, f) for f in (2, 4, 8))
    seen = trained(train_len)

    def judged(lengths: dict[str, int | None], parts: list[tuple]) -> str:
        """The verdict on ``parts``, or NOT_RUN where a length the claim reads was not tested."""
        return NOT_RUN if None in lengths.values() else verdict_all(parts)

    def untested(lengths: dict[str, int | None]) -> str:
        """What the measured column adds where a length the claim reads was not tested."""
        gone = [factor for factor, n in lengths.items() if n is None]
        return f"; no test length at {' or '.join(gone)} the train length" if gone else ""

    rope_2x = x2[ROTARY] is not None and x2[ROTARY] > max(x2[e] or 0 for e in ABSOLUTE)
    rope_8x = x8[ROTARY] is not None and x8[ROTARY] < one[ROTARY] / 2
    every = [r for e in cells for r in cells[e]]
    absolute = [r for e in ABSOLUTE for r in cells[e]]
    claims = [
        Claim(
            f"at the train length every encoding solves induction (Mamba: 100; >= {NEAR_ONE})",
            ", ".join(f"{e} {fmt(one[e])}" for e in curves),
            verdict_all([(one[e] >= NEAR_ONE, cells[e]) for e in curves]),
        ),
        Claim(
            "absolute positions do not extrapolate: at 4x below half their train-length "
            "accuracy (Mamba: 100 / 58.6 / 26.6 / 18.8 at 1x / 2x / 4x / 8x)",
            ", ".join(f"{e} {fmt(x4[e])}" for e in ABSOLUTE) + untested({"4x": fourth}),
            judged(
                {"4x": fourth},
                [(x4[e] is not None and x4[e] < one[e] / 2, cells[e]) for e in ABSOLUTE],
            ),
        ),
        Claim(
            "rotary holds more at 2x than absolute positions, and fails by 8x "
            "(Mamba: 83.6 against 58.6 at 2x; 18.4 at 8x)",
            f"2x: rope {fmt(x2[ROTARY])}, absolute best {fmt(max(x2[e] or 0 for e in ABSOLUTE))}; "
            f"8x: rope {fmt(x8[ROTARY])}"
            + on_trained_distances(cells, (ROTARY,), second, train_len)
            + on_trained_distances(cells, (ROTARY,), eighth, train_len)
            + untested({"2x": second, "8x": eighth}),
            judged(
                {"2x": second, "8x": eighth},
                [
                    (rope_2x, cells[ROTARY] + absolute),
                    (rope_2x, cells[ROTARY], second, seen),
                    (rope_8x, cells[ROTARY], eighth, seen),
                ],
            ),
        ),
        Claim(
            "distance biases extrapolate: ALiBi (one head: its one slope 2^-8, a bias of 0.25 at "
            "64 tokens, where the paper's 8 heads start at 1/2) and T5 keep their accuracy at 8x "
            "(within 0.1; "
            "ALiBi's perplexity at 512 / 1012 / 2512 / 15512 tokens trained at 512: 19.73 / "
            "18.73 / 18.41 / 18.31, T5 19.65 / 18.79 / 20.41)",
            ", ".join(f"{e} {fmt(one[e])} -> {fmt(x8[e])}" for e in BIASES)
            + on_trained_distances(cells, BIASES, eighth, train_len)
            + untested({"8x": eighth}),
            judged(
                {"8x": eighth},
                [
                    part
                    for e in BIASES
                    for holds in [x8[e] is not None and x8[e] >= one[e] - 0.1]
                    for part in ((holds, cells[e]), (holds, cells[e], eighth, seen))
                ],
            ),
        ),
        Claim(
            "at 2x the order is: distance biases above rotary above absolute positions (ALiBi, "
            "trained at 512, perplexity at 1012: ALiBi 18.73, T5 18.79, rotary 21.37, "
            "sinusoidal 43.54)",
            f"2x: biases >= {fmt(min(x2[e] or 0 for e in BIASES))}, rope {fmt(x2[ROTARY])}, "
            f"absolute <= {fmt(max(x2[e] or 0 for e in ABSOLUTE))}"
            + on_trained_distances(cells, (ROTARY, *BIASES), second, train_len)
            + untested({"2x": second}),
            judged(
                {"2x": second},
                [(ordered(x2), every)]
                + [(ordered(x2), cells[e], second, seen) for e in (ROTARY, *BIASES)],
            ),
        ),
    ]
    from zoo.views.tables import markdown_table

    lengths = sorted({n for c in curves.values() for n in c})
    rows = [
        [e, ", ".join(f"{r['cell']['train']['lr']:g}" for r in cells[e]),
         *(fmt(curves[e].get(n)) for n in lengths)]
        for e in curves
    ]  # fmt: skip
    table = markdown_table(["encoding", "chosen lr", *(f"test {n}" for n in lengths)], rows)
    longest = lengths[-1]
    split = [
        [e, *(fmt(v) for v in by_distance(cells[e], longest, train_len)),
         record_verdict(cells[e][0], longest, seen).verdict]
        for e in curves
    ]  # fmt: skip
    why = markdown_table(
        [
            "encoding",
            f"at {longest}: distances < {train_len} (trained)",
            f"distances >= {train_len} (never trained)",
            "verdict on the trained distances",
        ],
        split,
    )
    unlearned = {
        e: [n for n in lengths if not_learned(cells[e], n, seen if n != train_len else None)]
        for e in curves
    }
    fig = figure(curves, train_len, chance(records), unlearned)
    return Judgement(
        claims, [table, WHY + why], [(fig, "extrapolation.png", "accuracy against test length")]
    )


WHY = (
    "Where an encoding fails at a longer length, the distance from the first special token to "
    "the query says why: failures at distances the model was trained on are *not learned* at "
    "that length (more keys to attend among, positions never seen; eval/harness/verdict.py), "
    "failures only beyond them point at the encoding's extrapolation of distance.\n\n"
)


def on_trained_distances(
    cells: dict[str, list[dict[str, Any]]], encodings: tuple[str, ...], length: int | None,
    train_len: int,
) -> str:  # fmt: skip
    """What a claim read at test ``length`` on the distances seen in training: each encoding's
    accuracy there and its verdict ("" where no length was tested)."""
    if length is None:
        return ""
    seen = trained(train_len)
    return f"; at {length}, distances seen in training (< {train_len}): " + ", ".join(
        f"{e} {fmt(by_distance(cells[e], length, train_len)[0])} "
        f"({record_verdict(cells[e][0], length, seen).verdict})"
        for e in encodings
    )


def by_distance(
    records: list[dict[str, Any]], length: int, train_len: int
) -> tuple[float | None, float | None]:
    """Accuracy at test ``length`` on queries whose distance bucket lies wholly below the train
    length, and on those wholly at or beyond it (the ``distance`` slice, weighted equally)."""
    near, far = [], []
    for r in records:
        for bucket, accuracy in r["slices"].get(str(length), {}).get("distance", {}).items():
            b = int(bucket)
            if 2 * b - 1 < train_len:
                near.append(accuracy)
            elif b >= train_len:
                far.append(accuracy)
    return mean(near), mean(far)


def figure(
    curves: dict[str, dict[int, float]],
    train_len: int,
    level: float,
    unlearned: dict[str, list[int]],
) -> Any:
    """Accuracy against test length per encoding; a black cross where the cell is "not learned"
    at that length on the distances seen in training."""
    fig, (ax,) = new_figure(1, width=6.5, height=4)
    markers = iter("osD^v<>")
    crossed = []
    for encoding, points in curves.items():
        xs = sorted(points)
        ax.plot(xs, [points[x] for x in xs], marker=next(markers), label=encoding)
        crossed += [(x, points[x]) for x in unlearned.get(encoding, []) if x in points]
    if crossed:
        ax.scatter(*zip(*crossed, strict=True), marker="x", color="black", s=45, zorder=5,
                   label="not learned at that length (trained distances)")  # fmt: skip
    ax.axvline(train_len, color="grey", linestyle="--", label=f"train length ({train_len})")
    ax.axhline(level, color="black", linewidth=0.8, label=f"chance ({level:.3f})")
    lengths = sorted({n for c in curves.values() for n in c})
    ax.set(xscale="log", xlabel="test length", ylabel="accuracy", ylim=(-0.02, 1.02),
           title="induction heads: accuracy against test length")  # fmt: skip
    ax.set_xticks(lengths, labels=[str(n) for n in lengths])
    ax.minorticks_off()
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    return fig


FINDING = Finding(
    name="extrapolation",
    title="Extrapolation of positional encodings",
    source="Gu & Dao, Mamba, 2023, Table 11 (induction heads); Press et al., ALiBi, 2022",
    published=(
        "Induction heads trained at 256 tokens, attention accuracy at 256 / 512 / 1K / 2K / 4K: "
        "absolute positions 100 / 58.6 / 26.6 / 18.8 / 9.8; RoPE 100 / 83.6 / 31.3 / 18.4 / "
        "8.6. ALiBi (language modelling, trained at 512): perplexity stays flat to 30x the "
        "train length (ALiBi 19.73 -> 18.31 at 15512 tokens), T5's bias nearly so, where "
        "sinusoidal (20.05 -> 406) and rotary (20.07 -> 79.25) grow."
    ),
    configs={"extrapolation": "eval/configs/findings/extrapolation.yaml"},
    gpu_configs={"extrapolation": "eval/configs/findings/extrapolation_gpu.yaml"},
    judge=judge,
)
