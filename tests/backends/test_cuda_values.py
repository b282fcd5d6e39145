"""The CUDA paths' values on a machine without a GPU: every variant on blocked, sdpa and the
reference, on CUDA tensors that hold CPU values (``zoo.testing.tagged_cuda``), equals the same
call on the CPU, forward, with grouped heads, fewer queries than keys, key padding, causal and
not. The backends branch on the device (blocked's fused path where the CPU merges pieces, the
causal mask sdpa builds, the plans built for a device without data), so the CUDA branches'
values are checked here in CI; fake tensors (tests/backends/test_cuda_paths.py) check where their
tensors live, without values. MoBA on blocked runs CUDA's memory-efficient kernel, stood in for
by its emulation. A backward cannot run on tagged tensors (autograd's engine asks for a CUDA
stream): the GPU tests hold gradients."""

from __future__ import annotations

import pytest
import torch
from efficient_attention_emulation import EmulatedEfficientOps
from helpers import SELF_CONTAINED_VARIANTS, small_params

import zoo
from zoo.backends import lse_kernel


@pytest.fixture
def tagged(monkeypatch):
    from zoo.testing.fake_cuda import FakeCudaUnavailable, tagged_cuda

    monkeypatch.setitem(lse_kernel.KERNELS, "cuda", lse_kernel.cuda_kernel(EmulatedEfficientOps()))
    try:
        with tagged_cuda() as tag:
            yield tag
    except FakeCudaUnavailable as error:
        pytest.skip(str(error))


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("backend", ["blocked", "sdpa", "reference"])
@pytest.mark.parametrize("variant", SELF_CONTAINED_VARIANTS)
def test_the_cuda_path_computes_what_the_cpu_path_does(variant, backend, causal, tagged):
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 150, 16, generator=g), torch.randn(2, 2, 200, 16, generator=g)
    v = torch.randn(2, 2, 200, 8, generator=g)
    padding = torch.zeros(2, 200, dtype=torch.bool)
    padding[1, 150:] = True
    kwargs = dict(variant=variant, backend=backend, causal=causal, **small_params(variant))
    got = zoo.attention(*(tagged(x) for x in (q, k, v)), key_padding_mask=tagged(padding), **kwargs)
    want = zoo.attention(q, k, v, key_padding_mask=padding, **kwargs)
    assert got.device.type == "cuda"
    assert (got.values - want).abs().max() < 1e-5
