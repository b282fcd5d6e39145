"""``bench-profile`` and ``bench-compiles`` on the CPU at tiny sizes: what they write, and that the
compile count counts dynamo's graphs (through the "eager" backend: inductor takes seconds a graph
on a CPU)."""

from __future__ import annotations

import functools
import json

import pytest
import torch
import yaml
from helpers import gpu

import zoo.backends.flex_kernel as flex_kernel
from eval.bench import compiles, profile


def test_bench_profile_summarises_kernels_and_host_gaps_per_cell(tmp_path):
    config = {
        "variants": ["local"], "backends": ["auto", "sdpa"], "peers": ["sdpa_dense"],
        "lengths": [128], "passes": ["fwd", "fwd+bwd"], "causal": [False], "heads": 2,
        "head_dim": 16, "warmup": 1, "repeats": 2, "threads": 1, "device": "cpu",
        "params": {"local": {"window_size": 8}}, "out": str(tmp_path / "out"),
    }  # fmt: skip
    path = tmp_path / "profile.yaml"
    path.write_text(yaml.safe_dump(config))
    assert profile.main([str(path)]) == 0
    data = json.loads((tmp_path / "out" / "profile.json").read_text())
    cells = data["cells"]
    assert [(c["backend"], c["pass"]) for c in cells] == [
        (backend, pass_) for pass_ in ("fwd", "fwd+bwd")
        for backend in ("sdpa_dense", "auto", "sdpa")
    ]  # fmt: skip
    for cell in cells:
        assert cell["status"] == "ok" and cell["steps"] == 2, cell
        assert cell["activity"] == "outermost CPU ops"
        assert 0 < cell["kernel_ms"] <= cell["step_ms"] and cell["gap_ms"] >= 0
        assert cell["kernels"] >= 1 and cell["top"][0]["ms"] > 0
        assert all(k["name"].startswith("aten::") for k in cell["top"])
    dense = cells[0]["top"][0]["name"]
    assert dense == "aten::scaled_dot_product_attention"  # outermost: its callees not apart
    text = (tmp_path / "out" / "profile.md").read_text()
    assert "| local | 128 non-causal fwd | auto->" in text and "trace" not in text.lower()
    # Host work in Python: the zoo's own functions appear in the zoo cells, not in the peer's.
    zoo_cell, peer = cells[1], cells[0]
    assert 0 < len(zoo_cell["host"]) <= profile.TOP and all(f["ms"] >= 0 for f in zoo_cell["host"])
    everything = [f["function"] for f in zoo_cell["host"]]
    assert any(name.startswith("zoo/") for name in everything), everything
    assert not any(f["function"].startswith("zoo/") for f in peer["host"]), peer["host"]
    assert "## Host work per step" in text


def test_bench_profile_needs_a_config(capsys):
    assert profile.main([]) == 2
    assert "needs a config" in capsys.readouterr().err


def test_the_compile_count_is_dynamos_graphs():
    torch._dynamo.reset()
    step = torch.compile(lambda x: (x * 2).sum(), backend="eager", dynamic=False)
    counts = []
    for n in (3, 4, 5, 3):
        before = compiles.graph_counts()
        step(torch.ones(n))
        counts.append(compiles.compiles_between(before, compiles.graph_counts()))
    assert counts == [1, 1, 1, 0]  # one graph per new shape, none for a shape seen before


@pytest.fixture
def eager_flex(monkeypatch):
    """The flex backend's kernel compiled by dynamo with the "eager" backend: the same graphs,
    counted the same way, without inductor's code generation."""
    from torch.nn.attention.flex_attention import flex_attention

    torch._dynamo.reset()
    kernel = functools.lru_cache(maxsize=2)(
        lambda dynamic_lengths=False: torch.compile(
            flex_attention, backend="eager", dynamic=None if dynamic_lengths else False
        )
    )
    monkeypatch.setattr(flex_kernel, "_compiled_kernel", kernel)
    yield
    torch._dynamo.reset()


def test_bench_compiles_counts_three_lengths_on_the_cpu(tmp_path, eager_flex):
    argv = ["lengths=[128,200,384]", "heads=2", "head_dim=16", "device=cpu", "threads=1",
            "params={window_size: 32}", f"out={tmp_path}"]  # fmt: skip
    assert compiles.main(argv) == 0
    data = json.loads((tmp_path / "compiles.json").read_text())
    assert data["measured"] == 3 and data["complete"] and data["errors"] == 0
    assert [c["n"] for c in data["calls"]] == [128, 200, 384]
    assert data["calls"][0]["compiles"] >= 1  # the first length compiles
    assert data["compiles"] == sum(c["compiles"] for c in data["calls"]) <= 3
    assert data["compiled_at"][0] == 128
    assert "compiles for 3 distinct lengths" in (tmp_path / "compiles.md").read_text()


def test_bench_compiles_rejects_repeated_lengths(capsys):
    assert compiles.main(["lengths=[128,128]", "device=cpu"]) == 2
    assert "distinct" in capsys.readouterr().err


@gpu
def test_bench_profile_records_cuda_kernels(tmp_path):
    config = {
        "variants": ["local"], "backends": ["sdpa"], "peers": ["sdpa_dense"], "lengths": [256],
        "passes": ["fwd", "fwd+bwd"], "causal": [False], "heads": 2, "head_dim": 64,
        "warmup": 1, "repeats": 2, "device": "cuda", "params": {"local": {"window_size": 8}},
        "out": str(tmp_path / "out"),
    }  # fmt: skip
    path = tmp_path / "profile.yaml"
    path.write_text(yaml.safe_dump(config))
    assert profile.main([str(path)]) == 0
    cells = json.loads((tmp_path / "out" / "profile.json").read_text())["cells"]
    for cell in cells:
        assert cell["status"] == "ok" and cell["activity"] == "CUDA kernels", cell
        assert cell["kernels"] >= 1 and 0 < cell["kernel_ms"] <= cell["step_ms"]
        assert cell["gap_ms"] >= 0 and cell["lead_ms"] >= 0


@gpu
def test_bench_compiles_counts_on_cuda(tmp_path, eager_flex):
    argv = ["lengths=[256,384]", "heads=2", "head_dim=64", "device=cuda", f"out={tmp_path}"]
    assert compiles.main(argv) == 0
    data = json.loads((tmp_path / "compiles.json").read_text())
    assert data["measured"] == 2 and data["errors"] == 0 and data["calls"][0]["compiles"] >= 1
