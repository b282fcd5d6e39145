"""A forward call on CUDA reads no device value on the host: no ``.item()``, ``nonzero``, boolean
indexing or ``torch.equal`` on its path, each a synchronisation that would stall the host until
the GPU is done and keep it from queueing the next kernels (a cost the size of the host's work
per call, which a benchmark at short lengths shows as a fixed gap).

Fake tensors cannot show this: the zoo's value checks are skipped on them (``can_read_values``).
So the calls run on CUDA tensors that hold CPU values (``zoo.testing.tagged_cuda``), where every
read happens and is recorded. Per-shape structures are left out: on a GPU they are built once per
shape and cached (``zoo.core.shape_cache``). Flex's compiled kernel is stubbed (Inductor does not
run on tagged tensors); the work around it is what is checked. MoBA on ``blocked`` reads its runs'
count by design (``blocked.by_key``) and is not among these.
"""

from __future__ import annotations

import pytest
import torch
from helpers import FIXED_VARIANTS, GRAPH_VARIANTS, small_params
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import zoo
from zoo.backends import flex
from zoo.core import device_build
from zoo.core.device_build import Tagged

VARIANTS = [v for v in FIXED_VARIANTS if v not in GRAPH_VARIANTS]
READS = {"_local_scalar_dense", "nonzero", "masked_select", "is_nonzero", "equal",
         "unique_consecutive", "_unique2", "unique_dim"}  # fmt: skip


class DeviceReads(TorchDispatchMode):
    """Records each operation that reads a tagged tensor's values to the host, outside the
    per-shape builders."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        building = getattr(device_build._STATE, "building", False)
        tagged = any(isinstance(t, Tagged) for t in tree_leaves((args, kwargs)))
        if name in READS and not building and tagged:
            self.reads.append(name)
        return func(*args, **(kwargs or {}))


class HostCopies(TorchDispatchMode):
    """Records each copy of host data to the tagged device outside the per-shape builders: a
    CPU tensor's ``.to`` or ``.cuda`` and ``torch.tensor`` or ``torch.as_tensor`` asked for the
    device (seen where the tagging takes them, before any dispatch), and ``copy_`` of a CPU
    tensor into a tagged one. On a GPU such a copy from pageable memory waits for the device to
    finish its queue. Indexing with CPU indices is not watched."""

    def __init__(self, monkeypatch) -> None:
        super().__init__()
        self.copies: list[str] = []
        spied = device_build._DeviceArguments.__torch_function__

        def spy(mode, func, types, args=(), kwargs=None):
            if not _building() and _copies_to_the_device(func, args, kwargs or {}):
                self.copies.append(func.__name__)
            return spied(mode, func, types, args, kwargs)

        monkeypatch.setattr(device_build._DeviceArguments, "__torch_function__", spy)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if name == "copy_" and _into_the_device(args) and not _building():
            self.copies.append(name)
        return func(*args, **(kwargs or {}))


def _into_the_device(args: tuple) -> bool:
    return isinstance(args[0], Tagged) and not isinstance(args[1], Tagged)


def _building() -> bool:
    return getattr(device_build._STATE, "building", False)


def _copies_to_the_device(func, args, kwargs) -> bool:
    to_device = device_build._without_data(kwargs.get("device")) is not None
    if func in (torch.tensor, torch.as_tensor):
        return to_device
    if func not in (torch.Tensor.to, torch.Tensor.cuda) or isinstance(args[0], Tagged):
        return False
    named = any(device_build._without_data(a) is not None for a in args[1:])
    return func is torch.Tensor.cuda or named or to_device


def _stub_kernel(compiled, least, q, k, v, lse=False, **kwargs):
    out = q.new_zeros(*q.shape[:-1], v.shape[-1])
    return (out, q.new_zeros(q.shape[:-1], dtype=torch.float32)) if lse else out


@pytest.fixture
def tagged(monkeypatch):
    from zoo.testing.fake_cuda import FakeCudaUnavailable, tagged_cuda

    monkeypatch.setattr(flex, "run_kernel", _stub_kernel)
    try:
        with tagged_cuda() as tag:
            yield tag
    except FakeCudaUnavailable as error:
        pytest.skip(str(error))


@pytest.mark.parametrize("backend", ["flex", "sdpa", "blocked", "auto"])
@pytest.mark.parametrize("variant", [*VARIANTS, "moba"])
def test_a_forward_call_on_cuda_reads_no_device_value(variant, backend, tagged, monkeypatch):
    """Grouped heads, fewer queries than keys with key padding; causal at equal lengths (torch's
    own lower-right causal mask needs a CUDA runtime to be made). Nor does it copy host data to
    the device (``HostCopies``; MoBA's causal member on sdpa is a fixed member's mask beside a
    choice's)."""
    if variant == "moba" and backend == "blocked":
        pytest.skip("MoBA's runs by key block read their count (blocked.by_key)")
    q = tagged(torch.randn(2, 4, 150, 16))
    k = tagged(torch.randn(2, 2, 200, 16))
    padding = tagged(torch.zeros(2, 200, dtype=torch.bool))
    watch, copies = DeviceReads(), HostCopies(monkeypatch)
    with watch, copies:
        out = zoo.attention(
            q, k, k, variant=variant, backend=backend, key_padding_mask=padding,
            **small_params(variant),
        )  # fmt: skip
        params = small_params(variant)
        zoo.attention(k, k, k, variant=variant, backend=backend, causal=True, **params)
    assert out.device.type == "cuda"
    assert watch.reads == [], f"device values read on the host: {watch.reads}"
    assert copies.copies == [], f"host data copied to the device: {copies.copies}"


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_moba_on_flex_rows_gathered_by_key_block_read_no_device_value(causal, tagged):
    """The gathered rows (``flex_chosen``): their count is a bound fixed by the shapes."""
    q = tagged(torch.randn(1, 4, 1900, 16))
    k = tagged(torch.randn(1, 2, 2000, 16))
    padding = tagged(torch.zeros(1, 2000, dtype=torch.bool))
    backend = flex.FlexBackend()
    kw = dict(variant="moba", block_size=256, top_k=3, causal=causal, key_padding_mask=padding)
    assert backend.gathers(zoo.core.prepare.prepare_call(q, k, k, **kw))
    watch = DeviceReads()
    with watch:
        out = zoo.attention(q, k, k, backend=backend, **kw)
    assert out.device.type == "cuda"
    assert watch.reads == [], f"device values read on the host: {watch.reads}"


def test_the_watch_sees_a_read(tagged):
    watch = DeviceReads()
    with watch:
        x = tagged(torch.ones(3))
        bool(x.any())
        x.nonzero()
    assert watch.reads == ["_local_scalar_dense", "nonzero"]


def test_the_watch_sees_a_copy_to_the_device(tagged, monkeypatch):
    copies = HostCopies(monkeypatch)
    with copies:
        on_device = tagged(torch.ones(3))
        on_device.to("cuda")  # already there: no copy
        torch.zeros(3, device="cuda")  # made there
        torch.ones(3).to(torch.float64)  # stays on the host
        torch.ones(3).to("cuda")
        torch.ones(3).to(device="cuda")
        torch.ones(3).cuda()
        torch.tensor([1, 2], device="cuda")
        torch.as_tensor([1, 2], device="cuda")
        on_device.copy_(torch.ones(3))
    assert copies.copies == ["to", "to", "cuda", "tensor", "as_tensor", "copy_"]
