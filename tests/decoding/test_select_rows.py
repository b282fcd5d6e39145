"""``KVCache.select_rows``: row i takes what row index[i] holds, as beam search keeps its best
beams; the next steps equal one causal forward over each taken row's sequence, for every variant
(zoo.decoding.cache). Compared in float64, where they agree to rounding."""

from __future__ import annotations

import pytest
import torch
from helpers import FIXED_VARIANTS, cache_params

import zoo

VARIANTS = [v for v in [*FIXED_VARIANTS, "moba"] if "grid" not in zoo.get_spec(v).parameters()]
TAKEN = torch.tensor([2, 0, 0])


def module(variant):
    torch.manual_seed(0)
    attn = zoo.create_attention(variant, dim=16, num_heads=4, num_kv_heads=2, causal=True,
                                **cache_params(variant, 64))  # fmt: skip
    return attn.double().eval()


def beams(attn, static=False):
    """Three rows of 30, 24 and 27 tokens, two steps, the beams taken, six more steps: the
    outputs of those steps and what each row's whole sequence is."""
    x = torch.randn(3, 30, 16, dtype=torch.float64)
    lens = torch.tensor([30, 24, 27])
    cache = attn.new_cache(3, 64, static=static)
    attn(x, cache=cache, valid_lens=lens)
    steps = torch.randn(3, 8, 16, dtype=torch.float64)
    for j in range(2):
        attn(steps[:, j : j + 1], cache=cache)
    pointers = [cache.keys.data_ptr(), cache._lengths.data_ptr()]
    cache.select_rows(TAKEN)
    if static:
        assert [cache.keys.data_ptr(), cache._lengths.data_ptr()] == pointers
    outs = torch.cat([attn(steps[:, j : j + 1], cache=cache) for j in range(2, 8)], 1)
    sequences = []
    for row, was in enumerate(TAKEN.tolist()):
        sequences.append(torch.cat([x[was, : lens[was]], steps[was, :2], steps[row, 2:]]))
    return outs, sequences, cache


@pytest.mark.parametrize("variant", VARIANTS)
def test_steps_after_taking_beams_equal_the_forward_over_each_beam(variant):
    attn = module(variant)
    with torch.no_grad():
        outs, sequences, cache = beams(attn)
        for row, seq in enumerate(sequences):
            want = attn(seq[None])[:, -6:]
            assert torch.allclose(outs[row : row + 1], want, atol=1e-10, rtol=0), (variant, row)
    assert cache.lengths.tolist() == [len(s) for s in sequences]


@pytest.mark.parametrize("variant", ["causal", "sliding_window", "moba"])
def test_a_static_cache_takes_beams_in_place(variant):
    """The same steps on a static cache; its stores keep their addresses (CUDA graphs)."""
    attn = module(variant)
    with torch.no_grad():
        torch.manual_seed(1)
        got, _, _ = beams(attn, static=True)
        torch.manual_seed(1)
        want, _, _ = beams(attn)
    assert torch.allclose(got, want, atol=1e-10, rtol=0)


def test_beams_of_a_prefill_that_records_gradients():
    """With autograd recording, the cache takes new stores (autograd keeps what it recorded),
    and the gradient reaches the prefill's inputs of the rows taken only."""
    attn = module("causal")
    x = torch.randn(3, 10, 16, dtype=torch.float64, requires_grad=True)
    cache = attn.new_cache(3, 32)
    attn(x, cache=cache)
    cache.select_rows(torch.tensor([1, 1, 2]))
    attn(torch.randn(3, 1, 16, dtype=torch.float64), cache=cache).sum().backward()
    touched = x.grad.abs().sum((1, 2))
    assert touched[0] == 0 and touched[1] > 0 and touched[2] > 0


@pytest.mark.parametrize(
    "index, expected",
    [
        (torch.tensor([0, 3, 1]), r"hold rows in \[0, 3\), got \[0, 3, 1\]"),
        (torch.tensor([0, 1]), r"be a \(3,\) int tensor on cpu, got \(2,\)"),
        (torch.tensor([0.0, 1.0, 2.0]), r"be a \(3,\) int tensor on cpu, got \(3,\) torch.float32"),
        ([0, 1, 2], r"be a \(3,\) int tensor on cpu, got \[0, 1, 2\]"),
    ],
)
def test_a_bad_index_is_refused_by_name(index, expected):
    attn = module("causal")
    cache = attn.new_cache(3, 32)
    with pytest.raises(ValueError, match="select_rows: index must " + expected):
        cache.select_rows(index)
