"""MoBA (``moba``): the chosen blocks against the definition computed query by query, and every
backend that runs layouts chosen by content against the reference, forward and backward."""

from __future__ import annotations

import itertools

import pytest
import torch
from helpers import check_against_reference, padding_mask, pairwise, random_qkv
from torch import Tensor

import zoo
from zoo.backends import BlockedBackend, FlexBackend
from zoo.backends.base import FLOATS, Capabilities
from zoo.backends.blocked.chosen_union import routed_pairs
from zoo.functional import prepare_call
from zoo.patterns import Causal, Local, Moba, RouteInputs, Spans
from zoo.patterns.base import EMPTY, FULL
from zoo.patterns.moba import moba_choice
from zoo.patterns.routed import picks_mask


def definition(q, k, block_size, top_k, causal, key_padding=None):
    """MoBA's choice (B, H, Lq, blocks), one query at a time in plain Python from the issue's
    definition: q . mean of the unpadded keys of each block in float32, own block first, no block
    after the own one when causal, ties to the lower index, all-padding blocks never."""
    B, H, q_len, _ = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    blocks = -(-kv_len // block_size)
    chosen = torch.zeros(B, H, q_len, blocks, dtype=torch.bool)
    for b in range(B):
        for h in range(H):
            keys = k[b, h * kv_heads // H].float()
            for i in range(q_len):
                position = i + kv_len - q_len
                own = position // block_size
                ranked = []
                for j in range(blocks):
                    keep = [
                        t
                        for t in range(j * block_size, min((j + 1) * block_size, kv_len))
                        if key_padding is None or not key_padding[b, t]
                    ]
                    if not keep or (causal and j > own):
                        continue
                    mean = keys[keep].sum(0) / len(keep)
                    score = float("inf") if j == own else float(q[b, h, i].float() @ mean)
                    ranked.append((-score, j))
                for _, j in sorted(ranked)[:top_k]:
                    chosen[b, h, i, j] = True
    return chosen


CASES = [  # (q_len, kv_len, block_size, top_k)
    (37, 37, 8, 3),
    (20, 37, 8, 2),
    (37, 20, 6, 2),
    (16, 16, 8, 5),  # fewer blocks than top_k: all chosen
]


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("q_len,kv_len,block_size,top_k", CASES)
def test_choice_matches_the_definition(q_len, kv_len, block_size, top_k, causal):
    q, k, _ = random_qkv(3, 4, q_len, kv_len, kv_heads=2)
    key_padding = padding_mask(3, kv_len)
    expected = definition(q.detach(), k.detach(), block_size, top_k, causal, key_padding)
    got = moba_choice(
        q, k, block_size=block_size, top_k=top_k, causal=causal, key_padding_mask=key_padding
    )
    # n * top_k indices, never a (queries, blocks) mask; each block at most once per query
    assert got.shape == (3, 4, q_len, min(top_k, expected.shape[-1])) and got.dtype == torch.int32
    blocks = expected.shape[-1]
    assert torch.equal(picks_mask(got, blocks), expected)
    assert torch.equal(picks_mask(got, blocks).sum(-1), (got < blocks).sum(-1))
    assert not got.requires_grad  # the choice gets no gradient
    # The attention call chooses the same blocks: its dense view is the chosen blocks' keys,
    # within causal limits.
    call = prepare_call(
        q, k, k, variant="moba", causal=causal, key_padding_mask=key_padding,
        block_size=block_size, top_k=top_k,
    )  # fmt: skip
    dense = expected.repeat_interleave(block_size, dim=-1)[..., :kv_len]
    if causal:
        dense = dense & zoo.dense_mask("causal", q_len, kv_len)
    assert torch.equal(call.pattern.dense(q_len, kv_len), dense)


def test_ties_go_to_the_lower_block_and_padding_never_wins():
    block = 4
    k = torch.zeros(1, 1, 16, 2)
    k[..., 4:8, 0] = 1.0  # blocks 1 and 2 tie; block 3 scores highest but is all padding
    k[..., 8:12, 0] = 1.0
    k[..., 12:16, 0] = 5.0
    q = torch.zeros(1, 1, 16, 2)
    q[..., 0] = 1.0
    key_padding = torch.zeros(1, 16, dtype=torch.bool)
    key_padding[0, 12:] = True
    chosen = moba_choice(
        q, k, block_size=block, top_k=2, causal=False, key_padding_mask=key_padding
    )
    chosen = picks_mask(chosen, 4)
    assert chosen[0, 0, 0].tolist() == [True, True, False, False]  # own block 0, then block 1
    assert not chosen[..., 3].any()  # padding never chosen, not even by its own queries
    assert chosen[0, 0, 12].tolist() == [False, True, True, False]


def test_bound_block_state_holds_the_dense_view():
    """The routed layout's EMPTY/FULL claims are true of its dense view, per sequence and head."""
    q, k, _ = random_qkv(2, 2, 30, 30)
    pattern = (Moba(block_size=6, top_k=2) & Causal()).bind(RouteInputs(q, k))
    block = 4
    pos = torch.arange(32).view(-1, block)
    valid = pos < 30
    spans = Spans(pos[:, 0], torch.where(valid, pos, -1).amax(1), 1, valid.all(1))
    state = pattern.block_state(spans.column(), spans.row())  # (B, H, 8, 8)
    dense = torch.nn.functional.pad(pattern.dense(30, 30), (0, 2, 0, 2))
    blocks = dense.unflatten(2, (-1, block)).unflatten(4, (-1, block))  # (B,H,8,4,8,4)
    some, every = blocks.any(5).any(3), blocks.all(5).all(3)
    assert not (some & (state == EMPTY)).any()
    assert not ((state == FULL) & ~every).any()
    assert (state == FULL).any() and (state == EMPTY).any()


BACKENDS = ["blocked", "sdpa"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
@pytest.mark.parametrize("shape", [(37, 37), (21, 37), (37, 21)])
def test_backends_match_the_reference(backend, causal, padded, shape):
    q_len, kv_len = shape
    check_against_reference(
        "moba", backend, q_len=q_len, kv_len=kv_len, causal=causal, padded=padded,
        params={"block_size": 6, "top_k": 3}, heads=4, kv_heads=2,
    )  # fmt: skip


BY_KEY = [  # (q_len, kv_len, block_size, top_k, v_dim) on kernel blocks of 4 keys
    (70, 70, 32, 2, 16),  # whole chosen blocks: runs of 32 keys without a mask
    (45, 70, 8, 3, 8),  # runs of one chosen block (8 keys), never across two
    (45, 70, 6, 3, 8),  # blocks of 6 on kernel blocks of 4: runs PARTIAL across their edges
    (70, 37, 16, 9, 24),  # top_k above the blocks there are: every block
]


def _no_union(*args, **kwargs):
    raise AssertionError("the union per query block ran, not the runs by key block")


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("q_len,kv_len,block_size,top_k,v_dim", BY_KEY)
def test_blocked_by_key_block_matches_the_reference(
    q_len, kv_len, block_size, top_k, v_dim, causal, monkeypatch
):
    """``blocked`` runs the chosen pairs key block by key block (``by_key``): runs of
    several kernel blocks, per-row masks inside them, GQA, key padding, ragged lengths, and
    value heads narrower or wider than q's."""
    monkeypatch.setattr(zoo.backends.blocked, "routed_attention", _no_union)
    check_against_reference(
        "moba", BlockedBackend(block_size=4), q_len=q_len, kv_len=kv_len, causal=causal,
        padded=True, params={"block_size": block_size, "top_k": top_k}, heads=4, kv_heads=2,
        v_dim=v_dim,
    )  # fmt: skip


@pytest.mark.parametrize("block_size,factor", [(256, 4), (512, 8), (2048, 8), (96, 1), (100, 1)])
def test_blocked_runs_never_cut_a_chosen_block(block_size, factor):
    """A run's key block holds whole chosen blocks: runs of 512 keys against MoBA's blocks of
    256 were PARTIAL for almost every query, each key then asked (922 ms against 89 ms at 8K
    forward, measured); kernel blocks of 64, coarsened at most 8 times."""
    from zoo.backends.blocked.by_key import _run_frame

    q = torch.randn(1, 2, 4096, 16)
    call = prepare_call(q, q, q, variant="moba", block_size=block_size, top_k=2)
    assert _run_frame(call.pattern.parts()[0], call, 64, None)[0] == factor


def test_blocked_by_key_block_leaves_keyless_runs_out():
    """A run whose allowed keys are all padding for a query adds nothing to it (the kernel
    says 0 there, not "no mass"); a query with no key at all gets zeros; no NaN."""
    q, k, v = random_qkv(2, 2, 30, 30, dtype=torch.float64)
    key_padding = torch.zeros(2, 30, dtype=torch.bool)
    key_padding[0, :12] = True  # queries 0..11: no key at all
    key_padding[1, 16:28] = True  # queries 16..27: nothing in their own block, block 0 chosen
    params = {"block_size": 16, "top_k": 2, "causal": True, "key_padding_mask": key_padding}
    outs = [
        zoo.attention(q, k, v, variant="moba", backend=backend, **params)
        for backend in (BlockedBackend(block_size=4), "reference")  # runs of 16 keys
    ]
    assert (outs[0][0, :, :12] == 0).all()
    assert (outs[0] - outs[1]).abs().max() < 1e-12
    grads = [torch.autograd.grad(out.sum(), (q, k, v)) for out in outs]
    for got, want in zip(*grads, strict=True):
        assert (got - want).abs().max() < 1e-12


def test_blocked_scores_follow_the_chosen_pairs():
    """The scores ``blocked`` computes are the chosen pairs plus at most a run's width per
    query (its own block under causal rules), well under the union per query block."""
    q, k, v = random_qkv(1, 2, 256, 256)
    call = prepare_call(q, k, v, variant="moba", causal=True, block_size=32, top_k=2)
    backend = BlockedBackend(block_size=8)  # runs of 64 keys
    allowed = int(call.pattern.dense(256, 256).sum()) / 2  # per head
    scored = backend.scored_pairs(call)
    assert allowed <= scored <= allowed + 256 * 63
    part = call.pattern.parts()[0]
    union = routed_pairs(part, backend._frame(call, part), 1, 2, backend.waste)
    assert scored < 0.8 * union


@pytest.mark.parametrize("backend", ["blocked", "sdpa"])
def test_union_with_a_sliding_window(backend):
    """``moba | local`` composes as any union: the window's keys or the chosen blocks."""
    pattern = Moba(block_size=8, top_k=2) | Local((5, 0))
    q, k, v = random_qkv(2, 2, 40, 40)
    call = prepare_call(q, k, v, variant=pattern, causal=True)
    chosen = picks_mask(moba_choice(q, k, block_size=8, top_k=2, causal=True), 5)
    window = zoo.dense_mask("sliding_window", 40, window_size=5)
    expected = (chosen.repeat_interleave(8, dim=-1) | window) & zoo.dense_mask("causal", 40)
    assert torch.equal(call.pattern.dense(40, 40), expected)
    ref = zoo.attention(q, k, v, variant=pattern, causal=True, backend="reference")
    out = zoo.attention(q, k, v, variant=pattern, causal=True, backend=backend)
    assert (out - ref).abs().max() < 1e-5
    blocked_grad = torch.autograd.grad(out.sum(), (q, k, v))
    ref_grad = torch.autograd.grad(ref.sum(), (q, k, v))
    for got, want in zip(blocked_grad, ref_grad, strict=True):
        assert (got - want).abs().max() < 1e-5


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_flex_forward_matches_the_reference(compile, causal):
    """Per sequence and head block masks (from_kv_blocks) with the per-query choice in the
    mask_mod; forward only on CPU, where compiled FlexAttention has no backward."""
    check_against_reference(
        "moba", FlexBackend(block_size=16, compile=compile), q_len=37, kv_len=50, causal=causal,
        padded=True, params={"block_size": 8, "top_k": 2}, heads=4, kv_heads=2, grads=False,
    )  # fmt: skip


def test_flex_block_mask_is_per_sequence_and_head(monkeypatch):
    """The union of each query block's choices (the rows gathered by chosen block have a mask
    of their own: tests/backends/test_flex_chosen.py)."""
    monkeypatch.setattr(FlexBackend, "gathers", lambda self, call: False)
    q, k, v = random_qkv(2, 4, 64, 64, kv_heads=2)
    call = prepare_call(q, k, v, variant="moba", block_size=16, top_k=2)
    mask = FlexBackend(block_size=16, compile=False).block_mask(call)
    assert mask.kv_num_blocks.shape == (2, 4, 4)
    dense = mask.to_dense().bool()  # (B, H, Qb, Kb)
    chosen_blocks = call.pattern.mask().unflatten(2, (4, 16)).any(3)
    assert torch.equal(dense, chosen_blocks)


def test_auto_runs_moba_and_xformers_refuses_it():
    q, k, v = random_qkv(1, 2, 40, 40)
    call = prepare_call(q, k, v, variant="moba", block_size=8, top_k=2)
    assert not zoo.backends.get_backend("xformers").capabilities.routed
    fixed_only = Capabilities(devices=("cpu",), backward=("cpu",), dtypes=FLOATS, patterns="any")
    assert "cannot run blocks chosen by content" in fixed_only.reason_against(call)
    out = zoo.attention(q, k, v, variant="moba", block_size=8, top_k=2)
    ref = zoo.attention(q, k, v, variant="moba", block_size=8, top_k=2, backend="reference")
    assert (out - ref).abs().max() < 1e-5


@pytest.mark.parametrize(
    "params,match",
    [
        ({"top_k": 0}, "top_k must be positive, got 0"),
        ({"block_size": 0}, "block_size must be positive, got 0"),
        ({"top_k": 2.5}, r"top_k must be an int, got 2.5"),
        ({"block_size": "64"}, r"block_size must be an int, got '64'"),
    ],
)
def test_bad_parameters_name_the_value(params, match):
    q, k, v = random_qkv(1, 1, 16, 16)
    with pytest.raises((TypeError, ValueError), match=match):
        zoo.attention(q, k, v, variant="moba", **params)


def test_unbound_moba_has_no_fixed_mask():
    with pytest.raises(TypeError, match="chooses its blocks by content"):
        zoo.dense_mask("moba", 16)


def test_union_with_a_strided_pattern_runs_in_two_token_orders():
    """``moba | strided`` splits into parts in two token orders; the strided part excludes the
    chosen blocks (a difference with a routed member), and the parts merge exactly."""
    pattern = Moba(block_size=8, top_k=2) | zoo.patterns.strided(stride=9, window_size=0)
    q, k, v = random_qkv(2, 2, 70, 70, dtype=torch.float64)
    for causal in (False, True):
        ref = zoo.attention(q, k, v, variant=pattern, causal=causal, backend="reference")
        out = zoo.attention(q, k, v, variant=pattern, causal=causal, backend="blocked")
        assert (out - ref).abs().max() < 1e-12
        got = torch.autograd.grad(out.sum(), (q, k, v))
        want = torch.autograd.grad(ref.sum(), (q, k, v))
        for a, b in zip(got, want, strict=True):
            assert (a - b).abs().max() < 1e-12


@pytest.mark.parametrize("causal", [False, True])
def test_the_choice_made_in_chunks_of_queries_is_the_choice(causal, monkeypatch):
    """moba_choice scores queries in chunks (bounded memory at long lengths): chunks of a few
    queries, not multiples of the block, give the one-chunk choice, padded and against a cache."""
    from zoo.patterns import moba

    torch.manual_seed(0)
    q, k = torch.randn(2, 4, 300, 16), torch.randn(2, 2, 310, 16)
    padding = torch.zeros(2, 310, dtype=torch.bool)
    padding[1, 250:] = True
    positions = torch.arange(300)[None] + torch.tensor([[0], [5]])
    for kwargs in ({"key_padding_mask": padding}, {"q_pos": positions}):
        whole = moba.moba_choice(q, k, block_size=16, top_k=3, causal=causal, **kwargs)
        monkeypatch.setattr(moba, "CHOICE_ELEMENTS", 2 * 4 * 20 * 7)  # 7 queries a chunk
        chunked = moba.moba_choice(q, k, block_size=16, top_k=3, causal=causal, **kwargs)
        monkeypatch.undo()
        assert torch.equal(chunked, whole)


# Each case compiles 3-6 graphs (8-16 s on a CPU): CI runs each of causal and cached once.
@pytest.mark.parametrize(
    ("causal", "cached"),
    pairwise([(c, k) for c in (False, True) for k in (False, True)],
             [(True, False), (False, True)]),
)  # fmt: skip
@pytest.mark.usefixtures("scalar_cpu_code")
def test_the_choice_compiled_as_on_a_gpu_is_the_choice(causal, cached, monkeypatch):
    """What a GPU runs (``zoo.core.fused``: the block sums and the choice compiled), forced on a
    CPU: the eager choice at four lengths no block divides, whole and in chunks; each function
    compiles at most twice (a static graph, then one of symbolic lengths), and the chunks at most
    twice more (torch 2.13: the sums 2, the choice 2, its chunks 1 or 2 more)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from zoo.core import fused
    from zoo.decoding.block_sums import _sums
    from zoo.patterns import moba

    def graphs(function: fused.Fused) -> int:
        return len(_debug_get_cache_entry_list(function.fn.__code__))

    torch._dynamo.reset()
    for function in (moba._choose, _sums):
        function.__dict__.pop("compiled", None)
        monkeypatch.setattr(function, "failures", {})

    def choices(n: int, chunked: bool) -> tuple[Tensor, Tensor]:
        torch.manual_seed(n)
        q, k = torch.randn(2, 4, n, 16), torch.randn(2, 2, n + 10, 16)
        padding = torch.zeros(2, n + 10, dtype=torch.bool)
        padding[1, n // 2 :] = True
        positions = torch.arange(n)[None] + torch.tensor([[0], [5]])
        kwargs = {"q_pos": positions} if cached else {"key_padding_mask": padding}
        out = []
        for compiled in (False, True):
            with monkeypatch.context() as m:
                if chunked:
                    m.setattr(moba, "CHOICE_ELEMENTS", 2 * 4 * 40 * 64)  # 40-128 queries a chunk
                if compiled:
                    m.setattr(fused, "fuses", lambda t: not torch.compiler.is_compiling())
                out.append(moba.moba_choice(q, k, block_size=16, top_k=3, causal=causal, **kwargs))
        return out

    for n in (300, 517, 1000, 777):
        eager, compiled = choices(n, chunked=False)
        assert torch.equal(compiled, eager), n
    assert 1 <= graphs(moba._choose) <= 2 and 1 <= graphs(_sums) <= 2
    whole = graphs(moba._choose)
    graph, calls = moba._choose.compiled, []  # each chunk runs the compiled function
    monkeypatch.setitem(moba._choose.__dict__, "compiled", lambda *a: calls.append(1) or graph(*a))
    for n in (300, 517, 1000, 777):
        eager, compiled = choices(n, chunked=True)
        assert torch.equal(compiled, eager), n
    assert len(calls) > 4  # several chunks a call
    assert graphs(moba._choose) - whole <= 2  # chunks: not a graph per length or chunk
    assert moba._choose.failed is None and _sums.failed is None


@pytest.mark.parametrize("spans", ["few", "one_query_each"])
def test_block_state_counts_exactly_and_within_its_memory(monkeypatch, spans):
    """block_state's counts of chosen pairs in each (query span, key span) rectangle equal a
    direct count, for spans in any order, overlapping and repeated. Memory: with few spans (kernel
    blocks of queries) no tensor it makes is as large as the choice itself (B, H, Lq, blocks),
    the choice counted a slice of queries at a time at the spans' rows only; with one query per
    span (the runs by key block) one int32 table of every query's prefix, and nothing larger
    (segments at 2 x Lq rows, and copies of them, made four times that)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import zoo.patterns.routed as routed
    from zoo.patterns import FULL, PARTIAL

    q, k, _ = random_qkv(2, 2, 300, 300)
    pattern = Moba(block_size=6, top_k=3).bind(RouteInputs(q, k))
    chosen = pattern.mask()  # (2, 2, 300, 50), made outside the watch
    monkeypatch.setattr(routed, "COUNT_CHUNK", 2 * 2 * 50 * 16)  # 16 queries at a time
    gen = torch.Generator().manual_seed(0)
    if spans == "few":
        lo = torch.randint(0, 300, (24,), generator=gen)
        hi = (lo + torch.randint(0, 40, (24,), generator=gen)).clamp(max=299)
        most = chosen.numel()  # bytes: not even one per choice entry
    else:
        lo = hi = torch.arange(300)
        most = 2 * 2 * 301 * 51 * 4  # the int32 table
    k_lo = torch.randint(0, 300, (20,), generator=gen)
    k_hi = (k_lo + torch.randint(0, 30, (20,), generator=gen)).clamp(max=299)
    one = 1 if spans == "one_query_each" else None  # known on the host, as frames know it
    qs = Spans(lo, hi, 1, torch.ones(lo.numel(), dtype=torch.bool), aligned=one)
    ks = Spans(k_lo, k_hi, 1, torch.ones(20, dtype=torch.bool))
    sizes, base = [], pattern.picks.untyped_storage().data_ptr()

    class Outputs(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, tuple | list) else (out,):
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() != base:
                    sizes.append(t.untyped_storage().nbytes())  # a view of the choice is none
            return out

    with Outputs():
        state = pattern.block_state(qs.column(), ks.row())
    assert max(sizes) <= most, (max(sizes), most)
    for i, j in itertools.product(range(0, lo.numel(), 1 if spans == "few" else 7), range(20)):
        rows = slice(int(lo[i]), int(hi[i]) + 1)
        cols = slice(int(k_lo[j]) // 6, int(k_hi[j]) // 6 + 1)
        count = chosen[:, :, rows, cols].sum(dim=(2, 3))
        area = (rows.stop - rows.start) * (cols.stop - cols.start)
        want = torch.where(count == area, FULL, torch.where(count > 0, PARTIAL, 0))
        assert torch.equal(state[:, :, i, j], want.to(state.dtype)), (i, j)


@pytest.mark.parametrize("q_len,kv_len", [(300, 300), (200, 333), (45, 70)])
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_block_state_of_one_query_spans_reads_the_choice(q_len, kv_len, causal, monkeypatch):
    """Spans of one query each against key spans aligned inside the chosen blocks (the runs by
    key block's frame: ``Spans.aligned`` known on the host) are answered from the choice itself;
    the same states as the counting path, with padding slots and bottom-right offsets."""
    from dataclasses import replace

    from zoo.layout.frames import build_frame
    from zoo.patterns.routed import ChosenBlocks

    q, k, _ = random_qkv(2, 2, q_len, kv_len)
    pattern = Moba(block_size=8, top_k=3)
    pattern = (pattern & Causal() if causal else pattern).bind(RouteInputs(q, k))
    for key_block in (8, 4, 16):  # 16 does not divide 8: the counting path, same answer
        frame = build_frame(1, q_len, kv_len, 1, key_block, torch.device("cpu"))
        qs, ks = frame.q.spans(), frame.k.spans()
        assert qs.aligned == 1 and ks.aligned == key_block
        with monkeypatch.context() as m:
            if 8 % key_block == 0:  # no counting at all
                m.setattr(ChosenBlocks, "_row_counts", None)
            fast = pattern.block_state(qs.column(), ks.row())
        counted = pattern.block_state(
            replace(qs, aligned=None).column(), replace(ks, aligned=None).row()
        )
        assert torch.equal(fast, counted), key_block
        assert (fast == FULL).any() and (fast == EMPTY).any()
