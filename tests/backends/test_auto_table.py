"""backend="auto" follows the benchmark's measured table, and the table is built from bench.json."""

from __future__ import annotations

import json

import torch

import zoo
import zoo.backends.auto as auto
from eval.bench.auto_table import entries_from, merge, write_table
from zoo.backends.auto_table import load_table, lookup
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


def test_the_shipped_table_names_real_backends():
    for entry in load_table():
        assert entry["backend"] in zoo.list_backends()
        assert entry["pass"] in ("fwd", "fwd+bwd") and entry["n"] > 0
