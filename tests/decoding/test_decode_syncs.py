"""A decoding step reads no device value on the host (zoo.decoding.decode, zoo.decoding.cache,
zoo.backends.sdpa.sdpa_decode): no ``.item()``, ``.tolist()``, ``nonzero``, boolean indexing or
``torch.equal`` on its path, each a synchronisation on a GPU.

On a CPU the step runs on fake CUDA tensors (``zoo.testing.fake_cuda``), which have no values, so
any such read raises (DataDependentOutputException, DynamicOutputShapeException): every fixed
variant and moba, on every decoding backend, with and without valid_lens, grouped heads. On a GPU
the steps run under ``torch.cuda.set_sync_debug_mode("error")``. The widths the host keeps instead
(``KVCache.host_lengths``, ``zoo.decoding.bounds``) are held to the values they bound on the CPU;
that the outputs are unchanged is held by the other tests of this folder (against full forwards).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from helpers import FIXED_VARIANTS, GRAPH_VARIANTS, cache_params, gpu, skip_without_fake_cuda

import zoo
from zoo.backends import FlexBackend, base, sdpa
from zoo.decoding import block_sums
from zoo.functional import resolve_pattern
from zoo.layout.block_layout import specialized, with_heads
from zoo.patterns import moba
from zoo.testing.fake_cuda import fake_cuda

pytestmark = pytest.mark.usefixtures("scalar_cpu_code")  # the graphs a GPU runs (conftest)

VARIANTS = [v for v in FIXED_VARIANTS if v not in GRAPH_VARIANTS] + ["moba"]
EAGER_FLEX = FlexBackend(block_size=16, compile=False)  # flex's eager path, as on fake tensors
BACKENDS = {"sdpa": "sdpa", "reference": "reference", "flex": EAGER_FLEX}
LENGTH = 64  # a 2-D pattern's grid: 8 x 8, decoded whole (max_len = H * W)


def small(variant: str) -> dict[str, object]:
    return cache_params(variant, LENGTH, top_k=2)


def _steps(
    attn, device, *, valid_lens: bool, prefill: int = 12, steps: int = 4, static: bool = False
) -> torch.Tensor:
    """A prefill of ``prefill`` tokens (rows of 12 and 5 with valid_lens), then one-token steps
    (rows adding 1 and 0 tokens in turn with valid_lens); the last step's output."""
    x = torch.randn(2, prefill + steps, attn.dim, device=device)
    with torch.device(device):  # built on the device; the calls run outside the context, as
        cache = attn.new_cache(2, LENGTH, static=static)  # users do (device= left out fails)
    lens = torch.tensor([prefill, 5], device=device) if valid_lens else None
    attn(x[:, :prefill], cache=cache, valid_lens=lens)
    for i in range(prefill, prefill + steps):
        lens = torch.tensor([1, i % 2], device=device) if valid_lens else None
        out = attn(x[:, i : i + 1], cache=cache, valid_lens=lens)
    return out


@pytest.mark.parametrize("static", [False, True], ids=["growing", "static"])
@pytest.mark.parametrize("valid_lens", [False, True], ids=["all", "valid_lens"])
@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("variant", VARIANTS)
def test_a_step_reads_no_device_value(variant, backend, valid_lens, static):
    """Prefill and one-token steps on fake CUDA tensors, 4 query heads on 2 key/value heads;
    a static cache's too (its range check asserted on the device)."""
    skip_without_fake_cuda()
    with fake_cuda(), torch.no_grad():
        with torch.device("cuda"):
            attn = zoo.create_attention(
                variant, dim=32, num_heads=4, num_kv_heads=2, pos="rope", causal=True,
                backend=BACKENDS[backend], **small(variant),
            ).eval()  # fmt: skip
        out = _steps(attn, "cuda", valid_lens=valid_lens, static=static)
    assert out.device.type == "cuda" and out.shape == (2, 1, 32)


@pytest.mark.parametrize("pos", ["sinusoidal", "learned", "alibi", "t5"])
@pytest.mark.parametrize("variant", ["sliding_window", "bigbird", "moba"])
def test_encodings_read_no_device_value(variant, pos):
    """Absolute encodings at each row's own position (rows of different lengths: the table's rows
    at their positions) and score biases at the slots' positions, on fake CUDA tensors."""
    skip_without_fake_cuda()
    with fake_cuda(), torch.no_grad():
        with torch.device("cuda"):
            attn = zoo.create_attention(
                variant, dim=32, num_heads=4, num_kv_heads=2, pos=pos, causal=True,
                **small(variant),
            ).eval()  # fmt: skip
        for valid_lens in (False, True):
            assert _steps(attn, "cuda", valid_lens=valid_lens).shape == (2, 1, 32)


@pytest.mark.parametrize("variant", ["causal", "bigbird", "moba"])
def test_the_functional_step_reads_no_device_value(variant):
    """zoo.attention with a cache (a padding mask of one column, and none)."""
    skip_without_fake_cuda()
    params = small(variant)
    with fake_cuda(), torch.no_grad():
        with torch.device("cuda"):  # built here; the calls run outside it, as users do
            q, k, v = torch.randn(2, 4, 13, 8), torch.randn(2, 2, 13, 8), torch.randn(2, 2, 13, 8)
            cache = zoo.new_cache(variant, batch_size=2, max_len=LENGTH, num_kv_heads=2,
                                  head_dim=8, num_heads=4, device="cuda", **params)  # fmt: skip
        kw = dict(variant=variant, causal=True, cache=cache, pos="alibi", **params)
        zoo.attention(q[:, :, :12], k[:, :, :12], v[:, :, :12], **kw)
        one = slice(12, 13)
        for padding in (None, torch.tensor([[False], [True]], device="cuda")):
            out = zoo.attention(q[:, :, one], k[:, :, one], v[:, :, one],
                                key_padding_mask=padding, **kw)  # fmt: skip
    assert out.shape == (2, 4, 1, 8)


@pytest.mark.parametrize("variant", ["causal", "sliding_window", "longformer", "bigbird", "moba"])
def test_the_hosts_bounds_hold_the_values_they_bound(variant):
    """On the CPU, with rows of different lengths and steps of 0 or 1 token: the host's bound of
    the lengths is at least every row's and exact while the rows are even; the slots in use lie
    within the host's width; no query attends more keys than the host's most."""
    torch.manual_seed(0)
    attn = zoo.create_attention(variant, dim=32, num_heads=4, num_kv_heads=2, pos="rope",
                                causal=True, **small(variant)).double().eval()  # fmt: skip
    x = torch.randn(3, LENGTH, 32, dtype=torch.float64)
    cache = attn.new_cache(3, LENGTH)
    pattern = cache.pattern
    with torch.no_grad():
        attn(x[:, :10], cache=cache)
        for i in range(10, 40):
            lens = None if i < 20 else torch.tensor([1, i % 2, i % 3 == 0])
            attn(x[:, i : i + 1], cache=cache, valid_lens=lens)
            longest, even = cache.host_lengths()
            assert longest >= int(cache.lengths.max())
            assert even == (i < 20), "even until the first valid_lens"
            if even:
                assert (cache.lengths == longest).all()
            width = cache.slots_used(longest)
            assert (cache.slot_pos[:, width:] < 0).all(), "every written slot within the width"
            if not pattern.routed:
                q = cache.lengths - 1
                heads = with_heads(pattern, 4) if pattern.per_head else pattern
                mask = heads.allowed_at(
                    torch.arange(3)[:, None, None], torch.arange(4)[None, :, None],
                    q[:, None, None], cache.slot_pos[:, None, :],
                ) & (cache.slot_pos >= 0)[:, None, :]  # fmt: skip
                assert int(mask.sum(-1).max()) <= cache.query_bounds(4)[0][longest - 1]


def test_lengths_set_from_outside_are_read_again():
    """``cache.lengths`` set from outside (a benchmark filling a cache by ``write``): the host's
    bound is read from the values once, and the steps match a cache filled by calls."""
    attn = zoo.create_attention("bigbird", dim=32, num_heads=4, num_kv_heads=2, causal=True,
                                **small("bigbird")).double().eval()  # fmt: skip
    x = torch.randn(2, 30, 32, dtype=torch.float64)
    with torch.no_grad():
        called = attn.new_cache(2, LENGTH)
        attn(x[:, :20], cache=called)
        filled = attn.new_cache(2, LENGTH)
        filled.keys, filled.values = called.keys.clone(), called.values.clone()
        filled.slot_pos.copy_(called.slot_pos)
        filled.lengths += 20
        assert filled.longest is None and filled.host_lengths() == (20, True)
        for i in range(20, 30):
            want, got = (attn(x[:, i : i + 1], cache=c) for c in (called, filled))
            assert torch.equal(got, want)


def test_a_full_step_runs_without_a_mask(monkeypatch):
    """Causal attention with every row at one length, and a full window, hand SDPA no mask (the
    host knows every slot in use is allowed); rows of different lengths get one; BigBird's keys
    are gathered to the width the host knows (its most allowed keys), not the slots in use."""
    seen = []
    kernel = torch.nn.functional.scaled_dot_product_attention

    def recorded(q, k, v, attn_mask=None, **kwargs):
        seen.append((q.shape[2], k.shape[2], attn_mask is None))
        return kernel(q, k, v, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recorded)
    for variant in ("causal", "sliding_window"):
        attn = zoo.create_attention(variant, dim=32, num_heads=4, num_kv_heads=2, causal=True,
                                    **small(variant)).eval()  # fmt: skip
        x = torch.randn(2, 30, 32)
        with torch.no_grad():
            cache = attn.new_cache(2, LENGTH)
            attn(x[:, :10], cache=cache)
            seen.clear()
            for i in range(10, 20):
                attn(x[:, i : i + 1], cache=cache)
            assert all(no_mask for _, _, no_mask in seen), (variant, seen)
            seen.clear()
            attn(x[:, 20:21], cache=cache, valid_lens=torch.tensor([1, 0]))
            attn(x[:, 21:22], cache=cache)
            assert not any(no_mask for _, _, no_mask in seen), (variant, seen)
    params = dict(block_size=4, random_blocks=1, random_per_head=False)  # one mask, all heads
    attn = zoo.create_attention("bigbird", dim=32, num_heads=4, num_kv_heads=2, causal=True,
                                **params).eval()  # fmt: skip
    cache = attn.new_cache(2, LENGTH)
    with torch.no_grad():
        attn(torch.randn(2, 60, 32), cache=cache)
        seen.clear()
        attn(torch.randn(2, 1, 32), cache=cache)
    pattern = specialized(resolve_pattern("bigbird", True, params), LENGTH, LENGTH,
                          torch.device("cpu"))  # fmt: skip
    most = int(pattern.dense(LENGTH, LENGTH)[:61].sum(-1).max())  # queries up to position 60
    assert seen == [(1, most, False)] and 2 * most < cache.keys.shape[2]


@pytest.mark.parametrize("variant", ["causal", "sliding_window", "full"])
def test_a_step_that_attends_every_slot_makes_no_mask_and_few_operations(monkeypatch, variant):
    """A step whose every query attends every slot in use (rows at one length) never makes the
    step's mask (``DecodeStep.mask``, made on first use) and writes its one token without the
    bookkeeping of a longer call: at most 45 operations dispatched, views included (82 for
    causal, 79 for sliding_window before; each is host work, a launch for most, on a GPU)."""
    from zoo.backends.base import DecodeStep
    from zoo.testing.shape_only_kernels import OperationCount

    def no_mask(step):
        raise AssertionError("the step made its mask")

    attn = zoo.create_attention(variant, dim=64, num_heads=8, num_kv_heads=2, causal=True,
                                backend="sdpa", **small(variant)).eval()  # fmt: skip
    x = torch.randn(2, 30, 64)
    with torch.no_grad():
        cache = attn.new_cache(2, LENGTH)
        attn(x[:, :10], cache=cache)
        monkeypatch.setattr(DecodeStep, "mask", property(no_mask))
        q, k, v = (torch.randn(2, heads, 1, 8) for heads in (8, 2, 2))
        for i in range(3):
            counted = OperationCount()
            with counted:
                zoo.attention(q, k, v, variant=variant, causal=True, cache=cache,
                              backend="sdpa", **small(variant))  # fmt: skip
            assert counted.count <= 45, (i, counted.count)


STEP_VARIANTS = ["causal", "sliding_window", "longformer", "bigbird", "strided", "moba"]
# what a GPU step runs compiled (zoo.core.fused): the mask, sdpa's packing, MoBA's sums and choice
FUSED_ON_A_STEP = (base._step_mask, sdpa._packed, block_sums._sums, moba._choose)


def _generation(model, device: str, x: torch.Tensor, valid_lens: bool, watched) -> torch.Tensor:
    """A prefill, a first step, then steps and a rollback inside ``watched`` (a context: on a
    GPU the sync debug mode); the outputs of all."""
    cache = model.new_cache(2, LENGTH)
    lens = [torch.tensor(n, device=device) for n in ([12, 5], [1, 1], [1, 0], [0, 1])]
    rows = x.to(device)
    got = []
    with torch.no_grad():
        got.append(model(rows[:, :12], cache=cache, valid_lens=lens[0] if valid_lens else None))
        got.append(model(rows[:, 12:13], cache=cache))
        with watched():
            for i in range(13, 24):
                if i == 18:  # a round of speculative decoding: one token taken back
                    cache.rollback(1)
                step = lens[1 + i % 3] if valid_lens else None
                got.append(model(rows[:, i : i + 1], cache=cache, valid_lens=step))
    return torch.cat(got, 1).cpu()


@contextlib.contextmanager
def _graphs_made(made: list[int]):
    """Appends the number of graphs torch.compile made inside the block."""
    from torch._dynamo.utils import counters

    before = counters["stats"]["unique_graphs"]
    try:
        yield
    finally:
        made.append(counters["stats"]["unique_graphs"] - before)


@gpu
@pytest.mark.parametrize("valid_lens", [False, True], ids=["all", "valid_lens"])
@pytest.mark.parametrize("backend", ["sdpa", "reference", "flex"])
@pytest.mark.parametrize("variant", STEP_VARIANTS)
def test_steps_on_a_gpu_do_not_synchronise(variant, backend, valid_lens):
    """One-token steps, and a rollback between them (``KVCache.rollback``), under
    torch.cuda.set_sync_debug_mode("error"): a synchronisation raises. A first generation on
    another cache compiles what the steps run (flex, the graphs of ``zoo.core.fused``: the mask,
    sdpa's packing where it first pays, which strided reaches at its fifth step) and computes
    the host's tables; in the second, watched, nothing compiles (a compile's own synchronisations
    would pass unseen) and no fused graph has failed back to eager (``Fused`` catches what its
    call raises). The steps' outputs match those of a cache on the CPU."""
    torch.manual_seed(0)
    choice = FlexBackend(block_size=16) if backend == "flex" else backend
    attn = zoo.create_attention(variant, dim=64, num_heads=4, num_kv_heads=2, pos="rope",
                                causal=True, backend=choice, **small(variant)).eval()  # fmt: skip
    x = torch.randn(2, 24, 64)
    cpu = _generation(attn, "cpu", x, valid_lens, contextlib.nullcontext)
    model = attn.to("cuda")
    _generation(model, "cuda", x, valid_lens, contextlib.nullcontext)  # compiles, tables
    made: list[int] = []

    @contextlib.contextmanager
    def watched():
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            with _graphs_made(made):
                yield
        finally:
            torch.cuda.set_sync_debug_mode("default")

    cuda = _generation(model, "cuda", x, valid_lens, watched)
    assert torch.allclose(cuda, cpu, atol=1e-4, rtol=1e-4)
    failed = {f.__qualname__: f.failed for f in FUSED_ON_A_STEP if f.failed is not None}
    assert not failed, failed
    assert made == [0], f"{made[0]} graphs compiled inside the watched steps"


@pytest.mark.parametrize("variant", ["strided", "bigbird", "moba"])
def test_a_second_generation_compiles_nothing_with_the_steps_fused_as_on_a_gpu(
    variant, monkeypatch
):
    """The GPU test above on a CPU, with ``zoo.core.fused``'s graphs compiled as on a GPU: after
    one generation, a second of the same steps makes no graph, and its outputs are the first's.
    The count can tell: strided's first generation makes a graph in the watched steps (it packs
    its keys from its fifth step); bigbird's and moba's make theirs before."""
    from zoo.core import fused

    torch._dynamo.reset()
    for function in FUSED_ON_A_STEP:
        function.__dict__.pop("compiled", None)
        monkeypatch.setattr(function, "failures", {})
    monkeypatch.setattr(fused, "fuses", fused.compiles_here)
    torch.manual_seed(0)
    attn = zoo.create_attention(variant, dim=64, num_heads=4, num_kv_heads=2, pos="rope",
                                causal=True, backend="sdpa", **small(variant)).eval()  # fmt: skip
    x = torch.randn(2, 24, 64)
    made: list[int] = []
    first = _generation(attn, "cpu", x, True, lambda: _graphs_made(made))
    second = _generation(attn, "cpu", x, True, lambda: _graphs_made(made))
    assert torch.allclose(first, second, atol=1e-5)
    assert all(f.failed is None for f in FUSED_ON_A_STEP)
    assert made[1] == 0, f"{made[1]} graphs compiled in the second generation"
    assert made[0] >= (1 if variant == "strided" else 0), made
    torch._dynamo.reset()
