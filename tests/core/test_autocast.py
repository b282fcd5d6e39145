"""``zoo.attention`` under torch.autocast: float32 inputs are cast to autocast's dtype first, as
torch's own attention is, so every backend returns that dtype; the reference keeps its float32
definition inside."""

from __future__ import annotations

import pytest
import torch

import zoo
from zoo.backends.flex import FlexBackend

BACKENDS = {"reference": "reference", "sdpa": "sdpa", "blocked": "blocked", "auto": "auto",
            "flex": FlexBackend(compile=False)}  # fmt: skip


@pytest.mark.parametrize("variant", ["local", "strided", "moba"])
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_every_backend_returns_the_autocast_dtype_within_its_precision(variant, backend):
    """reference and blocked returned float32 where sdpa and flex returned bfloat16, and
    blocked's strided and moba ignored autocast; the reference was the least precise there."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 96, 16) for _ in range(3))
    params = {"local": {"window_size": 8}, "strided": {"stride": 8, "window_size": 4},
              "moba": {"block_size": 16, "top_k": 2}}[variant]  # fmt: skip
    # on the inputs as autocast rounds them; MoBA's choice of blocks is made on the bfloat16
    # keys (its block means and scores in that dtype, as published), so its oracle is the
    # reference on the same bfloat16 inputs, which scores in float32 after that choice
    rounded = [t.bfloat16() for t in (q, k, v)]
    if variant != "moba":
        rounded = [t.double() for t in rounded]
    exact = zoo.attention(*rounded, variant=variant, backend="reference", **params).double()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = zoo.attention(q, k, v, variant=variant, backend=BACKENDS[backend], **params)
    assert out.dtype == torch.bfloat16
    # the output's rounding to bfloat16 (2^-8 relative) and bfloat16 arithmetic inside
    assert (out.double() - exact).abs().max() < 1e-2


def test_a_float32_cache_under_autocast_takes_float32_keys():
    """The cast to autocast's dtype made a float32 cache refuse the functional call's keys (it
    took them before); a bfloat16 cache takes the cast keys."""
    q = torch.randn(1, 2, 8, 16)
    for dtype in (torch.float32, torch.bfloat16):
        cache = zoo.new_cache("causal", batch_size=1, max_len=32, num_kv_heads=2, head_dim=16,
                              dtype=dtype)  # fmt: skip
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = zoo.attention(q, q, q, variant="causal", causal=True, cache=cache)
        assert out.shape == q.shape and cache.keys.dtype == dtype
        assert torch.equal(cache.lengths, torch.tensor([8]))
