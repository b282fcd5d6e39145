"""``FlexBackend(static_lengths=True)``: on a GPU the kernel compiled for each length, never the
kernel of symbolic lengths that the backend's compiled kernel runs from its second length on
(``flex_kernel._compiled_kernel``); the option's errors and repr. Which compiled kernel a call
takes is checked on CUDA tensors that hold CPU values (``zoo.testing.tagged_cuda``), the
kernel stood in for by zeros of its shapes."""

from __future__ import annotations

import pytest
import torch

import zoo
from zoo.backends import flex as flex_module
from zoo.backends import flex_kernel
from zoo.backends.flex import FlexBackend
from zoo.testing.fake_cuda import FakeCudaUnavailable, tagged_cuda


@pytest.mark.parametrize("static", [False, True], ids=["symbolic_after_one", "static"])
@pytest.mark.parametrize("variant", ["local", "moba"])  # moba: its queries gathered by block
def test_a_call_on_cuda_takes_the_kernel_its_lengths_ask_for(variant, static, monkeypatch):
    taken = []

    def kernel(q, k, v, **kwargs):  # zeros of the kernel's shapes (flex runs on no tag)
        out = q.new_zeros(*q.shape[:3], v.shape[-1])
        asked = kwargs.get("return_lse") or kwargs.get("return_aux") is not None
        return (out, q.new_zeros(q.shape[:3], dtype=torch.float32)) if asked else out

    def compiled_kernel(dynamic_lengths):  # which compiled kernel was asked for
        taken.append(dynamic_lengths)
        return kernel

    monkeypatch.setattr(flex_kernel, "_compiled_kernel", compiled_kernel)
    gathered = []  # taken even where it would not pay at this size
    monkeypatch.setattr(flex_module, "gathered_pays", lambda *args: gathered.append(1) or True)
    params = {"local": {"window_size": 20}, "moba": {"block_size": 32, "top_k": 2}}[variant]
    q = torch.randn(1, 2, 300, 16)
    backend = FlexBackend(static_lengths=static)
    try:
        with tagged_cuda() as tag:
            out = zoo.attention(tag(q), tag(q), tag(q), variant=variant, backend=backend,
                                **params)  # fmt: skip
    except FakeCudaUnavailable as error:
        pytest.skip(str(error))
    assert out.device.type == "cuda" and bool(gathered) == (variant == "moba")
    assert taken and all(dynamic is not static for dynamic in taken), taken


def test_the_option_is_checked_and_shown():
    assert "static_lengths=True" in repr(FlexBackend(static_lengths=True))
    assert "static_lengths" not in repr(FlexBackend())
    with pytest.raises(TypeError, match="static_lengths must be True or False, got 1"):
        FlexBackend(static_lengths=1)
