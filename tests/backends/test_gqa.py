"""Grouped-query and multi-query attention: k and v with H_kv heads, each shared by H / H_kv query
heads. Every backend against the reference, which repeats k and v (the definition), forward and
gradients of q, k and v, for every registry variant, causal or not, padded or not; with the
encodings that act inside attention; in the module; and the claim that the sparse and SDPA paths
keep k and v at H_kv heads rather than copying them to H. Compiled flex on CPU runs grouped heads
in every case of tests/backends/test_flex.py."""

from __future__ import annotations

import pytest
import torch
from helpers import SELF_CONTAINED_VARIANTS, check_against_reference, random_qkv, small_params
from test_xformers import PLANNED, EmulatedXformers

import zoo
from zoo.backends import BlockedBackend, FlexBackend

VARIANTS = SELF_CONTAINED_VARIANTS
BACKENDS = {
    "blocked-16": BlockedBackend(block_size=16),
    "sdpa": "sdpa",
    "flex-eager": FlexBackend(block_size=16, compile=False),
}
KV_HEADS = {"gqa": 2, "mqa": 1}  # of 4 query heads


# Flex hands grouped heads to its kernel (enable_gqa) whatever the mask, so eager flex meets every
# variant in test_backends.py and grouped heads with the encodings below and, compiled, in every
# case of test_flex.py (BigBird's per-head masks among them); blocked and SDPA group per variant.
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize(("kv_heads", "padded"), [("gqa", True), ("mqa", False)])
@pytest.mark.parametrize("backend", ["blocked-16", "sdpa"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_grouped_kv_matches_the_repeated_reference(variant, backend, kv_heads, padded, causal):
    """Self-attention at a length no block divides (padded), and cross-attention with fewer
    queries (unpadded); grouped-query attention (2 k/v heads of 4) meets the first, multi-query
    (1 of 4) the second: every variant, causality and backend here (blocked, sdpa; flex: see
    above) meets both groupings and both shapes, at a quarter of the cost of every combination
    (the suite's 10-minute budget)."""
    q_len, kv_len = (100, 100) if padded else (70, 100)
    check_against_reference(
        variant, BACKENDS[backend], q_len=q_len, kv_len=kv_len, causal=causal,
        padded=padded, heads=4, kv_heads=KV_HEADS[kv_heads],
    )  # fmt: skip


@pytest.mark.parametrize("name", ["rope", "alibi", "t5"])
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_encodings_with_grouped_kv(name, backend):
    """Rotary turns q and k at their own head counts; ALiBi and T5 keep one slope or table per
    query head (built for the 4 query heads)."""
    pos = zoo.build_encoding(name, dim=64, num_heads=4, causal=True)
    check_against_reference(
        "longformer", BACKENDS[backend], q_len=100, kv_len=100, causal=True, padded=True,
        heads=4, kv_heads=2, pos=pos, grads=backend != "flex-eager",
    )  # fmt: skip


@pytest.mark.parametrize("variant,params", PLANNED[:4])
def test_xformers_pieces_with_grouped_kv(variant, params):
    """The xformers backend's plans and merging with grouped k and v, on the emulated kernels
    (tests/xformers_emulation.py), which take them as the backend passes them."""
    check_against_reference(
        variant, EmulatedXformers(), q_len=96, kv_len=96, causal=True, params=params, heads=4,
        kv_heads=2,
    )  # fmt: skip


def test_additive_score_with_grouped_kv():
    """Additive scores map keys per query head, so the blocked backend expands k for them; the
    result is still the reference's."""
    q, k, v = random_qkv(2, 4, 90, 90, kv_heads=2)
    score = zoo.AdditiveScore(num_heads=4, head_dim=16, hidden=8)
    params = small_params("strided")
    grad_out = torch.randn(2, 4, 90, 16, generator=torch.Generator().manual_seed(2))
    results = []
    for backend in ("reference", BlockedBackend(block_size=16)):
        out = zoo.attention(
            q, k, v, variant="strided", backend=backend, causal=True, score=score, **params
        )
        results.append([out, *torch.autograd.grad(out, [q, k, v, *score.parameters()], grad_out)])
    for got, want in zip(*reversed(results), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_a_head_count_that_does_not_divide_names_both():
    q, k, v = random_qkv(1, 6, 8, 8, kv_heads=4)
    with pytest.raises(ValueError, match="q has 6 heads, k and v have 4"):
        zoo.attention(q, k, v, variant="full")
    with pytest.raises(ValueError, match=r"num_kv_heads \(4\) must divide num_heads \(6\)"):
        zoo.MultiHeadAttention(48, 6, num_kv_heads=4)
    q, k, v = random_qkv(1, 4, 8, 8, kv_heads=2)
    with pytest.raises(ValueError, match="k and v must have the same number of heads"):
        zoo.attention(q, k, v[:, :1], variant="full")


@pytest.mark.parametrize("num_kv_heads", [None, 4, 2, 1])
def test_module_shrinks_kv_projections_and_matches_its_repeated_form(num_kv_heads):
    """A GQA module is a multi-head module whose k and v projections repeat per group: copying
    its weights into a plain 8-head module, repeated, gives the same output."""
    torch.manual_seed(0)
    gqa = zoo.create_attention(
        "local", dim=64, num_heads=8, num_kv_heads=num_kv_heads, causal=True, window_size=5
    )
    groups = 8 // (num_kv_heads or 8)
    assert gqa.k_proj.out_features == gqa.v_proj.out_features == 64 // groups
    if num_kv_heads not in (None, 8):
        assert f"num_kv_heads={num_kv_heads}" in repr(gqa)
    plain = zoo.create_attention("local", dim=64, num_heads=8, causal=True, window_size=5)
    state = dict(gqa.state_dict())
    for name in ("k_proj", "v_proj"):
        for kind in ("weight", "bias"):
            per_head = state[f"{name}.{kind}"].unflatten(0, (-1, 8))  # (H_kv, head_dim, ...)
            state[f"{name}.{kind}"] = per_head.repeat_interleave(groups, dim=0).flatten(0, 1)
    plain.load_state_dict(state)
    x = torch.randn(2, 40, 64)
    torch.testing.assert_close(gqa(x), plain(x), rtol=1e-5, atol=1e-6)


def saved_bytes(fn) -> int:
    """Bytes of the distinct storages autograd keeps for the backward of ``fn()``."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(storages.values())


@pytest.mark.parametrize(
    "variant,backend",
    [("local", "blocked"), ("strided", "blocked"), ("bigbird", "blocked"), ("full", "sdpa")],
)
def test_grouped_kv_keeps_less_for_backward_than_the_repeated_form(variant, backend):
    """What a training step holds: the GQA call (H=8, H_kv=1) keeps fewer bytes for the backward
    than the same call on k and v repeated to 8 heads."""
    q, k, v = random_qkv(1, 8, 512, 512, head_dim=64, kv_heads=1)
    params = {**small_params(variant), "window_size": 32, "block_size": 64}
    params = {
        key: value for key, value in params.items() if key in zoo.get_spec(variant).parameters()
    }

    def run(k, v):
        return lambda: zoo.attention(q, k, v, variant=variant, backend=backend, **params).sum()

    grouped = saved_bytes(run(k, v))
    repeated = saved_bytes(run(k.repeat_interleave(8, 1), v.repeat_interleave(8, 1)))
    assert grouped < repeated, (grouped, repeated)
