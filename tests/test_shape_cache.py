"""The per-shape caches (``zoo.shape_cache``): bounded by count and bytes, never holding tensors
of a tracing or fake mode, and results that do not depend on what was evicted."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from helpers import subprocess_timeout

import zoo
from zoo import shape_cache
from zoo.backends import BlockedBackend


@pytest.fixture
def limits():
    """Restore the byte bound and start from empty caches."""
    before = shape_cache.stats()["max_bytes"]
    shape_cache.clear_all()
    yield shape_cache.set_limits
    shape_cache.set_limits(max_bytes=before)
    shape_cache.clear_all()


def bigbird(length: int) -> torch.Tensor:
    q = torch.randn(1, 1, length, 8, generator=torch.Generator().manual_seed(length))
    return zoo.attention(q, q, q, variant="bigbird", block_size=16, backend=BlockedBackend(16))


def test_the_bytes_stay_bounded_over_many_lengths(limits):
    limits(max_bytes=1 << 20)
    held = []
    for length in range(300, 340):
        bigbird(length)
        held.append(shape_cache.stats())
    newest = held[-1]
    assert held[5]["bytes"] > 0
    # within the bound, or down to the newest entries that are always kept
    assert newest["bytes"] <= 1 << 20 or newest["entries"] == shape_cache.KEPT_NEWEST
    assert max(s["entries"] for s in held) <= shape_cache.KEPT_NEWEST + 20


def test_a_bound_of_zero_keeps_the_newest_entries_only(limits):
    limits(max_bytes=0)
    for length in range(300, 310):
        bigbird(length)
    assert shape_cache.stats()["entries"] == shape_cache.KEPT_NEWEST


def test_evicted_structures_give_the_same_results(limits):
    expected = [bigbird(length) for length in (300, 301, 302)]
    limits(max_bytes=0)
    for length in range(310, 330):  # pushes 300-302's structures out
        bigbird(length)
    for length, out in zip((300, 301, 302), expected, strict=True):
        assert torch.equal(bigbird(length), out)


def test_each_builder_keeps_its_count_bound(limits):
    builds = []

    @shape_cache.per_shape(maxsize=3)
    def square(n: int) -> torch.Tensor:
        builds.append(n)
        return torch.full((n,), n)

    for n in (1, 2, 3, 1, 4, 1, 2):
        assert square(n).tolist() == [n] * n
    # 1, 2, 3 built; 1 hit; 4 evicts 2 (the least recently used); 1 hit; 2 rebuilt, evicting 3
    assert builds == [1, 2, 3, 4, 2]
    assert square.cache_info().currsize == 3
    square.cache_clear()
    assert square.cache_info().currsize == 0


def test_the_byte_count_sees_tensors_inside_objects():
    class Holder:
        def __init__(self) -> None:
            self.index = [torch.zeros(10, dtype=torch.int64)]
            self.inner = {"mask": (torch.zeros(3),)}

    assert shape_cache._nbytes(Holder()) == 80 + 12
    shared = torch.zeros(100)
    assert shape_cache._nbytes([shared, shared[:10], shared]) == 400  # one storage, once


@pytest.mark.parametrize("bad", [-1, 1.5, True, "1"])
def test_a_bad_bound_is_named(bad):
    with pytest.raises(ValueError, match="max_bytes must be an int >= 0"):
        shape_cache.set_limits(max_bytes=bad)


def test_outside_graph_marks_as_torch_does():
    def marked():
        return 1

    def by_torch():
        return 1

    shape_cache.outside_graph(marked)
    torch.compiler.assume_constant_result(by_torch)
    assert {k: v for k, v in vars(marked).items()} == {k: v for k, v in vars(by_torch).items()}


def test_a_builder_under_a_fake_mode_keeps_real_tensors(limits):
    """Under a fake mode (torch.export's non-strict tracing makes one), a builder still makes
    real tensors: cached fake ones would be what every later eager call gets."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        q = torch.randn(1, 2, 36, 8)
        out = zoo.attention(q, q, q, variant="local", window_size=4, backend="reference")
        assert isinstance(out, FakeTensor)
    cached = [e.result for e in shape_cache._ENTRIES.values()]
    masks = [t for t in cached if isinstance(t, torch.Tensor)]
    assert masks and not any(isinstance(t, FakeTensor) for t in masks)
    q = torch.randn(1, 2, 36, 8)
    out = zoo.attention(q, q, q, variant="local", window_size=4, backend="reference")
    assert not isinstance(out, FakeTensor) and torch.isfinite(out).all()


def test_import_zoo_does_not_import_dynamo():
    """``import zoo`` pays for torch, not for the compiler (it doubled the import's time)."""
    code = "import sys, zoo; print('torch._dynamo' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True,
        timeout=subprocess_timeout(60),
    )  # fmt: skip
    assert result.stdout.strip() == "False"
