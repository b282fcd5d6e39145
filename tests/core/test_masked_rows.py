"""A query with no allowed key outputs zeros, with finite gradients, on every backend."""

from __future__ import annotations

import pytest
import torch
from helpers import random_qkv

import zoo
from zoo.backends import BlockedBackend, FlexBackend

GRAD_BACKENDS = {"reference": "reference", "sdpa": "sdpa", "blocked": BlockedBackend(block_size=16)}
FORWARD_BACKENDS = {
    "flex-eager": FlexBackend(block_size=16, compile=False),
    "flex": FlexBackend(block_size=16),
}

# variant, params, causal, q_len, kv_len, key padding of sequence 1, rows of sequence 0 with no key
CASES = {
    "all keys padded": ("local", {"window_size": 5}, False, 40, 40, slice(0, 40), []),
    "queries before the first key": ("causal", {}, True, 50, 30, None, list(range(20))),
    "window beyond the padding": ("local", {"window_size": 2}, False, 40, 40, slice(20, 40), []),
    "global key padded": ("global", {"global_tokens": 1}, False, 40, 40, slice(0, 1), []),
}


def check_zero_rows(out, q_len, case):
    _, _, _, _, _, padded, empty_rows = case
    assert torch.isfinite(out).all()
    if padded is not None and padded == slice(0, 40):
        assert out[1].abs().max() == 0
    if padded == slice(20, 40):  # window of 2: queries 23.. see only padded keys
        assert out[1, :, 23:].abs().max() == 0 and out[1, :, :22].abs().min() > 0
    if padded == slice(0, 1):  # non-global queries see only the global key, which is padding
        assert out[1, :, 1:].abs().max() == 0 and out[1, :, 0].abs().max() > 0
    if empty_rows:
        assert (
            out[:, :, empty_rows].abs().max() == 0 and out[:, :, len(empty_rows) :].abs().min() > 0
        )


def run(case, backend, grad):
    variant, params, causal, q_len, kv_len, padded, _ = case
    q, k, v = random_qkv(2, 2, q_len, kv_len)
    if not grad:
        q, k, v = (t.detach() for t in (q, k, v))
    key_padding = torch.zeros(2, kv_len, dtype=torch.bool)
    if padded is not None:
        key_padding[1, padded] = True
    out = zoo.attention(
        q,
        k,
        v,
        variant=variant,
        backend=backend,
        causal=causal,
        key_padding_mask=key_padding,
        **params,
    )
    return out, (q, k, v)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("backend", list(GRAD_BACKENDS))
def test_empty_rows_give_zeros_and_finite_gradients(backend, case):
    out, inputs = run(CASES[case], GRAD_BACKENDS[backend], grad=True)
    check_zero_rows(out.detach(), CASES[case][3], CASES[case])
    out.square().sum().backward()
    for t in inputs:
        assert torch.isfinite(t.grad).all()
    empty_rows = CASES[case][6]
    if empty_rows:
        assert inputs[0].grad[:, :, empty_rows].abs().max() == 0


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("backend", list(FORWARD_BACKENDS))
def test_empty_rows_give_zeros_forward_only(backend, case):
    out, _ = run(CASES[case], FORWARD_BACKENDS[backend], grad=False)
    check_zero_rows(out, CASES[case][3], CASES[case])


def test_module_with_every_key_masked_gives_zeros():
    attn = zoo.create_attention("bigbird", dim=32, num_heads=2, block_size=8)
    x = torch.randn(2, 64, 32, requires_grad=True)
    y = attn(x, valid_lens=torch.tensor([64, 0]))
    assert torch.isfinite(y).all()
    # With no key, attention gives zeros and the output is the projection bias alone.
    assert torch.allclose(y[1], attn.out_proj.bias.expand(64, 32))
    y.sum().backward()
    assert torch.isfinite(x.grad).all()


@pytest.mark.parametrize("backend", list(GRAD_BACKENDS))
def test_a_pattern_with_no_pair_at_all_gives_zeros_and_zero_gradients(backend):
    from zoo.patterns import Global, Local, strided

    q, k, v = random_qkv(1, 2, 1, 200)
    for pattern in (Global(1) & Local(0), strided(8) & Local(0) & Global(1)):  # fused, explicit
        out = zoo.attention(q, k, v, variant=pattern, backend=GRAD_BACKENDS[backend])
        assert out.abs().max() == 0
        out.sum().backward()
        assert all(t.grad.abs().max() == 0 for t in (q, k, v))
