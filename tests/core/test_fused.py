"""Bookkeeping compiled into one graph on a GPU (``zoo.core.fused``): where it compiles, and what
happens where its compiled graph fails."""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import skip_without_fake_cuda

from zoo.core import fused as fused_module
from zoo.core.fused import Fused, fuses


def _double(x: torch.Tensor, n: int) -> torch.Tensor:
    return x * 2 + n


def test_fuses_only_real_cuda_data_outside_a_trace():
    assert not fuses(torch.ones(3))  # a CPU: eager
    assert not fuses(torch.ones(3, device="meta"))
    skip_without_fake_cuda()
    from zoo.testing.fake_cuda import fake_cuda

    with fake_cuda():
        assert not fuses(torch.ones(3, device="cuda"))  # fake: shapes only

    seen = []

    @torch.compile(backend="eager", fullgraph=True)
    def traced(x):
        seen.append(fuses(x))  # traced: the caller's graph takes the operations in
        return x + 1

    traced(torch.ones(3))
    assert seen == [False]


def test_the_function_runs_eagerly_where_it_does_not_fuse(monkeypatch):
    f = Fused(_double)
    monkeypatch.setattr(Fused, "compiled", property(lambda self: pytest.fail("compiled")))
    assert torch.equal(f(torch.ones(2), 3), torch.full((2,), 5.0))


def test_a_failed_compile_warns_once_and_runs_eagerly_from_then_on(monkeypatch):
    """A compiler that cannot lower the graph: the first call warns, naming the function and the
    error, and returns the eager values; later calls compile nothing and do not warn."""
    monkeypatch.setattr(fused_module, "fuses", lambda t: True)
    attempts = []

    def broken(*args):
        attempts.append(args)
        raise RuntimeError("no lowering for aten.sort on this GPU")

    f = Fused(_double)
    f.__dict__["compiled"] = broken  # what the cached property would hold
    with pytest.warns(RuntimeWarning, match=r"_double failed.*no lowering for aten.sort"):
        assert torch.equal(f(torch.ones(2), 1), torch.full((2,), 3.0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(f(torch.ones(2), 2), torch.full((2,), 4.0))
    assert len(attempts) == 1
    assert f.failed == "RuntimeError: no lowering for aten.sort on this GPU"


def test_inputs_at_fault_still_raise(monkeypatch):
    """The eager run after a failed compile raises the inputs' own error."""
    monkeypatch.setattr(fused_module, "fuses", lambda t: True)
    f = Fused(_double)
    f.__dict__["compiled"] = lambda *args: _double(*args)
    with pytest.raises(TypeError), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        f(torch.ones(2), "not an int")
