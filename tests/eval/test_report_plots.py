"""The report's plots read well with many series: every line or point has its own colour and
marker, the length axis is ticked at the tested lengths as plain integers, and the cost plot's
labels never overlap."""

from __future__ import annotations

import itertools

from matplotlib.figure import Figure

from eval.harness.report import plot_accuracy_vs_cost, plot_accuracy_vs_length

VARIANTS = ["bigbird", "block_local", "full", "local", "longformer", "strided"]
ENCODINGS = ["alibi", "rope"]
LENGTHS = [128, 256, 512]


def twelve_series() -> list[dict]:
    """Rows as eval.harness.report.rows gives them: 6 variants x 2 encodings, several sharing
    nearly the same accuracy and cost (as in the quick sweep)."""
    flat = []
    for i, (variant, encoding) in enumerate(itertools.product(VARIANTS, ENCODINGS)):
        for test_len in LENGTHS:
            flat.append({
                "task": "copy", "train_len": 128, "test_len": test_len, "variant": variant,
                "encoding": encoding, "setting": "abc123", "seed": 0, "key": f"k{i}",
                "status": "ok", "reason": "", "accuracy": 0.08 + 0.001 * i if i % 3 else 1.0,
                "train_seconds": 6.0, "steps_per_second": 46.0 + 0.1 * i,
                "peak_memory_mb": None, "eval_ms_per_sequence": 0.2,
            })  # fmt: skip
    return flat


def saved_figure(plot, tmp_path, monkeypatch) -> Figure:
    """Run a plot function and return the Figure it saved."""
    saved: list[Figure] = []
    original = Figure.savefig

    def record(self, *args, **kwargs):
        saved.append(self)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", record)
    path = plot(twelve_series(), tmp_path / "plot.png")
    assert path.read_bytes()[:4] == b"\x89PNG"
    (figure,) = saved
    figure.canvas.draw()
    return figure


def visible_tick_labels(ax, minor: bool) -> list[str]:
    low, high = sorted(ax.get_xlim())
    ticks = ax.xaxis.get_minor_ticks() if minor else ax.xaxis.get_major_ticks()
    return [
        t.label1.get_text()
        for t in ticks
        if low <= t.get_loc() <= high and t.label1.get_visible() and t.label1.get_text()
    ]


def test_accuracy_vs_length_gives_every_line_its_own_look_and_plain_length_ticks(
    tmp_path, monkeypatch
):
    figure = saved_figure(plot_accuracy_vs_length, tmp_path, monkeypatch)
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
    figure = saved_figure(plot_accuracy_vs_cost, tmp_path, monkeypatch)
    (ax,) = figure.axes
    renderer = figure.canvas.get_renderer()
    boxes = [text.get_window_extent(renderer) for text in ax.texts if text.get_text()]
    for a, b in itertools.combinations(boxes, 2):
        assert not a.overlaps(b), "two point labels overlap"
    points = [line for line in ax.get_lines() if len(line.get_xdata()) == 1]
    points += [c for c in ax.collections if len(c.get_offsets()) == 1]
    assert len(points) == 12
    looks = {
        (str(line.get_color()), line.get_marker())
        for line in ax.get_lines()
        if len(line.get_xdata()) == 1
    }
    assert len(looks) == 12, "every point has its own colour and marker"
