"""Inductor's CUDA code for graphs of the zoo, written on a CPU for a stand-in sm90 device
(``zoo.testing.stand_in_gpu``): each lowers, and its templates' code holds no name they lack.
Both faults here reached an H200 first (gpu-campaign-h200-2026-11-28-c): the decoding step's
flex mask and MoBA's transposed block lists. Needs triton (``pip install triton``); skipped
without it, and on a machine with a GPU, whose GPU tests compile these graphs for real. Each
case runs in a process of its own (the stand-in's patches are for the rest of a process)."""

from __future__ import annotations

import re

import pytest
import torch
from helpers import skip_without_fake_cuda

from zoo.testing.stand_in_gpu import run_stand_in, written_kernels

PRELUDE = """
import torch, zoo
from zoo.testing.fake_cuda import fake_cuda
from zoo.testing.stand_in_gpu import lowered, stand_in_sm90
zoo.create_attention("causal", dim=32, num_heads=4)  # the registry read on the CPU first

def call(compiled, *args, **kwargs):
    try:
        compiled(*args, **kwargs)
        print("RAN")
    except Exception as error:
        print("LOWERED" if lowered(error) else "FAULT " + repr(error)[:3000])
"""


@pytest.fixture
def stand_in():
    pytest.importorskip("triton", reason="the stand-in writes Triton code: pip install triton")
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the GPU tests compile these graphs for real")
    skip_without_fake_cuda()


@pytest.mark.usefixtures("stand_in")
@pytest.mark.parametrize("variant", ["causal", "sliding_window"])
def test_a_static_caches_step_on_flex_lowers_without_xblock(variant, tmp_path):
    """A one-token step over a static cache, compiled whole on flex: its mask read a one-token
    arange at a constant index, which Inductor wrote as ``tl.full([XBLOCK], 0)`` inside the flex
    template (no XBLOCK there: every such step failed to compile on the H200)."""
    params = {"sliding_window": {"window_size": 8}}.get(variant, {})
    script = (
        PRELUDE
        + f"""
with fake_cuda(), torch.device("cuda"), torch.no_grad():
    attn = zoo.create_attention({variant!r}, dim=32, num_heads=4, num_kv_heads=2, causal=True,
                                backend="flex", **{params!r}).eval()
    cache = attn.new_cache(2, 64, static=True)
    x = torch.randn(2, 1, 32)
    compiled = torch.compile(attn, dynamic=False, fullgraph=True)
    stand_in_sm90()
    call(compiled, x, cache=cache)
"""
    )
    out = run_stand_in(script, tmp_path / "inductor")
    assert "LOWERED" in out, out
    kernels = written_kernels(tmp_path / "inductor", templates=True)
    assert kernels, "no template kernel written"
    assert not [name for name, code in kernels.items() if "tl.full([XBLOCK]" in code], kernels


@pytest.mark.usefixtures("stand_in")
def test_moba_rows_with_their_transposed_lists_lower(tmp_path):
    """MoBA's rows (``flex_chosen._row_layout``) where a backward will read the transposed block
    lists, at the H200 benchmark's shapes (B=1, 16 heads, 16K, blocks of 512, top 3): their
    transposed read failed Inductor's tiling there ('list indices must be integers or slices,
    not NoneType'), and the rows ran eagerly. With torch 2.11 (the GPU machine's) the old read
    fails here; torch 2.13 lowers it."""
    script = (
        PRELUDE
        + """
from zoo.backends.flex_chosen import _row_layout
with fake_cuda(), torch.device("cuda"):
    picks = torch.zeros(1, 16, 16384, 3, dtype=torch.int32)
    keep = torch.ones(1, 16384, dtype=torch.bool)
    compiled = torch.compile(_row_layout.fn)
    stand_in_sm90()
    call(compiled, picks, keep, None, 32, 512, 16384, 0, 128, True)
"""
    )
    out = run_stand_in(script, tmp_path / "inductor")
    assert "LOWERED" in out, out
    assert written_kernels(tmp_path / "inductor"), "no kernel written"


@pytest.mark.usefixtures("stand_in")
def test_a_static_caches_step_with_its_keys_split_lowers(tmp_path):
    """A one-token step over a static cache of 4096 slots on auto (sdpa), compiled whole, lowers
    with its masked keys split (``zoo.backends.split_keys``): 2 rows x 2 key/value heads read as
    4 runs of 1024 slots in one call of the memory-efficient kernel, views of the cache's store
    (Inductor's code reinterprets the graph's input, copies nothing). The lse kernel's wrapping
    read the mask's storage offset, which dynamo cannot trace: the step did not compile whole."""
    script = (
        PRELUDE
        + """
with fake_cuda(), torch.no_grad():
    with torch.device("cuda"):  # (traced outside it: a model moved to the GPU, as users do)
        torch.set_default_dtype(torch.bfloat16)  # (a fake module's .to() cannot swap weights)
        attn = zoo.create_attention("causal", dim=64, num_heads=4, num_kv_heads=2, causal=True)
        cache = attn.eval().new_cache(2, 4096, static=True)
        x = torch.randn(2, 1, 64)
    compiled = torch.compile(attn, dynamic=False, fullgraph=True)
    stand_in_sm90()
    call(compiled, x, cache=cache)
"""
    )
    out = run_stand_in(script, tmp_path / "inductor")
    assert "LOWERED" in out, out
    calls = _efficient_attention_calls(tmp_path / "inductor")
    chunked = r"reinterpret_tensor\(arg\d+_1, \(4, 4, 1024, 16\)"
    assert len(calls) == 1 and len(re.findall(chunked, calls[0])) == 2, calls


@pytest.mark.usefixtures("stand_in")
def test_the_split_of_a_growing_cache_lowers_at_symbolic_lengths(tmp_path):
    """``split_keys_attention`` alone, as ``zoo.core.fused`` compiles it for an eager step of a
    cache whose slots grow (the slot count symbolic after a second length): it lowers, its
    runs still views of the store."""
    script = (
        PRELUDE
        + """
from zoo.backends.split_keys import split_keys_attention
with fake_cuda():
    q = torch.randn(8, 16, 1, 128, device="cuda", dtype=torch.bfloat16)
    keys = torch.randn(8, 4, 20000, 128, device="cuda", dtype=torch.bfloat16)[:, :, :16411]
    mask = torch.ones(8, 1, 1, 16411, device="cuda", dtype=torch.bool)
    torch._dynamo.mark_dynamic(keys, 2)
    torch._dynamo.mark_dynamic(mask, 3)
    compiled = torch.compile(split_keys_attention.fn)
    stand_in_sm90()
    call(compiled, q, keys, keys, mask, None, 8)
"""
    )
    out = run_stand_in(script, tmp_path / "inductor")
    assert "LOWERED" in out, out
    calls = _efficient_attention_calls(tmp_path / "inductor")
    assert len(calls) == 2, calls  # the runs of 1024 and the last one
    assert all(call.count("reinterpret_tensor(arg") >= 2 for call in calls), calls


def _efficient_attention_calls(cache_dir) -> list[str]:
    """The arguments of each call of the memory-efficient kernel in Inductor's code written in
    ``cache_dir``."""
    code = "".join(path.read_text() for path in cache_dir.glob("*/*.py"))
    return re.findall(r"_scaled_dot_product_efficient_attention\.default\((.*)\)", code)
