"""The per-shape caches (``zoo.core.shape_cache``): bounded by count and bytes, never holding
tensors of a tracing or fake mode, and results that do not depend on what was evicted."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from helpers import subprocess_timeout

import zoo
from zoo.backends import BlockedBackend
from zoo.core import shape_cache


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


def current_call_bytes() -> int:
    """The bytes of the entries the last zoo call used, which eviction keeps."""
    entries = shape_cache._ENTRIES.values()
    return sum(e.nbytes for e in entries if e.call == shape_cache._TOTAL["call"])


def test_the_bytes_stay_bounded_over_many_lengths(limits):
    limits(max_bytes=1 << 20)
    held = []
    for length in range(300, 340):
        bigbird(length)
        held.append(shape_cache.stats()["bytes"] - current_call_bytes())
    assert shape_cache.stats()["bytes"] > 1 << 19  # the bound was reached
    assert max(held) <= 1 << 20  # beyond the current call's entries, within it


def test_a_bound_of_zero_keeps_the_current_call_only(limits):
    limits(max_bytes=0)
    for length in range(300, 310):
        bigbird(length)
    assert shape_cache.stats()["bytes"] == current_call_bytes() > 0
    calls = {e.call for e in shape_cache._ENTRIES.values()}
    assert calls == {shape_cache._TOTAL["call"]}


def test_a_call_beyond_the_bound_does_not_rebuild_at_its_next_call(limits):
    limits(max_bytes=0)
    bigbird(300)
    misses = sum(c.misses for c in shape_cache._CACHES.values())
    bigbird(300)
    assert sum(c.misses for c in shape_cache._CACHES.values()) == misses


def test_evicted_structures_give_the_same_results(limits):
    expected = [bigbird(length) for length in (300, 301, 302)]
    limits(max_bytes=0)
    for length in range(310, 330):  # pushes 300-302's structures out
        bigbird(length)
    misses = sum(c.misses for c in shape_cache._CACHES.values())
    for length, out in zip((300, 301, 302), expected, strict=True):
        assert torch.equal(bigbird(length), out)
    assert sum(c.misses for c in shape_cache._CACHES.values()) > misses  # rebuilt


def test_a_compiled_graph_never_reads_another_entrys_result(limits):
    """Names of results that graphs read are never reused: an entry evicted and a new one made
    in its memory once gave the new one's tensor to the old graph (same shape: its guard held)."""
    from torch._dynamo.testing import CompileCounter

    @shape_cache.per_shape(maxsize=1)
    def constant(n: int) -> torch.Tensor:
        return torch.full((4,), float(n))

    compiled = torch.compile(lambda x, n: x + constant(n), backend=CompileCounter(), fullgraph=True)
    x = torch.zeros(4)
    assert compiled(x, 1).tolist() == [1.0] * 4
    constant(2)
    constant(3)
    assert compiled(x, 3).tolist() == [3.0] * 4
    assert compiled(x, 1).tolist() == [1.0] * 4


def test_a_first_call_under_inference_mode_then_training(limits):
    """A validation step before training built the structures as inference tensors, which
    autograd then refused to save."""
    q = torch.randn(1, 2, 70, 8)
    for variant, params in (("local", {"window_size": 5}), ("bigbird", {"block_size": 16})):
        with torch.inference_mode():
            zoo.attention(q, q, q, variant=variant, backend=BlockedBackend(16), **params)
        trained = q.clone().requires_grad_()
        out = zoo.attention(
            trained, trained, trained, variant=variant, backend=BlockedBackend(16), **params
        )
        out.sum().backward()
        assert torch.isfinite(trained.grad).all()


def test_a_builder_ignores_a_device_context():
    @shape_cache.per_shape(maxsize=1)
    def ramp(n: int) -> torch.Tensor:
        return torch.arange(n)

    with torch.device("meta"):
        built = ramp(3)
    assert built.device.type == "cpu" and built.tolist() == [0, 1, 2]


def test_a_builder_that_raises_leaves_the_cache_as_it_was(limits):
    @shape_cache.per_shape(maxsize=2)
    def picky(n: int) -> torch.Tensor:
        if n < 0:
            raise ValueError("negative")
        return torch.zeros(n)

    picky(3)
    before = shape_cache.stats()
    with pytest.raises(ValueError, match="negative"):
        picky(-1)
    assert shape_cache.stats() == before and picky.cache_info().currsize == 1


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


def test_two_builders_of_equal_arguments_in_one_traced_frame_give_their_own_results():
    """A decoding cache's two tables, both built from (pattern, max_len): ``query_bounds``'
    (most, least), then ``latest_runs``' runs, in one function under torch.compile. Each
    builder's own closure marked for dynamo (one code object) gave the second call the first
    one's result, and the block-local step of a compiled module failed."""
    torch._dynamo.reset()
    cache = zoo.new_cache("block_local", batch_size=2, max_len=64, num_kv_heads=1, head_dim=8,
                          block_size=8)  # fmt: skip
    seen = {}

    def tables(x):
        seen["bounds"] = cache.query_bounds(1)
        seen["first slots"] = cache.reads_first_slots(8, 1)
        return x + 1

    torch.compile(tables, backend="eager")(torch.ones(2))
    assert seen["first slots"] is True and len(seen["bounds"]) == 2


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


def test_builds_on_a_device_without_data_keep_one_name_per_arguments():
    """Each trace of a fake or meta call named its build anew and kept it on the holder for the
    life of the process; now one name per arguments, freed by ``clear``."""
    from zoo.core import shape_cache

    cache = shape_cache._ShapeCache(lambda n, d: torch.arange(n, device=d), 4)
    names = {cache.name((8, torch.device("meta"))) for _ in range(5)}
    assert len(names) == 1 and hasattr(shape_cache._BUILT, next(iter(names)))
    cache.clear()
    assert not hasattr(shape_cache._BUILT, next(iter(names)))
