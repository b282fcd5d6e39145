"""``bench-overhead``: the host time of a call around a stubbed kernel, per variant and backend."""

from __future__ import annotations

import json

import pytest
import torch

from eval.bench import overhead


def test_bench_overhead_times_the_call_around_a_stubbed_kernel(tmp_path, monkeypatch):
    """Every kernel stubbed: no real SDPA call, the masked one (local on sdpa) included (it
    escaped the stub, and the H200 run's 10.3 ms of "host time" at 8K was its kernel)."""
    real_calls, real = [], torch.nn.functional.scaled_dot_product_attention

    def recorded(*args, **kwargs):
        real_calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recorded)
    argv = ["variants=[local, causal]", "backends=[flex, sdpa]", "lengths=[256]", "repeats=5",
            "heads=2", "head_dim=16", "params={local: {window_size: 8}}",
            f"out={tmp_path}"]  # fmt: skip
    assert overhead.main(argv) == 0
    assert real_calls == []
    data = json.loads((tmp_path / "overhead.json").read_text())
    cells = {(c["variant"], c["backend"]): c for c in data["cells"]}
    assert cells.keys() == {(v, b) for v in ("local", "causal") for b in ("flex", "sdpa")}
    for cell in cells.values():  # the zoo call does work beyond the kernel it calls
        assert cell["zoo_us"] > cell["stub_us"] > 0 and cell["added_us"] > 0
        assert isinstance(cell["ops"], int) and cell["ops"] >= 0
    # whole blocks on a CPU, and the kernel's output is the call's: nothing dispatched around it
    assert cells[("local", "flex")]["ops"] == 0
    # flex's block mask at 256 tokens, blocks of 128: causal 1 full below the diagonal and the
    # 2 on it partial; a window of 8 is never a whole block
    assert cells[("causal", "flex")]["blocks"] == {"full": 1.0, "partial": 2.0, "all": 4}
    assert cells[("local", "flex")]["blocks"]["full"] == 0
    assert "blocks" not in cells[("local", "sdpa")]
    assert "bare kernel stub" in (tmp_path / "overhead.md").read_text()


def test_bench_overhead_counts_mobas_operations_on_blocked(tmp_path):
    """MoBA on blocked with its kernels stubbed through their CUDA wrapping: the operations a
    call dispatches do not grow with its runs (16 key blocks of 64 and 4 heads, against 64)."""
    argv = ["variants=[moba]", "backends=[blocked]", "lengths=[1024, 4096]", "repeats=2",
            "heads=4", "head_dim=16", "params={moba: {block_size: 64, top_k: 2}}",
            f"out={tmp_path}"]  # fmt: skip
    assert overhead.main(argv) == 0
    data = json.loads((tmp_path / "overhead.json").read_text())
    few, many = (c["ops"] for c in data["cells"])
    assert 0 < many <= few + 50, (few, many)
    assert "read its operation count" in (tmp_path / "overhead.md").read_text()


def test_bench_overhead_names_an_unknown_backend(capsys):
    assert overhead.main(["backends=[xformers]"]) == 2
    assert "backends must be among flex, sdpa, blocked" in capsys.readouterr().err


def test_a_run_stopped_midway_keeps_the_cells_it_measured(tmp_path, monkeypatch):
    """overhead.json is written after every cell: the GPU campaign's stage stops it at a time
    limit, and its summary reads the file."""
    measure, calls = overhead.measure, []

    def stopped_on_the_second(*args):
        calls.append(args)
        if len(calls) == 2:
            raise KeyboardInterrupt  # what the stage's SIGINT raises
        return measure(*args)

    monkeypatch.setattr(overhead, "measure", stopped_on_the_second)
    argv = ["variants=[causal, full]", "backends=[sdpa]", "lengths=[128]", "repeats=2",
            "heads=2", "head_dim=16", f"out={tmp_path}"]  # fmt: skip
    with pytest.raises(KeyboardInterrupt):
        overhead.main(argv)
    data = json.loads((tmp_path / "overhead.json").read_text())
    assert [c["variant"] for c in data["cells"]] == ["causal"]


def test_a_cell_that_raises_is_recorded_and_the_others_run(tmp_path):
    """linear attention has no flex-style kernel to stub on sdpa: its cell is recorded with its
    reason, and local is still measured (before, a traceback and no overhead.json)."""
    argv = ["variants=[linear,local]", "backends=[sdpa]", "lengths=[128]", "repeats=3",
            "device=cpu", f"out={tmp_path}"]  # fmt: skip
    assert overhead.main(argv) == 0
    cells = json.loads((tmp_path / "overhead.json").read_text())["cells"]
    assert [c["variant"] for c in cells] == ["linear", "local"]
    assert cells[0]["status"] == "error" and cells[0]["reason"]
    assert cells[1]["added_us"] >= 0
    assert "| linear | sdpa | 128 | error: " in (tmp_path / "overhead.md").read_text()
