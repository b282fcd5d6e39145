"""``python -m eval bench-decode``: a step timed, checked against the reference, and with
``profile`` its kernels and host functions per step, on a tiny CPU config."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import needs_cxx

import zoo
from eval.bench.decode import main

TINY = ["variants=[causal,moba]", "lengths=[64]", "batch=2", "heads=4", "kv_heads=2",
        "head_dim=8", "warmup=1", "repeats=2", "params={moba: {block_size: 16, top_k: 2}}",
        "device=cpu"]  # fmt: skip


def test_a_profiled_step_says_where_its_time_goes(tmp_path):
    assert main([*TINY, "peers=[]", "profile=2", f"out={tmp_path}"]) == 0
    cells = json.loads((tmp_path / "bench-decode.json").read_text())["cells"]
    assert [c["variant"] for c in cells] == ["causal", "moba"]
    for cell in cells:
        assert cell["ms"] > 0 and cell["error"] < 1e-5
        profile = cell["profile"]
        assert profile["steps"] == 2 and profile["kernels"] > 0
        assert 0 < profile["kernel_ms"] <= profile["step_ms"]
        names = [k["name"] for k in profile["top"]]
        assert any("scaled_dot_product_attention" in name for name in names), names
        assert any("zoo/" in h["function"] for h in profile["host"]), profile["host"]
    text = (tmp_path / "bench-decode.md").read_text()
    assert "## Where a step's time goes" in text and "| moba | zoo:moba | 64 |" in text


def test_without_profile_a_step_is_timed_only(tmp_path):
    assert main([*TINY, "variants=[causal]", "peers=[sdpa_dense]", f"out={tmp_path}"]) == 0
    cells = json.loads((tmp_path / "bench-decode.json").read_text())["cells"]
    assert [c["impl"] for c in cells] == ["zoo:causal", "sdpa_dense"]
    assert "profile" not in cells[0] and cells[1]["ms"] > 0
    assert "Where a step's time goes" not in (tmp_path / "bench-decode.md").read_text()
    assert "keys_read" not in cells[0]  # a fixed pattern's keys follow from the pattern
    assert main([*TINY, "variants=[moba]", "peers=[]", f"out={tmp_path}"]) == 0
    (moba,) = json.loads((tmp_path / "bench-decode.json").read_text())["cells"]
    assert 17 <= moba["keys_read"] <= 64  # its own block so far and the chosen ones, of 16


@needs_cxx
def test_sdpa_without_its_split_is_a_cell_of_its_own(tmp_path, capsys):
    """``sdpa_whole``: sdpa with split_keys=False (zoo.backends.split_keys), checked against the
    reference on its own copy of the cache, beside auto; an unknown backend is named."""
    args = [*TINY, "variants=[causal]", "peers=[]", "backends=[auto,sdpa_whole]"]
    assert main([*args, f"out={tmp_path}"]) == 0
    cells = json.loads((tmp_path / "bench-decode.json").read_text())["cells"]
    assert [c["impl"] for c in cells] == ["zoo:causal", "zoo:causal:sdpa_whole"]
    assert all(c["ms"] > 0 and c["error"] < 1e-5 for c in cells)
    assert main([*TINY, "backends=[sdpa_split]", f"out={tmp_path}"]) == 2
    assert "known: auto, flex, sdpa_whole" in capsys.readouterr().err


def test_compiled_steps_are_cells_of_their_own(tmp_path):
    """``compile=[false,true]``: each zoo step eager and under torch.compile, side by side."""
    argv = [*TINY, "variants=[sliding_window]", "peers=[]", "compile=[false,true]"]
    assert main([*argv, "params={sliding_window: {window_size: 8}}", f"out={tmp_path}"]) == 0
    cells = json.loads((tmp_path / "bench-decode.json").read_text())["cells"]
    assert [c["impl"] for c in cells] == ["zoo:sliding_window", "zoo:sliding_window+compile"]
    assert all(c["ms"] > 0 and c["error"] < 1e-5 for c in cells)


def test_a_compiled_step_is_checked_on_its_own_output(tmp_path, monkeypatch):
    """The compiled cell's error is its own step's against the reference (it was the eager
    step's): a compiled step one off everywhere shows as such."""
    import eval.bench.decode as decode

    def off_by_one(step, **kwargs):
        return lambda: step() + 1

    monkeypatch.setattr(decode.torch, "compile", off_by_one)
    argv = [*TINY, "variants=[causal]", "peers=[]", "compile=[false,true]"]
    assert main([*argv, f"out={tmp_path}"]) == 0
    eager, compiled = json.loads((tmp_path / "bench-decode.json").read_text())["cells"]
    assert eager["error"] < 1e-5 and compiled["error"] == pytest.approx(1.0, abs=1e-4)


def test_a_compiled_step_that_fails_is_named_as_compiled(tmp_path, monkeypatch):
    """Its failure was recorded as the eager step's ("zoo:causal"), which the goals then read
    as eager, their summary hiding the compiled step's failure; the eager cell lost its time."""
    import eval.bench.decode as decode

    def broken(step, **kwargs):
        def run():
            raise RuntimeError("Inductor failed\nline two")

        return run

    monkeypatch.setattr(decode.torch, "compile", broken)
    argv = [*TINY, "variants=[causal]", "peers=[]", "compile=[false,true]"]
    assert main([*argv, f"out={tmp_path}"]) == 0
    eager, compiled = json.loads((tmp_path / "bench-decode.json").read_text())["cells"]
    assert eager["impl"] == "zoo:causal" and eager["ms"] > 0
    assert compiled["impl"] == "zoo:causal+compile" and compiled["status"] == "error"
    assert "Inductor failed" in compiled["reason"]


@needs_cxx
def test_static_caches_time_steps_of_one_shape(tmp_path, capsys):
    """``static_cache=true``: the caches are static (every slot read, masked), their steps
    checked against the reference, eager and compiled once with static shapes; a mode that
    torch.compile does not have is refused with its name."""
    argv = [*TINY, "variants=[causal]", "peers=[]", "compile=[false,true]", "static_cache=true"]
    assert main([*argv, f"out={tmp_path}"]) == 0
    data = json.loads((tmp_path / "bench-decode.json").read_text())
    assert data["header"]["config"]["static_cache"] is True
    assert [c["impl"] for c in data["cells"]] == ["zoo:causal", "zoo:causal+compile"]
    assert all(c["ms"] > 0 and c["error"] < 1e-5 for c in data["cells"])
    capsys.readouterr()
    assert main([*argv, "compile_mode=fast", f"out={tmp_path}"]) == 2
    assert "compile_mode: 'fast' is not one of torch.compile's modes" in capsys.readouterr().err


def test_a_cell_that_raises_is_recorded_and_the_others_run(tmp_path):
    """A variant that cannot decode (a mechanism) is a cell with its reason; the next variant is
    measured (before, the run stopped with a traceback and wrote nothing)."""
    argv = [*TINY, "variants=[linear,causal]", "peers=[]", f"out={tmp_path}"]
    assert main(argv) == 0
    cells = json.loads((tmp_path / "bench-decode.json").read_text())["cells"]
    assert cells[0]["variant"] == "linear" and cells[0]["status"] == "error"
    assert "mechanism" in cells[0]["reason"]
    assert cells[1]["variant"] == "causal" and cells[1]["ms"] > 0
    assert "| linear | zoo:linear | - | - |" in (tmp_path / "bench-decode.md").read_text()


@pytest.mark.parametrize(
    "override, message",
    [
        ("dtype=float8", "dtype must be auto or one of float32, bfloat16, float16"),
        ("repeats=0", "repeats must be >= 1"),
        ("variants=[nope]", "unknown variant 'nope'"),
        # checked as bench checks its config (before: an empty axis ran nothing and exited 0,
        # compile=[] timed no zoo step, lengths=[0] was timed, a repeated length timed twice,
        # and kv_heads=3 of 4 heads failed in every cell)
        ("lengths=[]", "lengths must list at least one value, got []"),
        ("variants=[]", "variants must list at least one value, got []"),
        ("compile=[]", "compile must list at least one value, got []"),
        ("lengths=[0]", "lengths must be positive ints, got [0]"),
        ("lengths=[64,64]", "lengths lists 64 more than once, got [64, 64]"),
        ("kv_heads=3", "kv_heads must divide heads (4) or be null, got 3"),
        ("backends=[]", "backends and peers are both empty"),
    ],
)
def test_config_errors_are_named(tmp_path, capsys, override, message):
    """A config error names the key and the value, exits 2 and writes nothing."""
    assert main([*TINY, "peers=[]", override, f"out={tmp_path / 'out'}"]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_column_labels_are_distinct_and_exact():
    """bench-decode.md's columns: n // 1024 showed 512 and 768 both as "0K" and 1536 as "1K"."""
    from eval.bench.decode import markdown

    lengths = [512, 768, 1000, 1024, 1536, 16384]
    cells = [{"variant": "causal", "impl": "zoo:causal", "n": n, "ms": 0.1, "bytes": 2**20}
             for n in lengths]  # fmt: skip
    header = {"device": "cpu", "command": "bench-decode", "shape": "B=1", "repeats": 2,
              "one_kernel_ms": 0.001}  # fmt: skip
    head = next(line for line in markdown(header, cells).splitlines() if line.startswith("| var"))
    assert head == (
        "| variant | impl | 512 ms | 768 ms | 1000 ms | 1K ms | 1.5K ms | 16K ms | 512 MiB | "
        "768 MiB | 1000 MiB | 1K MiB | 1.5K MiB | 16K MiB |"
    )


def test_moba_keys_read_are_the_union_of_its_query_heads_choices():
    """For MoBA the memory floor counts the keys the step's choice reads per key/value head: the
    union of the blocks its query heads chose (the goals' formula counted one head's top_k - 1
    blocks, a floor a grouped step cannot reach). Against moba_choice, block by block."""
    from eval.bench.decode import _fill, routed_keys_read
    from zoo.patterns.moba import moba_choice

    torch.manual_seed(0)
    block, top_k, kv_heads, heads, n = 16, 2, 2, 8, 150
    cache = zoo.new_cache("moba", batch_size=2, max_len=160, num_kv_heads=kv_heads, head_dim=8,
                          block_size=block, top_k=top_k)  # fmt: skip
    _fill(cache, n, torch.Generator().manual_seed(1))
    q = torch.randn(2, heads, 1, 8)
    got = routed_keys_read("moba", {"block_size": block, "top_k": top_k}, q, cache, kv_heads,
                           n - 1)  # fmt: skip
    picks = moba_choice(q, cache.keys[:, :, :n], block_size=block, top_k=top_k, causal=True,
                        q_pos=torch.full((2, 1), n - 1))  # fmt: skip
    own = (n - 1) // block
    counts = []
    for b in range(2):
        for g in range(kv_heads):
            chosen = set(picks[b, g * 4 : (g + 1) * 4, 0].flatten().tolist())
            counts.append(sum((n - 1) % block + 1 if c == own else block for c in chosen))
    assert got == sum(counts) / len(counts)
    one_head = (n - 1) % block + 1 + (top_k - 1) * block
    assert got > one_head  # four query heads per key/value head chose apart
