"""``python -m eval bench-cp``: the command starts its own gloo processes for each N, and its
report holds the bytes, the peak memory per rank with its fitted exponent, and the overlap's
times beside the serial call's."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import yaml
from helpers import subprocess_timeout

from eval.bench.context_parallel import CPConfig, _write, memory_table


def test_bench_cp_reports_bytes_and_a_peak_that_falls_with_n(tmp_path):
    config = {
        "variants": ["sliding_window"],
        "lengths": [512],
        "worlds": [1, 2],
        "methods": ["zoo", "overlap", "all_gather"],
        "heads": 2,
        "head_dim": 16,
        "warmup": 0,
        "repeats": 1,
        "params": {"sliding_window": {"window_size": 32}},
        "out": str(tmp_path / "out"),
    }
    path = tmp_path / "cp.yaml"
    path.write_text(yaml.safe_dump(config))
    done = subprocess.run(
        [sys.executable, "-m", "eval", "bench-cp", str(path)],
        capture_output=True, text=True, timeout=subprocess_timeout(180),
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads((tmp_path / "out" / "bench-cp.json").read_text())["rows"]
    zoo_rows = {(r["variant"], r["world"]): r for r in rows if r["method"] == "zoo"}
    assert set(zoo_rows) == {("sliding_window", 1), ("sliding_window", 2)}
    # One process receives nothing; two receive a window's halo of 32 rows, not a shard.
    assert zoo_rows["sliding_window", 1]["rows_received"] == 0
    assert 0 < zoo_rows["sliding_window", 2]["rows_received"] < 256
    window = [zoo_rows["sliding_window", n]["peak_mib"] for n in (1, 2)]
    assert 0 < window[1] < 0.75 * window[0], window  # the shard's own buffers halve
    overlap = {r["world"]: r for r in rows if r["method"] == "overlap"}
    # Two ranks of 256 rows each compute all but a halo's blocks of 64 during the exchange.
    assert overlap[2]["interior_rows_min"] == 192
    assert all(overlap[2][key] > 0 for key in ("forward_ms", "serial_forward_backward_ms"))
    text = (tmp_path / "out" / "bench-cp.md").read_text()
    assert "## Bytes received per rank" in text and "## Peak memory per rank" in text
    assert "## Overlap" in text


def test_the_memory_table_fits_the_exponent_over_n():
    rows = [
        {"variant": "local", "world": n, "method": "zoo", "length": 4096, "peak_mib": 64 / n}
        for n in (1, 2, 4)
    ] + [{"variant": "full", "world": n, "method": "zoo", "length": 4096, "peak_mib": 10.0}
         for n in (1, 2, 4)]  # fmt: skip
    table = memory_table(rows)
    assert table[-2] == "| local | 64.0 | 32.0 | 16.0 | -1.00 | 0.0 + 64.0/N |"
    assert table[-1] == "| full | 10.0 | 10.0 | 10.0 | 0.00 | 10.0 + 0.0/N |"


def _rows(world: int, peak: float) -> list[dict]:
    return [
        {"variant": "local", "length": 1024, "world": world, "method": "zoo", "device": "cpu",
         "rows_received": 0, "mib_received": 0.0, "mib_received_min": 0.0, "peak_mib": peak}
    ]  # fmt: skip


def test_runs_at_other_n_into_one_out_make_one_report(tmp_path, capsys):
    """torchrun runs one N at a time: a run keeps the earlier run's rows at other N where the
    settings are the same, and drops them where they differ."""
    config = CPConfig(out=str(tmp_path), lengths=[1024])
    _write(config, _rows(4, 2.0), "torchrun ... 4")
    _write(config, _rows(1, 8.0), "torchrun ... 1")
    text = (tmp_path / "bench-cp.md").read_text()
    assert "| local | 8.0 | 2.0 | -1.00 | 0.0 + 8.0/N |" in text
    rows = json.loads((tmp_path / "bench-cp.json").read_text())["rows"]
    assert sorted(r["world"] for r in rows) == [1, 4]
    _write(CPConfig(out=str(tmp_path), lengths=[2048]), _rows(2, 4.0), "other settings")
    rows = json.loads((tmp_path / "bench-cp.json").read_text())["rows"]
    assert [r["world"] for r in rows] == [2]
