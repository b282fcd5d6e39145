"""The report's plots read well with many series and can be trusted at a glance: every line or
point has its own colour and marker, the length axis is ticked at the tested lengths as plain
integers, the cost plot's x axis is the attention pairs each variant computes (counted exactly,
not timed), its time panel says it depends on the machine, chance is drawn where the rows know
it, series that coincide stay visible and named, and the generation figure shows greedy
generation beside teacher-forced accuracy."""

from __future__ import annotations

import itertools

import pytest
import torch
from matplotlib.figure import Figure

from eval.harness.cost import attention_pairs, count_pairs, pair_count
from eval.harness.plots import (
    OFFSET,
    accuracy_vs_cost_figure,
    accuracy_vs_length_figure,
    generation_figure,
    plot_accuracy_vs_cost,
    plot_accuracy_vs_length,
    plot_generation,
)

VARIANTS = ["bigbird", "block_local", "full", "local", "longformer", "strided"]
ENCODINGS = ["alibi", "rope"]
LENGTHS = [128, 256, 512]


def row(variant: str, encoding: str = "rope", **overrides) -> dict:
    """A row as eval.harness.report.rows gives it, with the keys its owner adds."""
    base = {
        "task": "copy", "train_len": 128, "test_len": 128, "variant": variant,
        "encoding": encoding, "setting": "abc123", "seed": 0, "key": f"{variant}-{encoding}",
        "status": "ok", "reason": "", "accuracy": 0.5, "train_seconds": 6.0,
        "steps_per_second": 46.0, "peak_memory_mb": None, "eval_ms_per_sequence": 0.2,
        "variant_params": {}, "causal": True, "lr": 3e-3, "chance_accuracy": None,
        "generation_accuracy": None, "training": "converged",
    }  # fmt: skip
    base.update(overrides)
    return base


def twelve_series() -> list[dict]:
    """6 variants x 2 encodings, several sharing nearly the same accuracy and cost (as in the
    quick sweep)."""
    flat = []
    for i, (variant, encoding) in enumerate(itertools.product(VARIANTS, ENCODINGS)):
        for test_len in LENGTHS:
            flat.append(
                row(
                    variant, encoding, test_len=test_len, key=f"k{i}",
                    accuracy=0.08 + 0.001 * i if i % 3 else 1.0, steps_per_second=46.0 + 0.1 * i,
                    variant_params={"local": {"window_size": 16}}.get(variant, {}),
                )
            )  # fmt: skip
    return flat


def saved_figure(plot, flat, tmp_path, monkeypatch) -> Figure:
    """Run a plot function and return the Figure it saved."""
    saved: list[Figure] = []
    original = Figure.savefig

    def record(self, *args, **kwargs):
        saved.append(self)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", record)
    path = plot(flat, tmp_path / "plot.png")
    assert path.read_bytes()[:4] == b"\x89PNG"
    (figure,) = saved
    figure.canvas.draw()
    return figure


def panel(figure: Figure, label: str):
    (ax,) = [ax for ax in figure.axes if ax.get_label() == label]
    return ax


def points(ax) -> list:
    """The one-point lines of a cost panel (one per series)."""
    return [line for line in ax.get_lines() if len(line.get_xdata()) == 1]


def series_lines(ax) -> dict[str, object]:
    """Each labelled series line of a panel by its legend label (chance and the front left out)."""
    return {
        line.get_label(): line
        for line in ax.get_lines()
        if line.get_gid() != "chance" and not line.get_label().startswith(("_", "Pareto"))
    }


def visible_tick_labels(ax, minor: bool) -> list[str]:
    low, high = sorted(ax.get_xlim())
    ticks = ax.xaxis.get_minor_ticks() if minor else ax.xaxis.get_major_ticks()
    return [
        t.label1.get_text()
        for t in ticks
        if low <= t.get_loc() <= high and t.label1.get_visible() and t.label1.get_text()
    ]


def local_causal_pairs(n: int, window: int) -> int:
    """Pairs of causal local attention with window w, counted by hand: query i sees keys
    max(0, i - w) .. i."""
    return sum(min(i, window) + 1 for i in range(n))


def test_accuracy_vs_length_gives_every_line_its_own_look_and_plain_length_ticks(
    tmp_path, monkeypatch
):
    figure = saved_figure(plot_accuracy_vs_length, twelve_series(), tmp_path, monkeypatch)
    (ax,) = figure.axes
    lines = [line for line in ax.get_lines() if len(line.get_xdata()) == len(LENGTHS)]
    assert len(lines) == 12
    looks = [(str(line.get_color()), line.get_marker(), line.get_linestyle()) for line in lines]
    assert len(set(looks)) == 12, looks
    assert len({(look[0], look[1]) for look in looks}) == 12, "colour and marker alone differ"
    assert visible_tick_labels(ax, minor=False) == [str(n) for n in LENGTHS]
    assert visible_tick_labels(ax, minor=True) == []
    legend = ax.get_legend() or figure.legends[0]
    labels = [text.get_text() for text in legend.get_texts()]
    assert all(any(f"{v}+{e}" in label for label in labels) for v in VARIANTS for e in ENCODINGS)


def test_accuracy_vs_cost_points_are_distinct_and_labels_do_not_overlap(tmp_path, monkeypatch):
    figure = saved_figure(plot_accuracy_vs_cost, twelve_series(), tmp_path, monkeypatch)
    renderer = figure.canvas.get_renderer()
    for label in ("pairs:copy", "time:copy"):
        ax = panel(figure, label)
        boxes = [text.get_window_extent(renderer) for text in ax.texts if text.get_text()]
        for a, b in itertools.combinations(boxes, 2):
            assert not a.overlaps(b), "two point labels overlap"
        assert len(points(ax)) == 12, label
        looks = {(str(line.get_color()), line.get_marker()) for line in points(ax)}
        assert len(looks) == 12, "every point has its own colour and marker"


def test_cost_axis_is_the_pairs_counted_from_the_pattern_not_the_time(tmp_path, monkeypatch):
    """local (window 16 and 40, causal) and full (causal and not) at n = 128: each point's x is
    the pair count worked out here by hand, whatever the steps per second say."""
    n = 128
    flat = [
        row("local", "rope", variant_params={"window_size": 16}, steps_per_second=5.0),
        row("local", "alibi", variant_params={"window_size": 40}, steps_per_second=50.0),
        row("full", "rope", causal=True, steps_per_second=40.0),
        row("full", "alibi", causal=False, steps_per_second=30.0),
    ]
    expected = {
        "local+rope": local_causal_pairs(n, 16),
        "local+alibi": local_causal_pairs(n, 40),
        "full+rope": n * (n + 1) // 2,
        "full+alibi": n * n,
    }
    for r in flat:
        assert attention_pairs(r) == expected[f"{r['variant']}+{r['encoding']}"]
    figure = saved_figure(plot_accuracy_vs_cost, flat, tmp_path, monkeypatch)
    ax = panel(figure, "pairs:copy")
    drawn = {label: line.get_xdata()[0] for label, line in series_lines(ax).items()}
    assert drawn == pytest.approx(expected)
    assert ax.get_xscale() == "log"
    assert "pairs per sequence" in ax.get_xlabel() and "one head of one layer" in ax.get_xlabel()
    # The time is still there, in its own panel that says what it depends on.
    time = panel(figure, "time:copy")
    assert series_lines(time)["local+rope"].get_xdata()[0] == pytest.approx(1000 / 5.0)
    assert "seconds per 1000" in time.get_xlabel() and "load" in time.get_xlabel()


def test_pair_count_reads_a_cell_too_and_says_when_it_cannot_count():
    cell = {
        "variant": "local", "variant_params": {"window_size": [31, 0]}, "train_len": 128,
        "causal": True, "model": {"dim": 64, "heads": 2},
    }  # fmt: skip
    assert attention_pairs(cell) == local_causal_pairs(128, 31)
    assert pair_count(cell).basis == "exact"
    # No variant parameters (an old row): no count, rather than the registry's defaults.
    assert attention_pairs({**cell, "variant_params": None}) is None
    assert attention_pairs({k: v for k, v in cell.items() if k != "causal"}) is None
    # A mechanism without scores: FLOP-equivalent n·d, with d from the model.
    linear = pair_count({**cell, "variant": "linear", "variant_params": {}})
    assert (linear.pairs, linear.basis) == (128 * 32, "flop-equivalent")
    # A graph's pairs come with each input: no count.
    assert attention_pairs({**cell, "variant": "graph", "variant_params": {}}) is None


@pytest.mark.parametrize(("n", "block_size", "top_k"), [(64, 8, 3), (128, 8, 4), (100, 16, 2)])
def test_moba_budget_is_what_causal_moba_attends(n, block_size, top_k):
    """The budget (own block causally, top_k - 1 whole earlier blocks) equals the pairs moba
    picks for random inputs, counted by the benchmarks' eval.bench.routed.chosen_pairs."""
    from eval.bench.routed import chosen_pairs

    params = {"block_size": block_size, "top_k": top_k}
    generator = torch.Generator().manual_seed(0)
    q, k = (
        torch.randn(2, 2, n, 16, generator=generator),
        torch.randn(2, 2, n, 16, generator=generator),
    )
    count = count_pairs("moba", params, n, True)
    assert count.basis == "budget"
    assert count.pairs == chosen_pairs("moba", params, True, q, k)


def test_estimated_counts_are_starred_and_uncountable_series_are_named(tmp_path, monkeypatch):
    flat = [
        row("causal"),
        row("moba", variant_params={"block_size": 8, "top_k": 3}),
        row("linear", head_dim=32),
        row("graph", accuracy=0.7),
    ]
    figure = saved_figure(plot_accuracy_vs_cost, flat, tmp_path, monkeypatch)
    ax = panel(figure, "pairs:copy")
    lines = series_lines(ax)
    assert set(lines) == {"causal+rope", "moba+rope *", "linear+rope *"}
    assert lines["linear+rope *"].get_xdata()[0] == 128 * 32
    label = ax.get_xlabel()
    assert "moba: budget" in label and "FLOP-equivalent" in label
    assert "not shown" in label and "graph+rope" in label
    assert len(points(panel(figure, "time:copy"))) == 4, "the time panel has every series"


def test_chance_is_a_labelled_line_at_the_rows_chance(tmp_path, monkeypatch):
    flat = [
        r
        for variant in ("full", "local")
        for test_len in LENGTHS
        for r in [
            row(variant, test_len=test_len, chance_accuracy=0.25, generation_accuracy=0.6),
            row(variant, test_len=test_len, task="mqar", chance_accuracy=1 / 64),
        ]
    ]
    figures = [
        accuracy_vs_length_figure(flat),
        accuracy_vs_cost_figure(flat),
        generation_figure(flat),
    ]
    heights = {"copy": 0.25, "mqar": 1 / 64}
    checked = 0
    for figure in figures:
        figure.canvas.draw()
        for ax in figure.axes:
            task = ax.get_title().split(":")[0]
            if task not in heights:
                continue
            (line,) = [line for line in ax.get_lines() if line.get_gid() == "chance"]
            assert list(line.get_ydata()) == pytest.approx([heights[task]] * 2)
            assert line.get_label() == "chance"
            assert "chance" in [t.get_text() for t in ax.texts]
            assert "chance" in [t.get_text() for t in ax.get_legend().get_texts()]
            checked += 1
    assert checked == 2 + 4 + 1  # length: 2 tasks; cost: 2 x 2 panels; generation: copy only
    # Rows without chance draw none.
    figure = accuracy_vs_length_figure([row("full", chance_accuracy=None)])
    assert not [line for line in figure.axes[0].get_lines() if line.get_gid() == "chance"]


def thirteen_series(value: float = 1.0) -> list[dict]:
    """13 series, the first 6 at ``value`` at every length, the others apart."""
    names = [f"v{i:02d}" for i in range(13)]
    return [
        row(name, test_len=n, accuracy=value if i < 6 else 0.1 + 0.06 * i - 0.0001 * n)
        for i, name in enumerate(names)
        for n in LENGTHS
    ]


@pytest.mark.parametrize("value", [1.0, 0.0, 0.5])
def test_coinciding_lines_are_all_visible_and_named(value):
    figure = accuracy_vs_length_figure(thirteen_series(value))
    figure.canvas.draw()
    (ax,) = figure.axes
    lines = series_lines(ax)
    together = [f"v{i:02d}+rope" for i in range(6)]
    tagged = {label.split(" [=")[0]: line for label, line in lines.items()}
    assert len(tagged) == 13
    # Every pair of coinciding lines is at least 2 pixels apart at every length...
    for a, b in itertools.combinations(together, 2):
        for (xa, ya), (xb, yb) in zip(tagged[a].get_xydata(), tagged[b].get_xydata(), strict=True):
            assert xa == xb
            (_, pa), (_, pb) = ax.transData.transform([(xa, ya), (xb, yb)])
            assert abs(pa - pb) >= 2, (a, b, ya, yb)
    # ... no further than OFFSET x 5 from the true value, and inside the axis ...
    drawn = [y for label in together for y in tagged[label].get_ydata()]
    assert max(abs(y - value) for y in drawn) <= 5 * OFFSET + 1e-9
    low, high = ax.get_ylim()
    assert low < min(drawn) and max(drawn) < high
    # ... one of them at the true value, and the others untouched.
    assert any(list(tagged[label].get_ydata()) == [value] * 3 for label in together)
    for i in range(6, 13):
        expected = [0.1 + 0.06 * i - 0.0001 * n for n in LENGTHS]
        assert list(tagged[f"v{i:02d}+rope"].get_ydata()) == pytest.approx(expected)
    # One note names them all and their true accuracy; their legend entries carry its tag.
    label = ax.get_xlabel().replace("\n    ", " ")
    assert f"6 coincide (all at {value:.3f})" in label
    assert all(name in label for name in together)
    assert all(f"{name} [=1]" in lines for name in together)


def test_coinciding_cost_points_are_spread_and_named():
    """Both encodings of local reach 1.0 at the same pair count: two points, not one."""
    flat = [row("local", e, accuracy=1.0, variant_params={"window_size": 16}) for e in ENCODINGS]
    flat.append(row("full", accuracy=0.9))
    figure = accuracy_vs_cost_figure(flat)
    figure.canvas.draw()
    ax = panel(figure, "pairs:copy")
    lines = series_lines(ax)
    a, b = lines["local+alibi [=1]"], lines["local+rope [=1]"]
    assert a.get_xdata()[0] == b.get_xdata()[0]
    (_, pa), (_, pb) = ax.transData.transform([a.get_xydata()[0], b.get_xydata()[0]])
    assert abs(pa - pb) >= 2
    assert "2 coincide (all at 1.000)" in ax.get_xlabel()
    assert lines["full+rope"].get_ydata()[0] == 0.9


def test_generation_figure_shows_greedy_beside_teacher_forced(tmp_path, monkeypatch):
    greedy = {"causal": 0.97, "moba": 0.41, "sliding_window": 0.12}
    flat = [
        row(variant, accuracy=forced, generation_accuracy=greedy[variant], seed=seed)
        for variant, forced in (("causal", 1.0), ("moba", 0.8), ("sliding_window", 0.15))
        for seed in (0, 1)
    ]
    flat.append(row("local", accuracy=0.3))  # no generation: left out
    figure = saved_figure(plot_generation, flat, tmp_path, monkeypatch)
    (ax,) = figure.axes
    bars = {container.get_label(): container for container in ax.containers}
    assert [p.get_height() for p in bars["greedy generation"]] == pytest.approx(
        list(greedy.values())
    )
    assert [p.get_height() for p in bars["teacher-forced"]] == pytest.approx([1.0, 0.8, 0.15])
    ticks = [t.get_text() for t in ax.get_xticklabels()]
    assert ticks == ["causal+rope", "moba+rope", "sliding_window+rope"]
    # Each greedy bar sits beside its teacher-forced bar, and says its value.
    for forced, generated in zip(bars["teacher-forced"], bars["greedy generation"], strict=True):
        assert 0 < generated.get_x() - forced.get_x() < 1
    assert {"0.970", "0.410", "0.120"} <= {t.get_text() for t in ax.texts}
    # Nothing to show: no figure, no file.
    assert plot_generation([row("full")], tmp_path / "none.png") is None
    assert not (tmp_path / "none.png").exists()
