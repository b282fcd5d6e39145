"""Bookkeeping compiled into one graph on a GPU (``zoo.core.fused``): where it compiles, and what
happens where its compiled graph fails."""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import skip_without_fake_cuda
from torch.utils._python_dispatch import TorchDispatchMode

from zoo.core import fused as fused_module
from zoo.core.fused import Fused, compiles_here, fuses


def _double(x: torch.Tensor, n: int) -> torch.Tensor:
    return x * 2 + n


class _Watching(TorchDispatchMode):
    """A dispatch mode as a FLOP counter or a memory tracker is."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_compiles_only_real_data_outside_a_trace_and_any_dispatch_mode():
    assert compiles_here(torch.ones(3)) and not fuses(torch.ones(3))  # a CPU: never fused
    assert not compiles_here(torch.ones(3, device="meta"))
    with _Watching():  # dynamo would skip the function for good, first called under a mode
        assert not compiles_here(torch.ones(3))
    seen = []

    @torch.compile(backend="eager", fullgraph=True)
    def traced(x):
        seen.append(compiles_here(x))  # traced: the caller's graph takes the operations in
        return x + 1

    traced(torch.ones(3))
    assert seen == [False]
    skip_without_fake_cuda()
    from zoo.testing.fake_cuda import fake_cuda

    with fake_cuda():
        assert not fuses(torch.ones(3, device="cuda"))  # fake: shapes only


def test_the_function_runs_eagerly_where_it_does_not_fuse(monkeypatch):
    f = Fused(_double)
    monkeypatch.setattr(Fused, "compiled", property(lambda self: pytest.fail("compiled")))
    assert torch.equal(f(torch.ones(2), 3), torch.full((2,), 5.0))


def test_compiling_raises_dynamos_limit_of_graphs():
    """Each kind of call is a graph; past dynamo's default of 8 it would run eagerly unseen."""
    import torch._dynamo.config as dynamo_config

    name = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"
    before = getattr(dynamo_config, name)
    setattr(dynamo_config, name, 8)  # (monkeypatch's undo deletes a config entry)
    try:
        Fused(_double).compiled  # noqa: B018 - building it raises the limit
        assert getattr(dynamo_config, name) >= fused_module.RECOMPILE_LIMIT
    finally:
        setattr(dynamo_config, name, before)


def _fused_with(monkeypatch, compiled) -> Fused:
    monkeypatch.setattr(fused_module, "fuses", lambda t: True)
    f = Fused(_double)
    f.__dict__["compiled"] = compiled  # what the cached property would hold
    return f


def test_a_failed_compile_warns_once_and_runs_eagerly_from_then_on(monkeypatch):
    """A compiler that cannot lower the graph: the first call warns, naming the function and the
    error, and returns the eager values; later calls compile nothing and do not warn."""
    attempts = []

    def broken(*args):
        attempts.append(args)
        raise RuntimeError("no lowering for aten.sort on this GPU")

    f = _fused_with(monkeypatch, broken)
    with pytest.warns(RuntimeWarning, match=r"_double failed.*no lowering for aten.sort"):
        assert torch.equal(f(torch.ones(2), 1), torch.full((2,), 3.0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(f(torch.ones(2), 2), torch.full((2,), 4.0))
    assert len(attempts) == 1
    assert f.failed == "RuntimeError: no lowering for aten.sort on this GPU"


class _Leaf:
    def weight(self) -> int:
        return 1


class _Other(_Leaf):
    pass


class _Union:
    def __init__(self, *children):
        self.children = children


def _weighted(x: torch.Tensor, pattern: object) -> torch.Tensor:
    return x * 2


def test_a_failed_compile_sends_eager_only_the_calls_of_its_kind(monkeypatch):
    """A graph that fails for one kind of argument (a pattern dynamo cannot trace) sends eager
    that kind alone, told by the classes of the non-tensor arguments and of a composition's
    members: the other kinds, and a composition of other members, still run compiled."""
    compiled_calls = []

    def compiled(x, pattern):
        if isinstance(pattern, _Other) or any(
            isinstance(c, _Other) for c in getattr(pattern, "children", ())
        ):
            raise RuntimeError("cannot trace _Other")
        compiled_calls.append(type(pattern).__name__)
        return _weighted(x, pattern)

    monkeypatch.setattr(fused_module, "fuses", lambda t: True)
    f = Fused(_weighted)
    f.__dict__["compiled"] = compiled
    x = torch.ones(2)
    with pytest.warns(RuntimeWarning, match=r"of this kind \(_Other\).*cannot trace _Other"):
        f(x, _Other())
    with pytest.warns(RuntimeWarning, match=r"\(_Union\(_Leaf, _Other\)\)"):
        f(x, _Union(_Leaf(), _Other()))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for pattern in (_Other(), _Leaf(), _Union(_Leaf(), _Leaf()), _Union(_Leaf(), _Other())):
            assert torch.equal(f(x, pattern), torch.full((2,), 2.0))
    assert compiled_calls == ["_Leaf", "_Union"]  # the failed kinds were not tried again
    assert len(f.failures) == 2 and f.failed.count("cannot trace _Other") == 2


def test_inputs_at_fault_raise_and_keep_the_compiled_graph(monkeypatch):
    """Where the eager run fails too, its error is raised, nothing warns, and the next call runs
    compiled again."""
    calls = []

    def compiled(*args):
        calls.append(args)
        return _double(*args)

    f = _fused_with(monkeypatch, compiled)
    with pytest.raises(TypeError), warnings.catch_warnings():
        warnings.simplefilter("error")
        f(torch.ones(2), "not an int")
    assert f.failed is None
    assert torch.equal(f(torch.ones(2), 1), torch.full((2,), 3.0)) and len(calls) == 2


def test_running_out_of_memory_is_raised_as_it_is(monkeypatch):
    def out_of_memory(*args):
        raise torch.OutOfMemoryError("CUDA out of memory")

    f = _fused_with(monkeypatch, out_of_memory)
    with pytest.raises(torch.OutOfMemoryError):
        f(torch.ones(2), 1)
    assert f.failed is None


def test_an_eager_twin_runs_where_the_function_is_not_compiled(monkeypatch):
    """``fused(eager=...)``: the eager twin where nothing fuses and after a failed compile (its
    values, never the one expression meant for a compiler); the compiled function where it
    fuses."""
    twin_calls = []

    def twin(x: torch.Tensor, n: int) -> torch.Tensor:
        twin_calls.append(n)
        return _double(x, n)

    f = fused_module.fused(eager=twin)(_double)
    assert f.__name__ == "_double" and f.fn is _double
    monkeypatch.setattr(Fused, "compiled", property(lambda self: pytest.fail("compiled")))
    assert torch.equal(f(torch.ones(2), 1), torch.full((2,), 3.0)) and twin_calls == [1]
    monkeypatch.undo()

    def broken(*args):
        raise RuntimeError("no lowering")

    monkeypatch.setattr(fused_module, "fuses", lambda t: True)
    f.__dict__["compiled"] = broken
    with pytest.warns(RuntimeWarning, match="no lowering"):
        assert torch.equal(f(torch.ones(2), 2), torch.full((2,), 4.0))
    assert twin_calls == [1, 2]
    g = fused_module.fused(eager=twin)(_double)
    g.__dict__["compiled"] = lambda *args: _double(*args) + 100
    assert torch.equal(g(torch.ones(2), 0), torch.full((2,), 102.0)) and twin_calls == [1, 2]


def test_a_backward_that_fails_to_compile_fails_in_the_call_and_runs_eagerly(monkeypatch):
    """An argument that records gradients: the graph's backward compiles with its forward, so a
    backward the compiler cannot lower warns in the call, which returns the eager values, and
    the caller's backward runs (compiled lazily, it raised from ``backward()`` at every step)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def forward_compiler(graph, inputs):
        return make_boxed_func(graph.forward)

    def broken_backward(graph, inputs):
        raise RuntimeError("no lowering for the backward")

    monkeypatch.setattr(fused_module, "fuses", lambda t: True)
    torch._dynamo.reset()
    f = Fused(_double)
    backend = aot_autograd(fw_compiler=forward_compiler, bw_compiler=broken_backward)
    f.__dict__["compiled"] = torch.compile(f.fn, backend=backend)
    x = torch.ones(3, requires_grad=True)
    with pytest.warns(RuntimeWarning, match="no lowering for the backward"):
        out = f(x, 1)
    out.sum().backward()
    assert torch.equal(out, torch.full((3,), 3.0)) and torch.equal(x.grad, torch.full((3,), 2.0))
    assert "no lowering for the backward" in f.failed
