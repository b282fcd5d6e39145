"""``bench-overhead``: the host time of a call around a stubbed kernel, per variant and backend."""

from __future__ import annotations

import json

from eval.bench import overhead


def test_bench_overhead_times_the_call_around_a_stubbed_kernel(tmp_path):
    argv = ["variants=[local, causal]", "backends=[flex, sdpa]", "lengths=[256]", "repeats=5",
            "heads=2", "head_dim=16", "params={local: {window_size: 8}}",
            f"out={tmp_path}"]  # fmt: skip
    assert overhead.main(argv) == 0
    data = json.loads((tmp_path / "overhead.json").read_text())
    cells = {(c["variant"], c["backend"]): c for c in data["cells"]}
    assert cells.keys() == {(v, b) for v in ("local", "causal") for b in ("flex", "sdpa")}
    for cell in cells.values():  # the zoo call does work beyond the kernel it calls
        assert cell["zoo_us"] > cell["stub_us"] > 0 and cell["added_us"] > 0
    assert "bare kernel stub" in (tmp_path / "overhead.md").read_text()


def test_bench_overhead_names_an_unknown_backend(capsys):
    assert overhead.main(["backends=[blocked]"]) == 2
    assert "backends must be among flex, sdpa" in capsys.readouterr().err
