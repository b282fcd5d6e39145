"""The flex backend: its BlockMask holds exactly the pattern's blocks, and the compiled kernel
matches the reference (forward on CPU, where compiled FlexAttention has no backward; forward and
backward on GPU)."""

from __future__ import annotations

import types

import pytest
import torch
from helpers import (
    FIXED_VARIANTS,
    SELF_CONTAINED_VARIANTS,
    check_against_reference,
    gpu,
    padding_mask,
    pairwise,
    random_qkv,
    small_params,
)

import zoo
from zoo.backends import FlexBackend
from zoo.backends.flex import flex_frame
from zoo.functional import prepare_call

VARIANTS = SELF_CONTAINED_VARIANTS


def block_truth(variant, causal, q_len, kv_len, key_padding, block, params, pattern):
    """(B, Qb, Kb) 'some pair allowed' and 'every pair allowed' per block, from the dense mask,
    in the token order flex runs ``pattern`` in (the natural one, or a grid's tiles)."""
    mask = zoo.dense_mask(variant, q_len, kv_len, causal=causal, **params)[None]
    mask = mask & ~key_padding[:, None, :] if key_padding is not None else mask
    frame = flex_frame(pattern, q_len, kv_len, block, torch.device("cpu"))
    valid = frame.q.valid[:, None] & frame.k.valid[None, :]
    mask = mask[:, frame.q.index][:, :, frame.k.index] & valid
    blocks = mask.view(mask.shape[0], frame.q.num_blocks, block, -1, block)
    some = blocks.any(4).any(2)
    whole = valid.view(1, blocks.shape[1], block, -1, block).all(4).all(2)
    return some, blocks.all(4).all(2) & whole


def full_blocks(block_mask):
    num, idx = block_mask.full_kv_num_blocks, block_mask.full_kv_indices
    dense = torch.zeros(*idx.shape[:-1], idx.shape[-1] + 1, dtype=torch.bool)
    used = torch.arange(idx.shape[-1]) < num[..., None]
    dense.scatter_(-1, torch.where(used, idx.long(), idx.shape[-1]), True)
    return dense[..., :-1][:, 0]


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("variant", FIXED_VARIANTS)
def test_block_mask_holds_the_pattern_blocks(variant, causal, padded):
    params = small_params(variant)
    for q_len, kv_len in [(96, 96), (100, 100), (70, 100), (100, 70)]:
        q, k, v = random_qkv(3, 1, q_len, kv_len)
        key_padding = padding_mask(3, kv_len) if padded else None
        call = prepare_call(
            q, k, v, variant=variant, causal=causal, key_padding_mask=key_padding, **params
        )
        block_mask = FlexBackend(block_size=16, compile=False).block_mask(call)
        some, every = block_truth(
            variant, causal, q_len, kv_len, key_padding, 16, params, call.pattern
        )
        computed = block_mask.to_dense()[:, 0].bool()
        assert not (some & ~computed).any(), "a block with allowed pairs is skipped"
        assert not (full_blocks(block_mask) & ~every).any(), "a block marked full is not"
        if not padded:  # single families and their unions in the natural order are exact here
            waste = (computed & ~some).sum() / computed.sum()
            # A 2-D pattern meets the call's causal mask only as an intersection of block states.
            grid_causal = causal and "grid" in zoo.get_spec(variant).parameters()
            assert waste <= 0.2 or variant in ("strided", "dilated") or grid_causal


# Compiling costs about 7 s per variant on a 2-core CPU: one variant of each kind of mask_mod
# (a band with globals, random blocks, a regrouped order, a 2-D grid, blocks chosen by content);
# the GPU tests above compile every variant, and test_flex_lengths sweeps lengths.
COMPILED_VARIANTS = ["longformer", "bigbird", "strided", "neighborhood_2d", "moba"]
# (variant, causal, padded, (q_len, kv_len), encoding, key/value heads of 4): grouped k and v in
# every case, multi-query (one head) in one; a score bias rides on two of them (alibi, t5: a
# score_mod beside the mask_mod).
COMPILED_CASES = [
    ("longformer", False, True, (70, 100), "alibi", 2),
    ("bigbird", False, True, (70, 100), None, 2),
    ("strided", False, True, (70, 100), None, 1),
    ("neighborhood_2d", False, True, (70, 100), None, 2),
    ("moba", False, True, (70, 100), None, 2),
    ("bigbird", True, False, (100, 100), "t5", 2),
]
assert {case[0] for case in COMPILED_CASES} == set(COMPILED_VARIANTS)


@pytest.mark.parametrize("variant,causal,padded,shape,pos,kv_heads", COMPILED_CASES)
def test_compiled_flex_forward_on_cpu(variant, causal, padded, shape, pos, kv_heads):
    """The compiled kernel, not just the eager path: mask_mods (and a bias's score_mod) must
    survive compilation (a reduction inside one once compiled silently wrong), with grouped
    heads. One compile costs seconds on CPU (5-10 s with a cold cache), so each variant runs
    once, padded and with fewer queries than keys."""
    q_len, kv_len = shape
    encoding = None
    if pos is not None:
        torch.manual_seed(0)
        encoding = zoo.build_encoding(pos, dim=64, num_heads=4, causal=causal)
        if pos == "t5":  # a table far from zero, so that a wrong bias shows
            torch.nn.init.normal_(encoding.weight, std=1.0)
    check_against_reference(
        variant, FlexBackend(block_size=16), q_len=q_len, kv_len=kv_len, causal=causal,
        padded=padded, grads=False, heads=4, kv_heads=kv_heads, pos=encoding,
    )  # fmt: skip


def test_flex_refuses_backward_on_cpu_and_names_who_can():
    q, k, v = random_qkv(1, 1, 32, 32)
    with pytest.raises(ValueError, match=r"no backward pass on cpu.*backends that can: blocked"):
        zoo.attention(q, k, v, variant="local", backend="flex", window_size=4)


@gpu
@pytest.mark.parametrize("backend", ["flex", "blocked", "sdpa"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_gpu_forward_backward_matches_reference(variant, causal, dtype, backend):
    for padded, (q_len, kv_len) in [(False, (256, 256)), (True, (200, 300))]:
        check_against_reference(
            variant, backend, q_len=q_len, kv_len=kv_len, causal=causal, padded=padded,
            dtype=dtype, device="cuda", head_dim=64,
        )  # fmt: skip


@gpu
def test_random_blocks_are_the_same_on_gpu_and_cpu():
    cpu = zoo.dense_mask("bigbird", 512, block_size=32)
    q, k, v = random_qkv(1, 1, 512, 512, device="cuda")
    _, weights = zoo.attention(q, k, v, variant="bigbird", block_size=32, return_weights=True)
    assert torch.equal((weights[0, 0] > 0).cpu(), cpu)


def test_kernel_options_reach_the_kernel(monkeypatch):
    """FlexBackend(kernel_options=...) hands them to FlexAttention as they are, a copy per call;
    a non-dict is refused with a sentence."""
    seen = []

    def kernel(compiled, least, q, k, v, **kwargs):
        seen.append(kwargs.get("kernel_options"))
        return torch.zeros(*q.shape[:-1], v.shape[-1])

    monkeypatch.setattr(zoo.backends.flex, "run_kernel", kernel)
    q = torch.randn(1, 2, 64, 16)
    options = {"USE_TMA": True, "fwd_BLOCK_M": 64}
    zoo.attention(
        q, q, q, variant="local", window_size=4, backend=FlexBackend(kernel_options=options)
    )
    zoo.attention(q, q, q, variant="local", window_size=4, backend=FlexBackend())
    assert seen == [options, None]
    with pytest.raises(TypeError, match="kernel_options must be a dict"):
        FlexBackend(kernel_options=["USE_TMA"])


@pytest.mark.parametrize("n", [1000, 1024])
@pytest.mark.parametrize(
    "variant,params",
    [("block_local", {"block_size": 128}), ("local", {"window_size": 100}),
     ("bigbird", {"block_size": 64}), ("moba", {"block_size": 64, "top_k": 2})],
)  # fmt: skip
def test_block_counts_are_those_of_the_dense_mask(variant, params, n, monkeypatch):
    """flex's full and partial blocks per sequence and head (what ``explain`` reports: in a
    partial block the mask_mod runs per element) against a count over the dense mask's blocks, a
    block holding padding slots (a length that is no multiple of 128) partial where it allows
    anything: exact for one family, at most two FULL blocks claimed PARTIAL for BigBird's union
    (8.5 of 10.5 at 1024; 64.0 of 64.25 at 8K); a pattern whose blocks align with flex's has no
    partial block. MoBA's as the union per query block (its rows gathered by chosen block:
    tests/backends/test_flex_chosen.py)."""
    monkeypatch.setattr(FlexBackend, "gathers", lambda self, call: False)
    block = 128
    q, k, v = random_qkv(2, 2, n, n)
    call = prepare_call(q, k, v, variant=variant, **params)
    backend = FlexBackend(block_size=block, compile=False)
    full, partial, blocks = backend.block_counts(call)
    dense = call.pattern.dense(n, n).expand(2, 2, n, n)  # a fixed pattern's broadcasts
    pad = -(-n // block) * block - n
    grid = torch.nn.functional.pad(dense, (0, pad, 0, pad)).unflatten(2, (-1, block))
    grid = grid.unflatten(4, (-1, block))  # (B, H, Qb, b, Kb, b), padding slots False
    some, every = grid.any(5).any(3), grid.all(5).all(3)
    assert blocks == (-(-n // block)) ** 2
    want_full = float(every.sum((2, 3)).double().mean())
    assert full + partial == float(some.sum((2, 3)).double().mean())  # EMPTY is exact
    if variant == "bigbird":  # a union's FULL may be claimed PARTIAL (safe): where its members
        assert want_full - 2 <= full <= want_full  # only together fill a block
    else:
        assert full == want_full
    assert (partial == 0) == (variant == "block_local" and n % block == 0)
    assert backend.scored_pairs(call) == round((full + partial) * block**2)


# Each compiled case compiles a flex kernel for the CPU (5-7 s): CI compiles each shape and each
# causal once; eager runs every case.
@pytest.mark.parametrize(
    ("shape", "causal", "compile"),
    pairwise(
        [(s, c, m) for s in ((300, 300), (200, 333)) for c in (False, True) for m in (False, True)],
        [*((s, c, False) for s in ((300, 300), (200, 333)) for c in (False, True)),
         ((300, 300), True, True), ((200, 333), False, True)],
    ),
)  # fmt: skip
def test_a_strided_pattern_of_one_part_runs_regrouped(compile, causal, shape):
    """Strided without its band (one part) runs with its tokens regrouped by position mod the
    stride, where its blocks are whole (none partial where they are full of tokens; in the
    natural order all 16384 blocks of 16K tokens were partial), and equals the reference,
    padded keys and lengths that fit no block included (forward: compiled flex on a CPU has
    no backward)."""
    q_len, kv_len = shape
    params = {"stride": 8, "window_size": 0}
    check_against_reference(
        "strided", FlexBackend(block_size=16, compile=compile), q_len=q_len, kv_len=kv_len,
        causal=causal, padded=True, params=params, grads=False,
    )  # fmt: skip
    q = torch.randn(1, 1, 16384, 16)
    call = prepare_call(q, q, q, variant="strided", stride=64, window_size=0)
    assert FlexBackend(compile=False).block_counts(call) == (256.0, 0.0, 16384)


@pytest.mark.parametrize(
    ("pos", "causal", "compile"),
    pairwise(
        [(p, c, m) for p in (None, "alibi") for c in (False, True) for m in (False, True)],
        [*((p, c, False) for p in (None, "alibi") for c in (False, True)),
         ("alibi", True, True), (None, False, True)],
    ),
)  # fmt: skip
def test_parts_in_their_own_orders_merge_to_the_reference(compile, causal, pos):
    """``strided`` with its band (two parts: the band natural, the strided keys regrouped by
    position mod the stride) runs each part in its own order and merges them by log-sum-exp:
    equal to the reference forward, with padding, a positional bias, grouped heads and lengths
    that fit no block; at 16K it computes 638 blocks of 128 where one natural-order call had
    all 16384 partial."""
    params = {"stride": 8, "window_size": 7}
    backend = FlexBackend(block_size=16, compile=compile)
    q = torch.randn(1, 1, 300, 16)
    split = backend.own_orders(prepare_call(q, q, q, variant="strided", **params))
    assert (split is not None) == (not compile)  # compiled on a CPU: no log-sum-exp, one call
    encoding = None
    if pos is not None:
        torch.manual_seed(0)
        encoding = zoo.build_encoding(pos, dim=64, num_heads=4, causal=causal)
    check_against_reference(
        "strided", backend, q_len=300, kv_len=333, causal=causal, padded=True, params=params,
        pos=encoding, grads=False, heads=4, kv_heads=2,
    )  # fmt: skip
    q = torch.randn(1, 1, 16384, 16)
    eager = FlexBackend(compile=False)
    full, partial, blocks = eager.block_counts(prepare_call(q, q, q, variant="strided"))
    assert (full + partial, blocks) == (638.0, 16384)


def _dense_flex(
    q, k, v, *, score_mod=None, block_mask=None, scale=None, enable_gqa=False, return_aux=None, **_
):
    """FlexAttention's semantics, dense and differentiable on a CPU (where flex has no
    backward): the block mask's computed blocks, its mask_mod inside them, the score_mod."""
    B, H, M, _ = q.shape
    if enable_gqa:
        k, v = (x.repeat_interleave(H // x.shape[1], dim=1) for x in (k, v))
    b, h = torch.arange(B)[:, None, None, None], torch.arange(H)[None, :, None, None]
    i, j = torch.arange(M)[:, None], torch.arange(k.shape[2])[None, :]
    scores = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if score_mod is not None:
        scores = score_mod(scores, b, h, i, j)
    size = block_mask.BLOCK_SIZE[0]
    blocks = block_mask.to_dense().bool()  # (B, 1 or H, Qb, Kb): blocks computed
    blocks = blocks.repeat_interleave(size, 2).repeat_interleave(size, 3)[..., :M, : k.shape[2]]
    allowed = blocks & block_mask.mask_mod(b, h, i, j)
    scores = scores.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    weights = torch.exp(scores - torch.where(torch.isfinite(lse), lse, 0)[..., None])
    out = weights @ v
    return (out, types.SimpleNamespace(lse=lse)) if return_aux is not None else out


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_parts_in_their_own_orders_differentiate_through_the_merge(causal, monkeypatch):
    """The merge's backward, through each part's output and log-sum-exp, equals the reference's
    gradients, with padding and grouped heads; a dense kernel of FlexAttention's semantics
    stands in for it (flex has no backward on a CPU)."""
    from zoo.backends import flex_kernel

    monkeypatch.setattr(flex_kernel, "_kernel", lambda *args: _dense_flex)
    params = {"stride": 8, "window_size": 7}
    torch.manual_seed(0)
    q = torch.randn(2, 4, 300, 16, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 2, 300, 16, dtype=torch.float64, requires_grad=True)
            for _ in range(2))  # fmt: skip
    padding = torch.zeros(2, 300, dtype=torch.bool)
    padding[1, 250:] = True
    call = prepare_call(q, k, v, variant="strided", causal=causal, key_padding_mask=padding,
                        **params)  # fmt: skip
    backend = FlexBackend(block_size=16, compile=False)
    assert backend.own_orders(call) is not None
    out = backend.forward(call)[0]
    want = zoo.attention(q, k, v, variant="strided", causal=causal, key_padding_mask=padding,
                         backend="reference", **params)  # fmt: skip
    assert (out - want).abs().max() < 1e-10
    g = torch.randn_like(out)
    for got, ref in zip(torch.autograd.grad(out, (q, k, v), g),
                        torch.autograd.grad(want, (q, k, v), g), strict=True):  # fmt: skip
        assert (got - ref).abs().max() < 1e-10
