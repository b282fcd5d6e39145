"""The table lookup that stands in for a pattern's mask_mod on GPUs (``zoo.backends.flex_lookup``):
the same answer on every pair, for every fixed registry variant that is constant on squares,
causal or not, per-head draws, lengths that are no multiple of a square, fewer or more queries
than keys; the pattern's own where it is not; and the one the flex backend takes per device."""

from __future__ import annotations

import itertools

import pytest
import torch
from helpers import FIXED_VARIANTS, GRAPH_VARIANTS, small_params

import zoo
from zoo.backends.flex import _slot_mask, flex_frame
from zoo.backends.flex_lookup import lookup_mask_mod
from zoo.core.prepare import prepare_call

VARIANTS = [v for v in FIXED_VARIANTS if v not in GRAPH_VARIANTS]
SHAPES = [(300, 300), (64, 64), (200, 333), (333, 200), (96, 160)]


def _pattern(variant: str, causal: bool, q_len: int, kv_len: int, heads: int):
    q, k = torch.zeros(1, heads, q_len, 16), torch.zeros(1, heads, kv_len, 16)
    params = small_params(variant)
    if "block_size" in zoo.get_spec(variant).parameters():
        params = {**params, "block_size": 32}
    return prepare_call(q, k, k, variant=variant, causal=causal, **params).pattern


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_lookup_equals_the_patterns_own_mask_mod(variant, causal):
    looked_up_somewhere = False
    for (q_len, kv_len), heads in itertools.product(SHAPES, (1, 3)):
        pattern = _pattern(variant, causal, q_len, kv_len, heads)
        lookup = lookup_mask_mod(pattern, q_len, kv_len, torch.device("cpu"))
        if lookup is None:
            continue
        looked_up_somewhere = True
        q_idx, kv_idx = torch.arange(q_len)[:, None], torch.arange(kv_len)[None, :]
        own = pattern.mask_mod(q_len, kv_len)
        for h in range(heads):
            b, head = torch.tensor(0), torch.tensor(h)
            assert torch.equal(lookup(b, head, q_idx, kv_idx), own(b, head, q_idx, kv_idx))
    constant = _pattern(variant, False, 64, 64, 1).constant_block
    assert looked_up_somewhere == (constant is not None and constant >= 16), constant


def test_bigbird_looks_up_where_aligned_and_not_where_shifted():
    """Equal lengths and shifts by whole squares are looked up; a shift by part of a square
    straddles squares and keeps the pattern's own mask_mod."""
    cpu = torch.device("cpu")
    assert lookup_mask_mod(_pattern("bigbird", False, 300, 300, 2), 300, 300, cpu) is not None
    assert lookup_mask_mod(_pattern("bigbird", False, 96, 160, 2), 96, 160, cpu) is not None
    assert lookup_mask_mod(_pattern("bigbird", False, 200, 333, 2), 200, 333, cpu) is None
    assert lookup_mask_mod(_pattern("local", False, 300, 300, 2), 300, 300, cpu) is None


@pytest.mark.parametrize(
    ("variant", "causal", "looked_up"),
    [("bigbird", False, True), ("bigbird", True, True), ("block_local", False, False),
     ("block_local", True, False)],
)  # fmt: skip
def test_flex_takes_the_lookup_on_a_gpu_only_where_it_pays(variant, causal, looked_up):
    """On CUDA (fake tensors here) BigBird's block mask carries the lookup, block_local's
    its own comparison (on an H100, at 16K, block_local's kernel took 3.7x flex_standard's with
    the lookup); on a CPU, where the pattern's own mask_mod ran faster
    (eval/results/design-notes-cpu.md#flex-lookup), always its own."""
    from zoo.testing.fake_cuda import FakeCudaUnavailable, fake_cuda

    pattern = _pattern(variant, causal, 300, 300, 2)
    assert lookup_mask_mod(pattern, 300, 300, torch.device("cpu")) is not None  # it could
    cpu_frame = flex_frame(pattern, 300, 300, 128, torch.device("cpu"))
    assert _slot_mask(pattern, cpu_frame, 300, 300).__name__ == "pattern_mask"
    try:
        with fake_cuda():
            frame = flex_frame(pattern, 300, 300, 128, torch.device("cuda"))
            name = _slot_mask(pattern, frame, 300, 300).__name__
    except FakeCudaUnavailable as error:
        pytest.skip(str(error))
    assert name.startswith("looked_up") == looked_up, name
