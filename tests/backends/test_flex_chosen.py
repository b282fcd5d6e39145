"""flex on key blocks chosen by content (``zoo.backends.flex_chosen``): the queries gathered by
chosen key block, one kernel call, merged by log-sum-exp. Forward through eager FlexAttention on
a CPU; gradients through an emulated kernel that reads the block mask as the GPU kernel does
(tests/flex_emulation.py: a block claimed FULL is scored whole, so a false claim shows); the
scores it computes are those of the choice, not of the union per query block."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from flex_emulation import emulated_flex
from helpers import check_against_reference, gpu

import zoo
from zoo.backends import flex as flex_module
from zoo.backends import flex_kernel
from zoo.backends.flex import FlexBackend
from zoo.backends.flex_chosen import gathered_rows_of
from zoo.core.prepare import prepare_call
from zoo.layout.frames import build_frame
from zoo.patterns.local import Local
from zoo.patterns.moba import Moba

pytestmark = pytest.mark.usefixtures("scalar_cpu_code")  # the graphs a GPU runs (conftest)

# (q_len, kv_len, MoBA's block, the kernel's block): lengths no block divides; a MoBA block the
# kernel's divides, and one it does not (24 keys straddle kernel blocks of 16)
SHAPES = [(300, 300, 32, 16), (150, 300, 24, 16), (201, 201, 16, 16)]


def _row_layout_args(call, block):
    """``_row_layout``'s arguments for ``call`` at kernel blocks of ``block``, the transposed
    lists included, as ``gathered_rows_of`` passes them."""
    from zoo.backends.flex_chosen import chosen_parts, kept_keys

    chosen, fixed = chosen_parts(call.pattern)
    return (chosen.picks, kept_keys(call, block), fixed, chosen.blocks, chosen.block_size,
            call.kv_len, int(chosen.offset), block, True)  # fmt: skip


def _inputs(q_len, kv_len, padded, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, q_len, 16, generator=g)
    k = torch.randn(2, 2, kv_len, 16, generator=g)  # grouped: 2 query heads per key head
    v = torch.randn(2, 2, kv_len, 8, generator=g)
    padding = None
    if padded:
        padding = torch.zeros(2, kv_len, dtype=torch.bool)
        padding[1, kv_len - 70 :] = True
        k[1, :, kv_len - 70 :] = float("nan")  # padded keys must not reach any output
        v[1, :, kv_len - 70 :] = float("nan")
    return q, k, v, padding


class _Differentiable(FlexBackend):
    """flex with a backward on a CPU: its kernel emulated (tests/flex_emulation.py)."""

    capabilities = replace(FlexBackend.capabilities, backward=("cpu", "cuda"))


@pytest.fixture
def gathered(monkeypatch):
    """Counts the calls that ran on gathered rows."""
    calls = []
    original = flex_module.gathered_rows_of

    def counted(*args, **kwargs):
        calls.append(args[0].variant)
        return original(*args, **kwargs)

    monkeypatch.setattr(flex_module, "gathered_rows_of", counted)
    return calls


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_gathered_rows_give_moba_forward_on_eager_flex(shape, causal, padded, gathered):
    q_len, kv_len, size, block = shape
    q, k, v, padding = _inputs(q_len, kv_len, padded)
    kw = dict(variant="moba", block_size=size, top_k=3, causal=causal, key_padding_mask=padding)
    got = zoo.attention(q, k, v, backend=FlexBackend(block_size=block, compile=False), **kw)
    want = zoo.attention(q, k, v, backend="reference", **kw)
    assert gathered == ["moba"]
    assert not got.isnan().any()
    assert (got - want).abs().max() < 1e-5


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_gathered_rows_give_moba_gradients_through_the_kernel_and_the_merge(
    shape, causal, padded, gathered, monkeypatch
):
    """The kernel emulated on a CPU as the GPU's reads the block mask (FULL blocks unasked): the
    output and the gradients of q, k and v through the gather, the kernel's output and
    log-sum-exp, and the merge equal the reference's."""
    monkeypatch.setattr(flex_kernel, "_kernel", lambda *args: emulated_flex)
    q_len, kv_len, size, block = shape
    q, k, v, padding = _inputs(q_len, kv_len, padded)
    if padding is not None:  # NaN gradients would flow to padded keys through 0 * NaN otherwise
        k, v = k.nan_to_num(0.0), v.nan_to_num(0.0)
    kw = dict(variant="moba", block_size=size, top_k=3, causal=causal, key_padding_mask=padding)
    outs, grads = [], []
    for backend in (_Differentiable(block_size=block, compile=False), "reference"):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out = zoo.attention(*leaves, backend=backend, **kw)
        g = torch.Generator().manual_seed(1)
        out.backward(torch.randn(out.shape, generator=g))
        outs.append(out)
        grads.append([x.grad for x in leaves])
    assert gathered == ["moba"]
    assert (outs[0] - outs[1]).abs().max() < 1e-5
    for got, want in zip(*grads, strict=True):
        assert (got - want).abs().max() < 1e-5


def test_the_bookkeeping_compiled_as_on_a_gpu_gives_the_reference(gathered, monkeypatch):
    """What a GPU runs (``zoo.core.fused``: the block sums, the choice, the rows and their merge
    each compiled, the merge's backward too), forced on a CPU around the emulated kernel: the
    reference's output and gradients at lengths no block divides, causal (a fixed member cuts
    the own block), padded, one sequence wholly (rows without a key: zeros, no NaN); each
    function compiles at most twice over three lengths (a static graph, then one of symbolic
    lengths). Without a fixed member the rows are traced in
    ``test_the_rows_compiled_equal_the_eager_rows_in_two_graphs_for_every_length``."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from zoo.backends.flex_chosen import _merge_pairs, _row_layout
    from zoo.core import fused
    from zoo.decoding.block_sums import _sums
    from zoo.patterns.moba import _choose

    functions = (_sums, _choose, _row_layout, _merge_pairs)
    torch._dynamo.reset()
    for function in functions:
        function.__dict__.pop("compiled", None)
        monkeypatch.setattr(function, "failures", {})
    monkeypatch.setattr(fused, "fuses", lambda t: not torch.compiler.is_compiling())
    monkeypatch.setattr(flex_kernel, "_kernel", lambda *args: emulated_flex)
    counted = flex_module.gathered_rows_of  # the compiled kernel's path: the rows fused
    monkeypatch.setattr(flex_module, "gathered_rows_of", lambda c, b, fuse: counted(c, b))
    merge = flex_module.merged_per_query
    monkeypatch.setattr(flex_module, "merged_per_query", lambda *a, fuse: merge(*a))
    for n in (300, 517, 777):
        q, k, v, padding = _inputs(n, n, padded=True, seed=n)
        padding[0] = True  # a sequence of padding only
        k, v = k.nan_to_num(0.0), v.nan_to_num(0.0)
        kw = dict(variant="moba", block_size=64, top_k=3, causal=True, key_padding_mask=padding)
        outs, grads = [], []
        for backend in (_Differentiable(block_size=16, compile=False), "reference"):
            leaves = [x.clone().requires_grad_() for x in (q, k, v)]
            out = zoo.attention(*leaves, backend=backend, **kw)
            out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(1)))
            outs.append(out)
            grads.append([x.grad for x in leaves])
        assert not outs[0].isnan().any()
        assert (outs[0] - outs[1]).abs().max() < 1e-5, n
        for got, want in zip(*grads, strict=True):
            assert not got.isnan().any()
            assert (got - want).abs().max() < 1e-5, n
    assert gathered == ["moba"] * 3
    for function in functions:
        assert function.failed is None, function.failed
        graphs = len(_debug_get_cache_entry_list(function.fn.__code__))
        assert 1 <= graphs <= 2, (function.fn.__qualname__, graphs)


@pytest.mark.parametrize("seed", range(12))
def test_random_shapes_and_intersections_on_the_rows(seed, monkeypatch):
    """Any batch, lengths (fewer or more queries than keys), block sizes (a MoBA block smaller
    or larger than the kernel's, dividing it or not), top_k, padding (rows wholly padded too)
    and fixed members (a window, causal): the rows, taken even where they would not pay, give
    the reference's output and gradients through the emulated kernel."""
    monkeypatch.setattr(flex_kernel, "_kernel", lambda *args: emulated_flex)
    monkeypatch.setattr(flex_module, "gathered_pays", lambda *args: True)
    g = torch.Generator().manual_seed(seed)

    def pick(*options):
        return options[int(torch.randint(len(options), (1,), generator=g))]

    B, q_len, kv_len = pick(1, 2, 3), pick(5, 33, 70), pick(9, 40, 90)
    size, block, top_k = pick(3, 8, 12, 33), pick(4, 8, 16), pick(1, 2, 3, 5)
    pattern = Moba(block_size=size, top_k=top_k)
    fixed = pick(None, Local((7, 3)), Local((20, 0)))
    kw = dict(variant=pattern if fixed is None else pattern & fixed, causal=bool(seed % 2))
    q = torch.randn(B, 2, q_len, 8, generator=g)
    k, v = (torch.randn(B, 1, kv_len, 8, generator=g) for _ in range(2))
    padding = torch.rand(B, kv_len, generator=g) < pick(0.0, 0.3, 0.9)
    padding[0] = seed % 3 == 0  # a row of padding only, now and then
    kw["key_padding_mask"] = padding
    flex = _Differentiable(block_size=block, compile=False)
    assert flex.gathers(prepare_call(q, k, v, **kw))
    results = []
    for backend in (flex, "reference"):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out = zoo.attention(*leaves, backend=backend, **kw)
        out.backward(torch.ones_like(out))
        results.append([out, *(x.grad for x in leaves)])
    for got, want in zip(*results, strict=True):
        assert not got.isnan().any()
        assert (got - want).abs().max() < 1e-5


def test_the_kernel_scores_the_chosen_pairs_not_their_union_per_query_block():
    """At 4K tokens, blocks of 256, top 3, random inputs: the rows' kernel blocks score at most
    the chosen pairs plus one partly filled kernel block per chosen block, under a third of the
    union's block mask (in which a kernel query block's 128 queries chose most blocks)."""
    q, k, v, _ = _inputs(4096, 4096, padded=False)
    q, k, v = q[:1, :2], k[:1, :1], v[:1, :1]
    flex = FlexBackend(block_size=128, compile=False)
    call = prepare_call(q, k, v, variant="moba", block_size=256, top_k=3)
    assert flex.gathers(call)
    full, partial, _ = flex.block_counts(call)
    chosen = 4096 * 3 * 256
    assert partial == 0  # MoBA's blocks are whole kernel blocks: nothing asks the mask_mod
    assert full * 128 * 128 <= chosen + 16 * 128 * 256
    frame = build_frame(1, call.q_len, call.kv_len, 128, 128, call.device)
    union = flex_module._counts(
        call.pattern.block_state(frame.q.spans().column(), frame.k.spans().row())
    )
    assert (full + partial) < (union[0] + union[1]) / 3
    assert "queries gathered by chosen key block" in flex.layout_note(call)


@pytest.mark.parametrize("case", ["compiled on a cpu", "union with a fixed pattern", "dense"])
def test_calls_that_the_rows_would_not_serve_keep_the_union(case):
    q, k, v, _ = _inputs(300, 300, padded=False)
    flex = FlexBackend(block_size=16, compile=case == "compiled on a cpu")
    kw = dict(variant="moba", block_size=32, top_k=3)
    if case == "union with a fixed pattern":
        kw = dict(variant=Moba(block_size=32, top_k=3) | Local((8, 0)))
    if case == "dense":  # every query chooses all 4 blocks: its rows would score every key
        kw.update(block_size=80, top_k=4)
    assert not flex.gathers(prepare_call(q, k, v, **kw))


def test_the_rows_trace_as_one_graph():
    """No graph break where the rows are made (a count read on the host would be one): a model
    compiled on a GPU holds MoBA's whole layout in its graph, and equal rows come out."""
    q, k, _, _ = _inputs(1900, 2000, padded=False)
    call = prepare_call(q, k, k, variant="moba", block_size=256, top_k=3, causal=True)

    def rows_of(q, k):
        rows = gathered_rows_of(replace(call, q=q, k=k, v=k), 128)
        mask = rows.block_mask
        return rows.row_query, rows.pair_row, mask.kv_num_blocks, mask.full_kv_indices

    traced = torch.compile(rows_of, fullgraph=True, backend="eager")(q, k)
    for got, want in zip(traced, rows_of(q, k), strict=True):
        assert torch.equal(got, want)


def test_a_compiled_model_runs_the_rows_without_compiling_again(monkeypatch):
    """Three calls of a compiled function (new inputs, so a new choice each time): one graph,
    the rows traced into it. On a CPU the rows run only eagerly (compiled flex there has no
    log-sum-exp), so the test takes the GPU's side of ``whole_blocks`` and ``compiled_on_cpu``;
    dynamo's eager backend runs the graph."""
    import torch._dynamo

    monkeypatch.setattr(FlexBackend, "whole_blocks", lambda self, call: False)
    monkeypatch.setattr(FlexBackend, "compiled_on_cpu", lambda self, call: False)
    flex = FlexBackend(block_size=16, compile=False)

    def layer(q, k, v):
        return zoo.attention(q, k, v, backend=flex, variant="moba", block_size=32, top_k=3,
                             causal=True)  # fmt: skip

    graphs = []

    def recorded(graph, example_inputs):  # dynamo's eager backend, keeping the graph
        graphs.append(graph)
        return graph.forward

    torch._dynamo.reset()
    compiled = torch.compile(layer, backend=recorded)
    try:
        with torch._dynamo.config.patch(error_on_recompile=True):
            for seed in range(3):
                q, k, v, _ = _inputs(300, 300, padded=False, seed=seed)
                call = prepare_call(q, k, v, variant="moba", block_size=32, top_k=3, causal=True)
                assert flex.gathers(call)
                assert (compiled(q, k, v) - layer(q, k, v)).abs().max() < 1e-5
    finally:
        torch._dynamo.reset()
    # one graph, and the rows are in it (their counts per segment: a scatter_add_)
    assert len(graphs) == 1
    assert any("scatter_add" in str(node.target) for node in graphs[0].graph.nodes)


def test_gathered_rows_run_on_fake_cuda_tensors(gathered):
    """The rows' count is fixed by the shapes: the CUDA path runs on fake tensors, no device mix
    (a CPU padding mask moved to the keys' device)."""
    from zoo.testing.fake_cuda import FakeCudaUnavailable, fake_cuda

    try:
        with fake_cuda():
            q = torch.randn(2, 4, 1900, 16, device="cuda")
            k = torch.randn(2, 2, 2000, 16, device="cuda")
            v = torch.randn(2, 2, 2000, 8, device="cuda")
            padding = torch.zeros(2, 2000, dtype=torch.bool)
            out = zoo.attention(q, k, v, variant="moba", block_size=256, top_k=3, causal=True,
                                backend="flex", key_padding_mask=padding)  # fmt: skip
    except FakeCudaUnavailable as error:
        pytest.skip(str(error))
    assert gathered == ["moba"]
    assert out.device.type == "cuda" and out.shape == (2, 4, 1900, 8)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_gpu_gathered_moba_forward_backward_matches_reference(causal, dtype, gathered):
    """The compiled kernel's log-sum-exp and its gradient (the merge's), grouped heads, lengths
    no block divides, key padding, by the tolerance convention."""
    for padded, (q_len, kv_len) in [(False, (1000, 1000)), (True, (900, 1000))]:
        check_against_reference(
            "moba", "flex", q_len=q_len, kv_len=kv_len, causal=causal, padded=padded,
            params={"block_size": 128, "top_k": 3}, dtype=dtype, device="cuda", head_dim=64,
            heads=4, kv_heads=2,
        )  # fmt: skip
    assert "moba" in gathered
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from zoo.backends.flex_chosen import _merge_pairs, _row_layout
    from zoo.decoding.block_sums import _sums
    from zoo.patterns.moba import _choose

    # the block sums, the choice, the rows and their merge ran compiled (``zoo.core.fused``):
    # graphs in dynamo's cache of their code, and no failure that sent them back to eager
    for fused in (_sums, _choose, _row_layout, _merge_pairs):
        assert fused.failed is None
        assert _debug_get_cache_entry_list(fused.fn.__code__), fused.fn.__qualname__


@gpu
def test_gpu_rows_compile_for_both_kinds_in_one_process(monkeypatch):
    """The rows' layout compiled on CUDA (``zoo.core.fused``) without a fixed member, then with
    one (causal), at two lengths each, in one process, as the gathered tests ran on one worker:
    no graph fails back to eager, and the rows equal the eager function's. On the H200 (torch
    2.11) the causal kind failed in Inductor with a bare AssertionError after the other kind had
    compiled (``[causal-bf16]`` after ``[bidirectional-*]`` of the test above, on one worker);
    alone (``[causal-fp32]``, another worker) it passed, and on a CPU the same calls lower."""
    from zoo.backends.flex_chosen import _row_layout

    torch._dynamo.reset()
    _row_layout.__dict__.pop("compiled", None)
    monkeypatch.setattr(_row_layout, "failures", {})
    flat = torch.utils._pytree.tree_leaves
    for causal in (False, True):
        for (q_len, kv_len), padded in (((1000, 1000), False), ((900, 1000), True)):
            q, k, v, padding = (
                None if t is None else t.cuda() for t in _inputs(q_len, kv_len, padded, seed=q_len)
            )
            call = prepare_call(q, k, v, variant="moba", block_size=128, top_k=3, causal=causal,
                                key_padding_mask=padding)  # fmt: skip
            args = _row_layout_args(call, 128)
            got, want = _row_layout(*args), _row_layout.fn(*args)
            assert _row_layout.failed is None, (causal, q_len, _row_layout.failed)
            assert all(torch.equal(a, b) for a, b in zip(flat(got), flat(want), strict=True))
    torch._dynamo.reset()


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_the_transposed_lists_are_those_flex_computes(shape, causal, padded):
    """A call that records gradients: the kernel query blocks of each kernel key block, made
    with the rows' layout (one compiled graph on a GPU), are exactly what
    ``BlockMask.from_kv_blocks`` computes from the key blocks' lists (backward reads them)."""
    from zoo.backends.flex_chosen import SKIPS_Q_BLOCKS
    from zoo.backends.flex_kernel import _flex_module

    if not SKIPS_Q_BLOCKS:
        pytest.skip("this torch's from_kv_blocks computes them itself")
    q_len, kv_len, size, block = shape
    q, k, v, padding = _inputs(q_len, kv_len, padded)
    q.requires_grad_()
    call = prepare_call(q, k, v, variant="moba", block_size=size, top_k=3, causal=causal,
                        key_padding_mask=padding)  # fmt: skip
    got = gathered_rows_of(call, block).block_mask
    want = _flex_module().BlockMask.from_kv_blocks(
        got.kv_num_blocks, got.kv_indices, got.full_kv_num_blocks, got.full_kv_indices,
        BLOCK_SIZE=block, seq_lengths=got.seq_lengths,
    )  # fmt: skip
    for name in ("q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices"):
        assert getattr(got, name).dtype == getattr(want, name).dtype, name
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    without = gathered_rows_of(prepare_call(q.detach(), k, v, variant="moba", block_size=size,
                                            top_k=3, causal=causal, key_padding_mask=padding),
                               block).block_mask  # fmt: skip
    assert without.q_num_blocks is None  # a forward alone: nothing transposed


def test_the_rows_compiled_equal_the_eager_rows_in_two_graphs_for_every_length():
    """What a GPU runs (``zoo.core.fused``: the rows' bookkeeping compiled), on a CPU: the same
    rows and block lists as the eager function, at lengths no block divides, causal (a fixed
    member cuts the own block) or not, padded or not; and each of the two layouts compiles at
    most twice (a static graph, then one of symbolic lengths) over four lengths. Dynamo's graphs
    run without Inductor (``aot_eager``): the graph count and the traced values are this test's
    subject. Inductor lowers the rows with a fixed member on a CPU in
    ``test_the_bookkeeping_compiled_as_on_a_gpu_gives_the_reference``, and those without one on
    a GPU only (the GPU tests); lowering them here cost CI 30-45 s."""
    from torch._dynamo.utils import counters

    from zoo.backends.flex_chosen import _row_layout

    torch._dynamo.reset()
    compiled = torch.compile(_row_layout.fn, dynamic=None, backend="aot_eager")
    graphs = {}
    for causal in (False, True):
        before = counters["stats"]["unique_graphs"]
        for n, padded in ((300, False), (517, True), (1000, False), (777, True)):
            q, k, v, padding = _inputs(n, n, padded, seed=n)
            call = prepare_call(q, k, v, variant="moba", block_size=64, top_k=3, causal=causal,
                                key_padding_mask=padding)  # fmt: skip
            args = _row_layout_args(call, 16)
            want, got = _row_layout.fn(*args), compiled(*args)
            flat = torch.utils._pytree.tree_leaves
            assert all(torch.equal(a, b) for a, b in zip(flat(want), flat(got), strict=True))
        graphs[causal] = counters["stats"]["unique_graphs"] - before
    assert 1 <= graphs[False] <= 2 and 1 <= graphs[True] <= 2, graphs
