"""Padded keys are never read: NaN, inf or any other value at a padded key reaches no output and no
gradient, on every backend, for every registry variant (``zoo.attention``'s docstring)."""

from __future__ import annotations

import pytest
import torch
from helpers import SELF_CONTAINED_VARIANTS, small_params

import zoo
from zoo.backends import BlockedBackend, FlexBackend

BACKENDS = {
    "reference": "reference",
    "sdpa": "sdpa",
    "blocked": BlockedBackend(block_size=16),
    "auto": "auto",
}
LENGTH = 45  # not a multiple of any block size


def padded_inputs(garbage: float, kv_heads: int = 2) -> tuple[list[torch.Tensor], torch.Tensor]:
    """q (3, 4, L, 8), k and v (3, kv_heads, L, 8) with ``garbage`` at every padded key, and the
    padding: sequence 1 its last 13 keys, sequence 2 keys 3 and 30..44."""
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(3, 4, LENGTH, 8, generator=generator)
    k, v = (torch.randn(3, kv_heads, LENGTH, 8, generator=generator) for _ in range(2))
    padding = torch.zeros(3, LENGTH, dtype=torch.bool)
    padding[1, -13:] = True
    padding[2, 3] = padding[2, 30:] = True
    for x in (k, v):
        x.masked_fill_(padding[:, None, :, None], garbage)
    return [q, k, v], padding


def run(tensors, padding, variant, backend, causal, grads=True):
    tensors = [t.clone().requires_grad_(grads) for t in tensors]
    out = zoo.attention(
        *tensors, variant=variant, backend=backend, causal=causal, key_padding_mask=padding,
        **small_params(variant),
    )  # fmt: skip
    if not grads:
        return [out]
    out.square().sum().backward()
    return [out, *(t.grad for t in tensors)]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("variant", SELF_CONTAINED_VARIANTS)
def test_padded_keys_are_never_read(variant, backend, causal):
    clean, padding = padded_inputs(0.0)
    expected = run(clean, padding, variant, BACKENDS[backend], causal)
    for garbage in (float("nan"), float("inf"), -float("inf"), 3e38):
        tensors, _ = padded_inputs(garbage)
        got = run(tensors, padding, variant, BACKENDS[backend], causal)
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, expected, strict=True):
            assert torch.equal(a, b), f"{name} differs with {garbage} at the padded keys"
    for grad in expected[2:]:  # the padded keys' gradients are zero
        assert grad.masked_select(padding[:, None, :, None]).abs().max() == 0


@pytest.mark.parametrize("backend", ["flex-eager", "flex"])
@pytest.mark.parametrize("variant", ["full", "local", "bigbird", "moba"])
def test_padded_keys_are_never_read_on_flex(variant, backend):
    flex = FlexBackend(block_size=16, compile=backend == "flex")
    clean, padding = padded_inputs(0.0, kv_heads=4)
    expected = run(clean, padding, variant, flex, False, grads=False)[0]
    tensors, _ = padded_inputs(float("nan"), kv_heads=4)
    assert torch.equal(run(tensors, padding, variant, flex, False, grads=False)[0], expected)


@pytest.mark.parametrize("variant", ["full", "local", "bigbird", "moba"])
def test_padded_new_tokens_are_never_read_from_a_cache(variant):
    """Right-padded tokens of a step with a cache: not read by that step nor by later ones."""
    params = small_params(variant)
    outputs = []
    for garbage in (0.0, float("nan")):
        cache = zoo.new_cache(
            variant, batch_size=2, max_len=64, num_kv_heads=2, head_dim=8, **params
        )
        generator = torch.Generator().manual_seed(1)
        q, k, v = (torch.randn(2, 2, 6, 8, generator=generator) for _ in range(3))
        padding = torch.zeros(2, 6, dtype=torch.bool)
        padding[0, 4:] = True
        k[0, :, 4:] = v[0, :, 4:] = garbage
        first = zoo.attention(
            q, k, v, variant=variant, causal=True, cache=cache, key_padding_mask=padding, **params
        )
        step = [torch.randn(2, 2, 1, 8, generator=generator) for _ in range(3)]
        second = zoo.attention(*step, variant=variant, causal=True, cache=cache, **params)
        outputs.append((first[0, :, :4], first[1], second))
    for a, b in zip(*outputs, strict=True):
        assert torch.equal(a, b)
