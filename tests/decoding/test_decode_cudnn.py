"""A decoding step on CUDA leaves cuDNN's SDPA out (``zoo.backends.sdpa.without_cudnn``): its key
length grows by one each step, and cuDNN builds an execution graph for every new shape (on an
H100, torch 2.11: a causal step of 73 ms at 4K slots against 0.06 ms for SDPA over a fixed
cache). The backends the caller left enabled stay as they were; outside the step nothing changes.
On a CPU the steps run on fake CUDA tensors with SDPA's flags recorded at the call; on a GPU a
profile of steps at growing widths holds that no cuDNN kernel ran."""

from __future__ import annotations

import pytest
import torch
from helpers import gpu

import zoo
from zoo.testing.fake_cuda import FakeCudaUnavailable, fake_cuda

FLAGS = ("flash", "mem_efficient", "math", "cudnn")


def _flags() -> dict[str, bool]:
    return {name: getattr(torch.backends.cuda, f"{name}_sdp_enabled")() for name in FLAGS}


def _decode(device, steps: int = 3) -> None:
    with torch.device(device):
        attn = zoo.create_attention(
            "causal", dim=32, num_heads=4, num_kv_heads=2, causal=True, backend="sdpa"
        ).eval()  # fmt: skip
        x = torch.randn(2, 8 + steps, 32)
        cache = attn.new_cache(2, 32)
    # the calls run outside torch.device(device), as users do, so that a CPU tensor shows
    attn(x[:, :8], cache=cache)
    for i in range(8, 8 + steps):
        attn(x[:, i : i + 1], cache=cache)


@pytest.mark.parametrize(
    "disabled", [None, "flash", "math"], ids=["defaults", "flash_disabled", "math_disabled"]
)
def test_a_step_on_cuda_leaves_cudnn_out_and_the_callers_choices_in(monkeypatch, disabled):
    """cuDNN left out, the backends the caller enabled kept; but where the caller turned math
    off, cuDNN stays (grouped heads with a mask would have no other kernel)."""
    seen = []
    original = torch.nn.functional.scaled_dot_product_attention

    def recording(q, *args, **kwargs):
        if q.shape[2] == 1:  # a one-token step (the prefill is another call)
            seen.append(_flags())
        return original(q, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    before = _flags()
    try:
        if disabled:
            getattr(torch.backends.cuda, f"enable_{disabled}_sdp")(False)
        expected = {**_flags(), "cudnn": disabled == "math"}
        try:
            with fake_cuda(), torch.no_grad():  # _decode builds under torch.device, calls outside
                _decode("cuda")
        except FakeCudaUnavailable as error:
            pytest.skip(str(error))
        after = _flags()
    finally:
        for name, on in before.items():
            getattr(torch.backends.cuda, f"enable_{name}_sdp")(on)
    assert len(seen) == 3 and all(flags == expected for flags in seen), seen
    assert after == {**before, **({disabled: False} if disabled else {})}  # restored after


def test_a_step_on_the_cpu_leaves_the_flags_alone(monkeypatch):
    seen = []
    original = torch.nn.functional.scaled_dot_product_attention

    def recording(q, *args, **kwargs):
        seen.append(_flags())
        return original(q, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    with torch.no_grad():
        _decode("cpu")
    assert seen and all(flags == _flags() for flags in seen)


@gpu
def test_steps_at_growing_widths_run_no_cudnn_kernel_on_a_gpu():
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad():
        _decode("cuda", steps=1)  # warm
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            _decode("cuda", steps=4)
            torch.cuda.synchronize()
    names = [e.key for e in prof.key_averages()]
    assert names and not [n for n in names if "cudnn" in n.lower()], names
