"""The xformers backend: its plans allow exactly each pattern's pairs, once; its merging and its
backward are exact (on a CPU, against xFormers' kernels emulated in tests/xformers_emulation.py);
it is unavailable with its reason where it cannot run, and never chosen by auto then; on a GPU with
working operators, the real kernels equal the reference for every pattern it claims."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from helpers import check_against_reference, gpu, naive_attention, padding_mask, random_qkv
from xformers_emulation import EmulatedKernels, EmulatedXformers, flash_allowed, slice_allowed

import zoo
from zoo.backends import get_backend
from zoo.backends.xformers import (
    _PieceAttention,
    attention_bias,
    kernel_reason,
)
from zoo.backends.xformers.plan import Piece, plan_pieces
from zoo.functional import prepare_call, resolve_pattern

HAS_XFORMERS = importlib.util.find_spec("xformers") is not None

# (variant, params) with a plan; lengths are chosen so that no block size divides them.
PLANNED = [
    ("full", {}),
    ("causal", {}),
    ("local", {"window_size": 7}),
    ("local", {"window_size": (9, 2)}),
    ("sliding_window", {"window_size": 5}),
    ("block_local", {"block_size": 16, "neighbors": 0}),
    ("block_local", {"block_size": 16, "neighbors": 2}),
    ("longformer", {"window_size": 7, "global_tokens": 1}),
    ("longformer", {"window_size": 4, "global_tokens": 12}),
    ("global", {"global_tokens": 2, "block_size": 8}),
]
LENGTHS = [(100, 100), (37, 100), (100, 37), (16, 16)]
NOT_PLANNED = [
    ("bigbird", {}, r"one layout for every head, not one per head \('bigbird'\)"),
    ("bigbird", {"random_per_head": False}, "union only of one local window and global tokens"),
    ("strided", {}, "union only of one local window and global tokens"),
    ("dilated", {}, "no plan for an intersection of several sparse patterns"),
    ("random", {}, "no plan for Random"),
    ("longformer", {"dilation": 2}, "union only of one local window"),
    ("global", {"global_tokens": [0, 3]}, "only as a prefix"),
]


def _lengths(variant):
    """block_local plans need as many queries as keys."""
    if variant == "block_local":
        return [(q, k) for q, k in LENGTHS if q == k]
    return LENGTHS


def gpu_lengths(variant):
    """The lengths of the GPU test (and of its emulated twin): longer than a few blocks, one not
    a multiple of the block size, fewer and more queries than keys where the plan takes them."""
    if variant == "block_local":
        return [(256, 256), (250, 250)]
    return [(256, 256), (200, 300), (300, 200)]


def piece_pairs(piece: Piece, q_len: int, kv_len: int, kept_only: bool = False) -> torch.Tensor:
    """(Lq, Lk) counts of the pairs one piece computes, read from its xFormers mask window by
    window; with ``kept_only``, only the pairs of each window's kept keys."""
    counts = torch.zeros(q_len, kv_len, dtype=torch.int64)
    rows, keys = piece.shape
    for i in range(piece.count):
        r0, k0 = piece.rows[0] + i * piece.step, piece.keys[0] + i * piece.step
        sub = slice_allowed(piece.mask, rows, keys).long()
        if kept_only:
            sub[:, piece.kept_keys :] = 0
        counts[r0 : r0 + rows, k0 : k0 + keys] += sub
    return counts


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("variant,params", PLANNED)
def test_plans_allow_each_pair_of_the_pattern_once(variant, params, causal):
    for q_len, kv_len in _lengths(variant):
        pattern = resolve_pattern(variant, causal, dict(params)).specialize(q_len, kv_len)
        pieces = plan_pieces(pattern, q_len, kv_len)
        assert not isinstance(pieces, str), pieces
        expected = zoo.dense_mask(variant, q_len, kv_len, causal=causal, **params)
        for p in pieces:  # no pair outside the pattern, kept or not (its probability could be > 1)
            assert not (piece_pairs(p, q_len, kv_len).bool() & ~expected).any(), p
        # The pieces of outputs (and dq), and those of key gradients on their kept keys.
        for kind in ("outputs", "key_grads"):
            held = [p for p in pieces if getattr(p, kind)]
            counts = sum(piece_pairs(p, q_len, kv_len, kind == "key_grads") for p in held)
            assert counts.max() <= 1, (variant, q_len, kv_len, kind, "a pair in two pieces")
            assert torch.equal(counts == 1, expected), (variant, causal, q_len, kv_len, pieces)


def test_a_window_with_global_tokens_is_three_pieces():
    pieces = plan_pieces(resolve_pattern("longformer", False, {"window_size": 4}), 64, 64)
    assert [(p.rows, p.keys, p.mask) for p in pieces] == [
        ((0, 1), (0, 64), None),  # the global query against every key
        ((1, 64), (1, 64), (4, 4)),  # the others: the window, past the global key
        ((1, 64), (0, 1), None),  # the others against the global key
    ]


def test_more_queries_than_keys_put_queries_before_every_key():
    """300 queries and 200 keys: queries 0-99 sit at positions -100 .. -1, before every key. Not
    global, they see the global key and (the last few) their window's keys; causal, none, so no
    piece holds them and they get zeros."""
    pattern = resolve_pattern("longformer", False, {"window_size": 7})
    pieces = plan_pieces(pattern.specialize(300, 200), 300, 200)
    assert [(p.rows, p.keys, p.mask) for p in pieces] == [
        ((100, 101), (0, 200), None),  # the global query (position 0) against every key
        ((94, 100), (1, 7), "causal"),  # positions -6 .. -1: the window reaches keys 1 .. 6
        ((0, 100), (0, 1), None),  # the queries before every key, against the global key
        ((101, 300), (1, 200), (7, 7)),
        ((101, 300), (0, 1), None),
    ]
    causal = resolve_pattern("longformer", True, {"window_size": 7}).specialize(300, 200)
    assert all(p.rows[0] >= 100 for p in plan_pieces(causal, 300, 200))


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("neighbors", [0, 1, 2])
def test_block_local_runs_each_query_and_key_in_one_call(neighbors, causal):
    """Each query's output and dq come from one kernel call, and each key's dk and dv: rounded
    once, as in one FlashAttention call. Merged by log-sum-exp, each was the sum of n + 1 (causal)
    or 2n + 1 calls rounded to bf16 first: one ulp off where a GPU run found it."""
    for length in (256, 250, 40, 10):
        pattern = resolve_pattern(
            "block_local", causal, {"block_size": 16, "neighbors": neighbors}
        ).specialize(length, length)
        pieces = plan_pieces(pattern, length, length)
        rows, keys = torch.zeros(length, dtype=torch.long), torch.zeros(length, dtype=torch.long)
        for p in pieces:
            for i in range(p.count):
                if p.outputs:
                    rows[p.rows[0] + i * p.step : p.rows[1] + i * p.step] += 1
                if p.key_grads:
                    first = p.keys[0] + i * p.step
                    keys[first : first + p.kept_keys] += 1
        assert torch.equal(rows, torch.ones(length, dtype=torch.long)), (length, pieces)
        assert torch.equal(keys, torch.ones(length, dtype=torch.long)), (length, pieces)
        assert len(pieces) <= (3 if causal else 2 * neighbors + 2) * (2 if neighbors else 1)


@pytest.mark.parametrize("variant,params,reason", NOT_PLANNED)
def test_patterns_without_a_plan_are_refused_with_the_reason(variant, params, reason):
    q, k, v = random_qkv(1, 2, 64, 64)
    with pytest.raises(ValueError, match=rf"backend 'xformers-emulated' cannot run.*{reason}"):
        zoo.attention(q, k, v, variant=variant, backend=EmulatedXformers(), **params)


def test_padding_and_dropout_of_merged_pieces_are_refused():
    q, k, v = random_qkv(2, 2, 64, 64)
    backend, padding = EmulatedXformers(), padding_mask(2, 64)
    with pytest.raises(ValueError, match="no key padding mask"):
        zoo.attention(q, k, v, variant="full", backend=backend, key_padding_mask=padding)
    with pytest.raises(ValueError, match="no dropout for patterns merged"):
        zoo.attention(q, k, v, variant="longformer", backend=backend, window_size=4, dropout_p=0.1)
    # One call, but over a batch of chunks through the partial kernel: no dropout either (it
    # was dropped without a word).
    with pytest.raises(ValueError, match="no dropout for patterns merged"):
        zoo.attention(q, k, v, variant="block_local", backend=backend, block_size=16, dropout_p=0.1)
    zoo.attention(q, k, v, variant="local", backend=backend, window_size=4, dropout_p=0.1)


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("variant,params", PLANNED)
def test_merged_pieces_equal_the_reference_forward_and_backward(variant, params, causal):
    for q_len, kv_len in _lengths(variant):
        check_against_reference(
            variant, EmulatedXformers(), q_len=q_len, kv_len=kv_len, causal=causal,
            params=params,
        )  # fmt: skip


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_block_local_windows_with_grouped_kv(causal):
    """Windows of rows and of keys (overlapping, copied) with grouped k and v, whose gradients
    come back to their own heads."""
    for length in (100, 96):
        check_against_reference(
            "block_local", EmulatedXformers(), q_len=length, kv_len=length, causal=causal,
            params={"block_size": 16, "neighbors": 2}, heads=4, kv_heads=2,
        )  # fmt: skip


def test_a_query_that_no_piece_lets_attend_gets_zeros_and_zero_gradients():
    """Rows 0-1 lie before every key of the causal piece; rows 10-11 are in no piece."""
    q, k, v = (t.transpose(1, 2) for t in random_qkv(1, 2, 12, 8))  # xFormers' layout
    pieces = [Piece((0, 10), (0, 8), mask="causal")]
    out = _PieceAttention.apply(q, k, v, pieces, 12, 0.25, EmulatedKernels())
    allowed = torch.zeros(12, 8, dtype=torch.bool)
    allowed[:10] = slice_allowed("causal", 10, 8)
    expected = naive_attention(*(t.transpose(1, 2) for t in (q, k, v)), allowed, scale=0.25)
    torch.testing.assert_close(out.transpose(1, 2), expected)
    assert torch.equal(out[:, [0, 1, 10, 11]], torch.zeros(1, 4, 2, 16))
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    expected_grads = torch.autograd.grad(expected.square().sum(), (q, k, v))
    for got, want in zip(grads, expected_grads, strict=True):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want)


def test_unavailable_backends_say_why_and_auto_passes_them_over():
    backend = get_backend("xformers")
    if backend.unavailable() is None:
        pytest.skip("xformers runs here; the unavailable path cannot be seen")
    q, k, v = random_qkv(1, 2, 64, 64)
    with pytest.raises(
        ValueError, match=r"backend 'xformers' cannot run this call: .*(xformers|CUDA)"
    ):
        zoo.attention(q, k, v, variant="local", backend="xformers", window_size=4)
    assert "xformers" not in zoo.list_backends(available_only=True)
    assert not zoo.explain(q, q, q, variant="full").startswith("auto -> xformers")


@pytest.mark.skipif(
    not HAS_XFORMERS, reason="xformers is not installed (pip install attention-zoo[xformers])"
)
@pytest.mark.parametrize("variant,params", PLANNED)
def test_xformers_bias_objects_are_the_emulated_masks(variant, params):
    """xFormers' bias objects materialise on a CPU: each piece's must be what the emulation (and
    so the plan) assumes."""
    for causal in (False, True):
        for q_len, kv_len in _lengths(variant):
            pattern = resolve_pattern(variant, causal, dict(params)).specialize(q_len, kv_len)
            for piece in plan_pieces(pattern, q_len, kv_len):
                rows, keys = piece.shape
                bias = attention_bias(piece.mask)
                got = (
                    torch.ones(rows, keys, dtype=torch.bool)
                    if bias is None
                    else bias.materialize((rows, keys)) == 0
                )
                assert torch.equal(got, slice_allowed(piece.mask, rows, keys)), piece


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("variant,params", PLANNED)
def test_xformers_matches_reference_on_gpu(variant, params, causal, dtype):
    reason = get_backend("xformers").unavailable()
    if reason is not None:
        pytest.skip(reason)
    for q_len, kv_len in gpu_lengths(variant):
        check_against_reference(
            variant, "xformers", q_len=q_len, kv_len=kv_len, causal=causal, params=params,
            dtype=dtype, device="cuda", head_dim=64, v_dim=64,
        )  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("variant,params", PLANNED)
def test_the_gpu_test_on_emulated_kernels(variant, params, causal, dtype):
    """The GPU test's calls on a CPU, on kernels that round as FlashAttention's do: what it
    found there (global tokens with more queries than keys refused; block_local's dv one bf16
    ulp off where each key's gradient summed three rounded calls) shows here first."""
    for q_len, kv_len in gpu_lengths(variant):
        check_against_reference(
            variant, EmulatedXformers(), q_len=q_len, kv_len=kv_len, causal=causal,
            params=params, dtype=dtype, head_dim=64, v_dim=64,
        )  # fmt: skip


@pytest.mark.parametrize(
    "variant,params", [PLANNED[6], PLANNED[7]], ids=["block_local", "longformer"]
)
def test_merging_bf16_partials_stays_within_the_tolerance(variant, params):
    """FlashAttention's partial outputs come rounded to bf16; their merge must not add error
    beyond the convention's."""
    for causal in (False, True):
        check_against_reference(
            variant, EmulatedXformers(), q_len=100, kv_len=100, causal=causal, params=params,
            dtype=torch.bfloat16,
        )  # fmt: skip


def test_a_window_flash_attention_would_clamp_is_refused():
    """More queries than keys + 1 and a right side past the keys: FlashAttention would bound it
    at the keys (flash_api.cpp), so the plan refuses rather than lose pairs."""
    pattern = resolve_pattern("local", False, {"window_size": (3, 250)})
    reason = plan_pieces(pattern, 300, 200)
    assert isinstance(reason, str) and "clamps" in reason
    mask = (3, 250 + 100)  # the window in the slice's coordinates (bottom-right aligned)
    assert not torch.equal(flash_allowed(mask, 300, 200), slice_allowed(mask, 300, 200))
    assert not isinstance(plan_pieces(pattern, 200, 300), str)  # fewer queries: no clamp


@pytest.mark.parametrize(
    "variant,dtype,head_dim,v_dim,refused",
    [
        ("longformer", torch.bfloat16, 64, 64, None),
        ("longformer", torch.float32, 64, 64, "take bf16 or fp16"),
        ("local", torch.float16, 64, 32, "one head size"),
        ("block_local", torch.bfloat16, 260, 260, "up to 256"),
        ("full", torch.float32, 64, 32, None),  # one whole call: the cutlass kernel takes it
        ("causal", torch.float32, 6, 6, "multiples of 4"),
    ],
)
def test_what_the_real_kernels_would_refuse_is_refused_first(
    variant, dtype, head_dim, v_dim, refused
):
    q, k, v = random_qkv(1, 2, 64, 64, head_dim=head_dim, v_dim=v_dim, dtype=dtype)
    params = {"local": {"window_size": 4}, "block_local": {"block_size": 16}}.get(variant, {})
    call = prepare_call(q, k, v, variant=variant, **params)
    reason = kernel_reason(call, plan_pieces(call.pattern, 64, 64))
    assert reason is None if refused is None else refused in reason
