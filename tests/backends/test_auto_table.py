"""backend="auto" follows the benchmark's measured table, and the table is built from bench.json."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

import zoo
import zoo.backends.auto as auto
from eval.bench.auto_table import entries_from, merge, write_table
from zoo.backends import get_backend
from zoo.backends.auto_table import load_table, lookup
from zoo.core.call import AttentionCall
from zoo.functional import prepare_call


def cell(variant, backend, n, time_ms, *, kind="zoo", status="ok", pass_="fwd"):
    return {
        "variant": variant, "backend": backend, "kind": kind, "status": status, "n": n,
        "causal": False, "pass": pass_, "dtype": "float32", "time_ms": time_ms,
        "params": {"window_size": 4},
    }  # fmt: skip


BENCH = {
    "header": {"device_type": "cpu"},
    "cells": [
        cell("local", "blocked", 1024, 3.0),
        cell("local", "sdpa", 1024, 5.0),
        cell("local", "flex", 1024, 1.0),  # compiled flex is no candidate on CPU
        cell("local", "sdpa_dense", 1024, 0.5, kind="peer"),  # peers are the yardstick
        cell("local", "auto", 1024, 2.9),
        cell("local", "blocked", 8192, 25.0),
        cell("local", "sdpa", 8192, 9.0, status="mismatch"),  # failed the check: never chosen
        cell("local", "reference", 8192, 400.0),
        cell("local", "blocked", 8192, 90.0, pass_="fwd+bwd"),
        cell("local", "sdpa", 8192, 80.0, pass_="fwd+bwd"),
    ],
}


def test_the_fastest_checked_zoo_backend_wins_each_point():
    table = {(e["n"], e["pass"]): e for e in entries_from(BENCH, "bench.json")}
    assert (
        table[(1024, "fwd")]["backend"] == "blocked" and table[(1024, "fwd")]["runner_up"] == "sdpa"
    )
    assert (
        table[(8192, "fwd")]["backend"] == "blocked"
        and table[(8192, "fwd")]["runner_up"] == "reference"
    )
    assert table[(8192, "fwd+bwd")]["backend"] == "sdpa"


def test_merge_replaces_a_device_and_keeps_the_others(tmp_path):
    gpu = {**cell("local", "flex", 1024, 1.0), "device": "cuda", "dtype": "bfloat16", "params": {}}
    old = [gpu | {"backend": "flex"}, entries_from(BENCH, "old")[0] | {"backend": "sdpa"}]
    merged = merge(old, entries_from(BENCH, "new"))
    assert {e["device"] for e in merged} == {"cpu", "cuda"}
    assert all(e["source"] == "new" for e in merged if e["device"] == "cpu")
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps(BENCH))
    out = tmp_path / "table.json"
    assert len(write_table([str(bench)], out)) == 3
    assert len(load_table(str(out))) == 3


def test_files_measuring_one_point_give_one_entry_the_fastest(tmp_path):
    """Two files time one point (blocked in one, flex in the other): one entry, the faster
    backend with the other as runner-up (before, an entry per file, and lookup took the
    first: the slower)."""
    slow, fast = tmp_path / "slow.json", tmp_path / "fast.json"
    slow.write_text(json.dumps({**BENCH, "cells": [cell("local", "blocked", 4096, 10.0)]}))
    fast.write_text(json.dumps({**BENCH, "cells": [cell("local", "sdpa", 4096, 5.0)]}))
    (entry,) = write_table([str(slow), str(fast)], tmp_path / "table.json")
    assert (entry["backend"], entry["runner_up"]) == ("sdpa", "blocked")
    assert entry["source"] == str(fast)


def test_lookup_takes_the_nearest_measured_length():
    entries = tuple(entries_from(BENCH, "bench.json"))

    def call(n, grad=False):
        q = torch.randn(1, 2, n, 8, requires_grad=grad)
        return prepare_call(q, q, q, variant="local", window_size=4)

    assert lookup(call(2048), entries)["n"] == 1024  # 2x from 1024, 4x from 8192
    assert lookup(call(6000), entries)["n"] == 8192
    assert lookup(call(40000), entries)["n"] == 8192  # beyond the largest: the largest
    assert lookup(call(256), entries) is None  # below half the smallest: fixed costs rule
    assert lookup(call(8192, grad=True), entries)["backend"] == "sdpa"  # training: fwd+bwd
    q = torch.randn(1, 2, 1024, 8)
    assert lookup(prepare_call(q, q, q, variant="bigbird"), entries) is None  # not measured
    # Another window is another pattern: the measured one says nothing about it.
    assert lookup(prepare_call(q, q, q, variant="local", window_size=512), entries) is None


def test_auto_follows_the_table_and_says_so(monkeypatch):
    entries = tuple(entries_from(BENCH, "bench.json"))
    monkeypatch.setattr(auto, "lookup", lambda call: lookup(call, entries))
    q = torch.randn(1, 2, 8192, 8, requires_grad=True)
    text = zoo.explain(q, q, q, variant="local", window_size=4)
    assert text.startswith("auto -> sdpa") and "measured fastest at n=8192: sdpa" in text
    q = q.detach()
    assert zoo.explain(q, q, q, variant="local", window_size=4).startswith("auto -> blocked")


def test_an_entry_of_one_timed_backend_is_not_called_the_fastest(monkeypatch):
    """A point where one backend was timed (the GPU goal cells time auto's choice alone) says
    so, with no runner-up of NaN ms."""
    entry = {"n": 16384, "backend": "flex", "time_ms": 0.6, "runner_up": "-",
             "runner_up_ms": float("nan"), "source": "bench-goals.json"}  # fmt: skip
    monkeypatch.setattr(auto, "lookup", lambda call: entry)
    q = torch.randn(1, 2, 64, 8)
    text = zoo.explain(q, q, q, variant="local", window_size=4)
    assert "measured at n=16384: flex 0.6 ms, the only backend timed there" in text, text
    assert "nan" not in text and "fastest" not in text


def test_the_shipped_table_names_real_backends():
    for entry in load_table():
        assert entry["backend"] in zoo.list_backends()
        assert entry["pass"] in ("fwd", "fwd+bwd") and entry["n"] > 0


def test_an_auto_cell_measures_the_backend_it_ran():
    """A sweep run with backends=[auto,blocked,xformers] times flex only through auto: that cell
    counts for flex, or the table would crown xformers."""

    def on_cuda(*cells):
        return {"header": {"device_type": "cuda"}, "cells": list(cells)}

    def gpu(backend, ms, **extra):
        return cell("local", backend, 16384, ms, pass_="fwd+bwd") | {"dtype": "bfloat16"} | extra

    flex_by_auto = gpu("auto", 0.9, resolved="flex")
    others = [gpu("blocked", 16.5), gpu("xformers", 1.38), gpu("xformers", 0.1, kind="peer")]
    (entry,) = entries_from(on_cuda(flex_by_auto, *others), "gpu.json")
    assert (entry["backend"], entry["time_ms"], entry["runner_up"]) == ("flex", 0.9, "xformers")
    (entry,) = entries_from(on_cuda(*others), "gpu.json")  # without it: the trap
    assert entry["backend"] == "xformers"
    # A backend timed directly keeps its own figure; one that failed is not rescued by auto's run.
    (entry,) = entries_from(
        on_cuda(gpu("auto", 0.5, resolved="blocked"), gpu("blocked", 3.0), gpu("sdpa", 9.0)),
        "gpu.json",
    )
    assert (entry["backend"], entry["time_ms"]) == ("blocked", 3.0)
    failed = gpu("sdpa", 9.0, status="mismatch")
    (entry,) = entries_from(
        on_cuda(gpu("auto", 1.0, resolved="sdpa"), failed, gpu("blocked", 3.0)), "g"
    )
    assert (entry["backend"], entry["runner_up"]) == ("blocked", "-")
    # A backend built with options by a config (backend_instances) is no candidate: auto takes
    # the registered ones as they come.
    instance = gpu("blocked_bf16", 0.2, resolved="blocked")
    (entry,) = entries_from(on_cuda(instance, gpu("blocked", 3.0), gpu("sdpa", 9.0)), "g")
    assert (entry["backend"], entry["time_ms"]) == ("blocked", 3.0)
    # On the CPU compiled flex is no candidate, through auto or not.
    cpu = {
        "header": {"device_type": "cpu"},
        "cells": [cell("local", "auto", 1024, 1.0) | {"resolved": "flex"}],
    }
    assert entries_from(cpu, "cpu.json") == []


ROOT = Path(__file__).resolve().parents[2]
GPU_RESULTS = sorted((ROOT / "eval/results/bench-gpu-h100").glob("*/bench.json"))


class OnCuda(AttentionCall):
    """A call whose device reads cuda: auto's choice hangs on the table and the order, which
    need no CUDA tensor (lookup reads the device type, the dtype, the variant and the length)."""

    @property
    def device(self) -> torch.device:
        return torch.device("cuda")


def cuda_call(variant, n, causal, grad, params):
    q = torch.randn(1, 1, n, 64, dtype=torch.bfloat16, requires_grad=grad)
    call = prepare_call(q, q, q, variant=variant, causal=causal, **params)
    return OnCuda(**{f.name: getattr(call, f.name) for f in dataclasses.fields(call)})


def test_auto_on_cuda_takes_flex_where_the_h100_measured_it():
    """Every point of the committed H100 run where auto ran flex is a CUDA row of the shipped
    table with flex first, and auto's order there starts with flex, before blocked and xformers
    (slower at every point of that run). Fails if the CUDA rows are missing, rank another first or
    come from a CPU run."""
    assert len(GPU_RESULTS) == 2, GPU_RESULTS
    shipped = load_table()
    backends = {name: get_backend(name) for name in zoo.list_backends()}
    checked = 0
    for path in GPU_RESULTS:
        bench = json.loads(path.read_text())
        assert bench["header"]["device_type"] == "cuda"
        for c in bench["cells"]:
            if c["backend"] != "auto" or c["resolved"] != "flex" or c["status"] != "ok":
                continue
            call = cuda_call(c["variant"], c["n"], c["causal"], c["pass"] == "fwd+bwd", c["params"])
            point = f"{c['variant']} n={c['n']} causal={c['causal']} {c['pass']}"
            entry = lookup(call, shipped)
            assert entry is not None, f"{point}: no CUDA row in the shipped table"
            assert (entry["device"], entry["dtype"], entry["n"]) == ("cuda", "bfloat16", c["n"])
            assert entry["backend"] == "flex", f"{point}: the table ranks {entry['backend']} first"
            # this run's row, or a later CUDA run's at the same point (the table keeps the last)
            source = json.loads((ROOT / entry["source"]).read_text())
            assert source["header"]["device_type"] == "cuda", entry["source"]
            order = auto.fallback_order(call, backends)  # the shipped table, as auto reads it
            assert order[0] == "flex", f"{point}: auto's order {order}"
            checked += 1
    assert checked == 13  # 5 points at 16K, 8 at 64K


def test_auto_on_cuda_runs_moba_on_flex_as_the_h200_campaign_measured():
    """The H200 campaigns timed MoBA's forward at 16K on flex (its gathered rows) at 3.41 and
    4.62 ms against blocked's 13.1 and 16.2 ms (the table keeps the later run); the H100
    campaign's 275 ms on flex, which had put blocked first, measured the union path since
    replaced. auto's order starts with flex, for inference and training."""
    params = {"block_size": 512, "top_k": 3}
    backends = {name: get_backend(name) for name in zoo.list_backends()}
    inference = cuda_call("moba", 16384, False, False, params)
    entry = lookup(inference, load_table())
    assert (entry["backend"], entry["runner_up"]) == ("flex", "blocked")
    assert entry["source"] == "eval/results/gpu-campaign-h200-2026-11-28-b/bench-moba.json"
    assert auto.fallback_order(inference, backends)[0] == "flex"
    training = cuda_call("moba", 16384, False, True, params)
    assert auto.fallback_order(training, backends)[0] == "flex"
