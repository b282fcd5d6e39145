"""A decoding loop under ``torch.compile``: the module's steps with a cache compile a bounded
number of times (the host's bookkeeping, widths read from Python ints the cache keeps, runs
between graphs; the lengths become dynamic after one recompilation) and equal eager steps; with
a static cache, one graph of fixed shapes for every step (what CUDA graphs need)."""

from __future__ import annotations

import pytest
import torch
from helpers import gpu
from torch._dynamo.testing import CompileCounter

import zoo
from zoo.backends import FlexBackend, SdpaBackend
from zoo.backends import sdpa as sdpa_module

VARIANTS = {
    "causal": {},
    "sliding_window": {"window_size": 8},
    "longformer": {"window_size": 8, "global_tokens": 2},
    "bigbird": {"block_size": 8, "random_blocks": 1},
    "moba": {"block_size": 8, "top_k": 2},
}


def _pair(variant: str, backend: object = "auto"):
    attn = zoo.create_attention(variant, dim=32, num_heads=4, num_kv_heads=2, causal=True,
                                backend=backend, **VARIANTS[variant]).eval()  # fmt: skip
    eager = zoo.create_attention(variant, dim=32, num_heads=4, num_kv_heads=2, causal=True,
                                 **VARIANTS[variant]).eval()  # fmt: skip
    eager.load_state_dict(attn.state_dict())
    return attn, eager


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_compiled_steps_stop_compiling_and_equal_eager(variant):
    """After the second step no frame compiles again over 20 more steps (each step's width one
    slot more, rows of two lengths), and every output equals the eager module's."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    attn, eager = _pair(variant)
    counter = CompileCounter()
    compiled = torch.compile(attn, backend=counter)
    x = torch.randn(2, 40, 32)
    lens = torch.tensor([10, 7])
    with torch.no_grad():
        mine, theirs = attn.new_cache(2, 64), eager.new_cache(2, 64)
        got = compiled(x[:, :10], cache=mine, valid_lens=lens)
        assert torch.equal(got, eager(x[:, :10], cache=theirs, valid_lens=lens))
        for i in range(10, 32):
            if i == 12:
                settled = counter.frame_count
            got = compiled(x[:, i : i + 1], cache=mine)
            assert torch.equal(got, eager(x[:, i : i + 1], cache=theirs)), i
    assert counter.frame_count == settled, (settled, counter.frame_count)


def test_compiled_steps_of_rows_of_one_length_equal_eager():
    """Rows of one length take the host's shortcuts (the slot found on the host; a block-local
    query's block read from the ring's first slots, a table built on first use): under
    torch.compile too, each step equals the eager module's (the table's build once failed
    inside a traced step: ``zoo.core.shape_cache``)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    attn = zoo.create_attention("block_local", dim=32, num_heads=4, num_kv_heads=2, causal=True,
                                block_size=8).eval()  # fmt: skip
    compiled = torch.compile(attn, backend="eager")
    x = torch.randn(2, 18, 32)
    with torch.no_grad():
        mine, theirs = attn.new_cache(2, 32), attn.new_cache(2, 32)
        compiled(x[:, :13], cache=mine)
        attn(x[:, :13], cache=theirs)
        for i in range(13, 18):  # across a block's start
            got = compiled(x[:, i : i + 1], cache=mine)
            assert torch.equal(got, attn(x[:, i : i + 1], cache=theirs)), i


# flex named for a static cache (auto takes sdpa: zoo.decoding.decode): these, on flex's eager
# kernel here, trace the same step as one graph; the GPU test below lowers it with Inductor.
FLEX_STATIC = ["causal", "sliding_window", "longformer"]


@pytest.mark.parametrize(
    "variant,backend",
    [(v, "auto") for v in VARIANTS] + [(v, "flex") for v in FLEX_STATIC],
)
def test_a_static_cache_steps_in_one_graph_of_fixed_shapes(variant, backend):
    """``new_cache(static=True)``: a step reads every slot (masked) and the host keeps no bound
    that changes, so the step compiled whole (fullgraph) with static shapes is one graph for
    every step, as one CUDA graph needs (torch.compile(mode="reduce-overhead")): no recompile
    over 22 steps after a prefill of rows of two lengths, each step equal to the eager module's
    with a cache that is not static. Without ``static`` the same compile fails (control)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    flex = FlexBackend(block_size=16, compile=False)  # flex's eager kernel: CPU, tests only
    attn, eager = _pair(variant, flex if backend == "flex" else backend)
    x = torch.randn(2, 40, 32)
    lens = torch.tensor([10, 7])
    compiled = torch.compile(attn, backend="eager", fullgraph=True, dynamic=False)
    with torch.no_grad(), torch._dynamo.config.patch(error_on_recompile=True):
        mine, theirs = attn.new_cache(2, 64, static=True), eager.new_cache(2, 64)
        got = attn(x[:, :10], cache=mine, valid_lens=lens)
        assert torch.allclose(got, eager(x[:, :10], cache=theirs, valid_lens=lens), atol=1e-6)
        for i in range(10, 32):
            got = compiled(x[:, i : i + 1], cache=mine)
            assert torch.allclose(got, eager(x[:, i : i + 1], cache=theirs), atol=1e-6), i
        moving = attn.new_cache(2, 64)
        attn(x[:, :10], cache=moving, valid_lens=lens)
        with pytest.raises(torch._dynamo.exc.TorchDynamoException):
            for i in range(10, 13):
                compiled(x[:, i : i + 1], cache=moving)
    torch._dynamo.reset()


# Static caches of 4096 slots on sdpa: its masked slots split into 4 runs of 1024
# (zoo.backends.split_keys), or read in one piece
MANY_SLOTS = [("causal", SdpaBackend(split_keys=split), 4096) for split in (True, False)]


@gpu
@pytest.mark.parametrize(
    "variant,backend,max_len",
    [(v, "auto", 64) for v in ("causal", "sliding_window", "moba")]
    + [(v, "flex", 64) for v in FLEX_STATIC]
    + MANY_SLOTS,
    ids=lambda x: repr(x) if isinstance(x, SdpaBackend) else None,
)
def test_gpu_static_cache_steps_under_cuda_graphs_equal_eager(
    variant, backend, max_len, monkeypatch
):
    """The static cache's steps compiled with mode="reduce-overhead" run as CUDA graphs (no
    graph skipped: the cache's stores, written in place, are static addresses) and equal eager
    steps on a cache that is not static. On flex too (named: on torch 2.11 Inductor's code for
    its mask failed, ``XBLOCK is not defined``, when auto took flex for a static cache); and
    over many slots on sdpa, split into runs (traced so) or not."""
    runs = []
    split = sdpa_module.key_chunk
    monkeypatch.setattr(
        sdpa_module, "key_chunk", lambda *args: runs.append(split(*args)) or runs[-1]
    )
    torch._dynamo.reset()
    torch.manual_seed(0)
    attn, eager = (m.cuda() for m in _pair(variant, backend))
    x = torch.randn(2, 40, 32, device="cuda")
    compiled = torch.compile(attn, mode="reduce-overhead", dynamic=False)
    from torch._dynamo.utils import counters

    counters.clear()
    with torch.no_grad():
        mine, theirs = attn.new_cache(2, max_len, static=True), eager.new_cache(2, max_len)
        attn(x[:, :10], cache=mine)
        eager(x[:, :10], cache=theirs)
        for i in range(10, 30):
            got = compiled(x[:, i : i + 1], cache=mine).clone()
            assert torch.allclose(got, eager(x[:, i : i + 1], cache=theirs), atol=1e-5), i
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])
    if isinstance(backend, SdpaBackend):  # its steps traced with runs of 1024 slots, or none
        assert any(runs) == backend.split_keys, runs
    torch._dynamo.reset()


def test_a_one_token_steps_positions_trace_without_an_arange():
    """A one-token step's positions (``KVCache.next_positions(1)``) are its rows' lengths, traced
    with no arange: in a step compiled whole for CUDA, Inductor copied lengths + arange(1) into
    FlexAttention's mask, where the arange's one element at a constant index became
    ``tl.full([XBLOCK], 0)``, which the flex template cannot compile (every compiled static step
    on flex failed so on an H200; the same code was lowered here for a stand-in sm90 device, with
    and without this change). A longer call's keep their arange (indexed by the query)."""
    cache = zoo.new_cache("causal", batch_size=2, max_len=8, num_kv_heads=1, head_dim=4)
    cache.lengths = torch.tensor([3, 5])
    graphs = []

    def keep(gm, inputs):
        graphs.append(gm)
        return gm.forward

    for t in (1, 2):
        got = torch.compile(lambda t=t: cache.next_positions(t), backend=keep, fullgraph=True)()
        assert torch.equal(got, torch.tensor([[3], [5]]) + torch.arange(t))
    made = [[n.target for n in gm.graph.nodes if n.op == "call_function"] for gm in graphs]
    assert torch.arange not in made[0] and torch.arange in made[1], made
    one = cache.next_positions(1)
    one += 1  # a tensor of its own: the cache's lengths are not changed through it
    assert torch.equal(cache.lengths, torch.tensor([3, 5]))
    torch._dynamo.reset()


def test_a_static_cache_marks_its_stores_static_addresses():
    """What a step writes in place (keys, values, slot positions, lengths, MoBA's block sums) is
    marked for torch.compile as a static address, again after reset: cudagraph trees skip a
    graph whose ordinary inputs it mutates, which would leave a static cache's steps
    launch by launch. A growing cache marks nothing."""

    def marked(t):
        return getattr(t, "_dynamo_static_input_type", None) is not None

    attn, _ = _pair("moba")
    with torch.no_grad():
        cache = attn.new_cache(2, 64, static=True)
        attn(torch.randn(2, 10, 32), cache=cache)  # MoBA's block sums made
        stores = [cache.keys, cache.values, cache.slot_pos, cache._lengths]
        stores += [t for sums in cache._block_sums.values() for t in (sums.sums, sums.counts)]
        assert len(stores) == 6 and all(marked(t) for t in stores)
        cache.reset()
        assert all(marked(t) for t in (cache.keys, cache.values, cache.slot_pos, cache._lengths))
        growing = attn.new_cache(2, 64)
        assert not any(marked(t) for t in (growing.keys, growing.values, growing.slot_pos))


def test_a_compiled_static_step_past_max_len_is_refused_on_the_device():
    """The host keeps no bound for a static cache, and a traced step reads no value: its range
    check is a device-side assertion, in the compiled step too (before it, nothing was checked
    there and a step past max_len wrote over the last slot)."""
    torch._dynamo.reset()
    attn, _ = _pair("causal")
    compiled = torch.compile(attn, backend="eager", fullgraph=True, dynamic=False)
    x = torch.randn(2, 12, 32)
    with torch.no_grad():
        cache = attn.new_cache(2, 8, static=True)
        attn(x[:, :6], cache=cache)
        compiled(x[:, 6:7], cache=cache)
        compiled(x[:, 7:8], cache=cache)
        with pytest.raises(RuntimeError, match="step too long: past the cache's max_len=8"):
            compiled(x[:, 8:9], cache=cache)
    torch._dynamo.reset()


def test_static_must_be_a_bool():
    with pytest.raises(TypeError, match="static must be True or False, got 1"):
        zoo.new_cache("causal", batch_size=1, max_len=8, num_kv_heads=1, head_dim=4, static=1)


def test_inductor_steps_equal_eager():
    """The same loop compiled by Inductor (causal), within float32 rounding."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    attn, eager = _pair("causal")
    compiled = torch.compile(attn)
    x = torch.randn(2, 20, 32)
    with torch.no_grad():
        mine, theirs = attn.new_cache(2, 32), eager.new_cache(2, 32)
        compiled(x[:, :8], cache=mine)
        eager(x[:, :8], cache=theirs)
        for i in range(8, 16):
            got, want = compiled(x[:, i : i + 1], cache=mine), eager(x[:, i : i + 1], cache=theirs)
            assert (got - want).abs().max() < 1e-5, i
