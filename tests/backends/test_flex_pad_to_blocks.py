"""``FlexBackend(pad_to_blocks=True)``: q, k and v padded to whole blocks on every device, and on
CUDA the lengths declared whole to Inductor (``IS_DIVISIBLE``), which it does itself only for
static multiples of 128 (not in the kernel of symbolic lengths the backend's compiled kernel runs
from its second length on). Values against the reference on a CPU (flex's eager kernel) at
lengths that are no multiple of the block, with key padding, a strided pattern run in its own
order and a pattern chosen by content; on fake CUDA tensors what reaches the kernel."""

from __future__ import annotations

import pytest
import torch
from helpers import check_against_reference, gpu, skip_without_fake_cuda

import zoo
from zoo.backends import flex_kernel
from zoo.backends.flex import FlexBackend
from zoo.testing.fake_cuda import fake_cuda

PADDED = FlexBackend(compile=False, pad_to_blocks=True)  # flex's eager kernel: CPU, tests only
CASES = {
    "local": {"window_size": 20},
    "longformer": {"window_size": 16, "global_tokens": 2},
    "bigbird": {"block_size": 16, "random_blocks": 2},
    "strided": {"stride": 8, "window_size": 7},
    "moba": {"block_size": 32, "top_k": 2},
    "causal": {},
}


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("n", [100, 300])
@pytest.mark.parametrize("variant", list(CASES))
def test_padded_calls_equal_the_reference(variant, n, causal):
    """float32 (flex's least error beside the reference's float64), grouped heads, n not a
    multiple of the block of 128; rows with key padding."""
    torch.manual_seed(0)
    q = torch.randn(2, 4, n, 16)
    k, v = (torch.randn(2, 2, n, 16) for _ in range(2))
    padding = torch.zeros(2, n, dtype=torch.bool)
    padding[1, n - 30 :] = True
    for mask in (None, padding):
        call = dict(variant=variant, causal=causal, key_padding_mask=mask, **CASES[variant])
        got = zoo.attention(q, k, v, backend=PADDED, **call)
        want = zoo.attention(*(x.double() for x in (q, k, v)), backend="reference", **call)
        assert torch.allclose(got.double(), want, atol=1e-5, rtol=0), (variant, n, mask)


def test_a_block_size_that_is_no_multiple_of_128_is_refused():
    with pytest.raises(ValueError, match="block_size must be a multiple of 128, got block_size=64"):
        FlexBackend(block_size=64, pad_to_blocks=True)
    with pytest.raises(TypeError, match="pad_to_blocks must be True or False, got 'yes'"):
        FlexBackend(pad_to_blocks="yes")
    assert "pad_to_blocks=True" in repr(FlexBackend(block_size=256, pad_to_blocks=True))


def test_on_cuda_the_kernel_gets_whole_blocks_declared_whole(monkeypatch):
    """Fake CUDA, 300 tokens in blocks of 128: the kernel gets 384 rows of q, k and v and
    ``IS_DIVISIBLE=True`` beside the backend's own options; the caller gets 300 rows. Without
    the option it gets 300 and declares nothing."""
    seen = []

    def kernel(q, k, v, **kwargs):
        seen.append((q.shape[-2], k.shape[-2], v.shape[-2], kwargs.get("kernel_options")))
        return torch.zeros_like(q)

    monkeypatch.setattr(flex_kernel, "_kernel", lambda *args: kernel)
    skip_without_fake_cuda()
    with fake_cuda():
        q = torch.randn(1, 2, 300, 32, dtype=torch.bfloat16, device="cuda")
        # the calls run outside torch.device("cuda"), as users' do: there a tensor the zoo makes
        # without device= lands on the CPU, and the mix raises
        for pad in (True, False):
            backend = FlexBackend(kernel_options={"num_stages": 2}, pad_to_blocks=pad)
            out = zoo.attention(q, q, q, variant="local", window_size=16, backend=backend)
            assert out.shape == q.shape
            assert ("padded to whole blocks and declared whole" in zoo.explain(
                q, q, q, variant="local", window_size=16, backend=backend)) is pad  # fmt: skip
    assert seen == [(384, 384, 384, {"IS_DIVISIBLE": True, "num_stages": 2}),
                    (300, 300, 300, {"num_stages": 2})]  # fmt: skip


@gpu
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("variant", ["local", "bigbird"])
def test_gpu_padded_forward_backward_matches_reference(variant, causal):
    """On a GPU (flex has no backward on a CPU): the padded, declared-whole kernel's output and
    gradients at 300 keys (and 200 queries with key padding), bfloat16."""
    for padded, (q_len, kv_len) in [(False, (300, 300)), (True, (200, 300))]:
        check_against_reference(
            variant, FlexBackend(pad_to_blocks=True), q_len=q_len, kv_len=kv_len, causal=causal,
            padded=padded, dtype=torch.bfloat16, device="cuda", head_dim=64,
        )  # fmt: skip
