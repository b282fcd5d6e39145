"""What a one-token step launches around its attention kernel (``zoo.decoding.decode``): the
cache's constants (token offsets, whole-call counts, all-true masks, row indices) made once, a
prefix's slot taken as the position itself, the slots in use made only where a backend reads
them, and a module step without padding columns masks nothing. On a GPU each operation of a step
is a kernel launch, and the eager steps of the H200 run were host-bound (0.4-1.5 ms against
0.06-0.34 ms for SDPA over the whole cache)."""

from __future__ import annotations

import pytest
import torch
from helpers import FIXED_VARIANTS, GRAPH_VARIANTS, cache_params
from torch.utils._python_dispatch import TorchDispatchMode

import zoo
from zoo.functional import resolve_pattern
from zoo.layout.block_layout import specialized
from zoo.patterns.retention import retention

VIEWS = {
    "aten.view.default", "aten.unsqueeze.default", "aten.expand.default", "aten.transpose.int",
    "aten.slice.Tensor", "aten.select.int", "aten.alias.default", "aten._unsafe_view.default",
    "aten.squeeze.dim", "aten.permute.default", "aten.as_strided.default", "aten.detach.default",
}  # fmt: skip


class Launches(TorchDispatchMode):
    """The operations that are not views, outside the attention kernel's own call."""

    def __init__(self, kernel: str) -> None:
        super().__init__()
        self.kernel, self.names = kernel, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func) not in VIEWS and not self.inside_kernel:
            self.names.append(str(func))
        return func(*args, **(kwargs or {}))

    @property
    def inside_kernel(self) -> bool:
        import traceback

        return any(self.kernel in (frame.line or "") for frame in traceback.extract_stack())


@pytest.mark.parametrize(
    "variant", ["causal", "full", "sliding_window", "longformer", "block_local"]
)
def test_a_steps_bookkeeping_launches_few_operations(variant):
    """Rows of one length: the step's positions, its key and value copied into the slot the
    host finds, the slot's position set, the lengths' advance; 5, for a ring or pinned slots
    alike. Before: 12 for causal (counts, offsets twice, valid, the slot's clamp, row indices,
    slots in use), 12 for sliding_window and 15 for longformer; then 5, 6 and 9 with the slot
    computed on the device and written through index tensors. A block-local query attends its
    block so far, the ring's first slots: read without a mask (21 operations with the mask)."""
    params = {
        "sliding_window": {"window_size": 16}, "longformer": {"window_size": 16},
        "block_local": {"block_size": 16},
    }  # fmt: skip
    kwargs = dict(variant=variant, causal=True, **params.get(variant, {}))
    cache = zoo.new_cache(variant, batch_size=4, max_len=256, num_kv_heads=2, head_dim=16,
                          num_heads=4, **params.get(variant, {}))  # fmt: skip
    with torch.no_grad():
        q, k = torch.randn(4, 4, 100, 16), torch.randn(4, 2, 100, 16)
        zoo.attention(q, k, k, cache=cache, backend="sdpa", **kwargs)
        for _ in range(3):
            q, k = torch.randn(4, 4, 1, 16), torch.randn(4, 2, 1, 16)
            launches = Launches("scaled_dot_product_attention(")
            with launches:
                zoo.attention(q, k, k, cache=cache, backend="sdpa", **kwargs)
    assert len(launches.names) <= 5, launches.names
    for name in ("aten.full.default", "aten.arange.default", "aten.ones.default"):
        assert name not in launches.names  # the cache's constants, made once
    assert "aten.index_put_.default" not in launches.names  # the slot found on the host


@pytest.mark.parametrize(
    "variant", [v for v in FIXED_VARIANTS if v not in GRAPH_VARIANTS] + ["moba"]
)
def test_a_step_written_at_a_slot_the_host_finds_equals_the_indexed_write(variant, monkeypatch):
    """Rows of one length write a step's token at the slot the host computes from the pins it
    holds (``KVCache.host_slot``), by slice copies; the same steps written through index
    tensors (the path of rows of different lengths) leave the same cache bit for bit (keys,
    values, slots' positions, lengths, MoBA's block sums) and give the same outputs, past the
    ring's wrap and up to max_len; with spare ring slots, a rollback by an int (the host's
    bound kept) and a clone in the middle."""
    from zoo.decoding.cache import KVCache

    write = KVCache.write
    host = {"on": True}

    def either(self, k, v, positions, valid, every_kept=False, position=None):
        return write(self, k, v, positions, valid, every_kept, position if host["on"] else None)

    monkeypatch.setattr(KVCache, "write", either)
    max_len = 64
    params = cache_params(variant, max_len)
    kw = dict(variant=variant, causal=True, backend="sdpa", **params)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, max_len, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 2, max_len, 8, generator=g, dtype=torch.float64) for _ in range(2))
    caches, outs = [], []
    for on in (True, False):
        host["on"] = on
        cache = zoo.new_cache(variant, batch_size=2, max_len=max_len, num_kv_heads=2,
                              head_dim=8, num_heads=4, dtype=torch.float64, rollback=3,
                              **params)  # fmt: skip
        steps = [zoo.attention(q[:, :, :7], k[:, :, :7], v[:, :, :7], cache=cache, **kw)]
        i, forked = 7, False
        while i < max_len:
            part = slice(i, i + 1)
            steps.append(zoo.attention(q[:, :, part], k[:, :, part], v[:, :, part], cache=cache,
                                       **kw))  # fmt: skip
            i += 1
            if i == 30 and not forked:  # 2 of the tokens from 28 rejected (the host keeps its
                # bound: the steps after it take the host's slot too), then a fork
                cache.rollback(2)
                i, steps, forked = 28, steps[:-2], True
                cache = cache.clone()
        caches.append(cache)
        outs.append(torch.cat(steps, 2))
    fast, indexed = caches
    assert torch.equal(outs[0], outs[1])
    for name in ("keys", "values", "slot_pos", "lengths"):
        assert torch.equal(getattr(fast, name), getattr(indexed, name)), name
    for size, sums in fast._block_sums.items():
        assert torch.equal(sums.sums, indexed._block_sums[size].sums)
        assert torch.equal(sums.counts, indexed._block_sums[size].counts)
    assert fast._block_sums or variant != "moba"
    want = zoo.attention(q, k, v, variant=variant, causal=True, **params)
    assert torch.allclose(outs[0], want, atol=1e-10, rtol=0)


@pytest.mark.parametrize("variant", [v for v in FIXED_VARIANTS if v not in GRAPH_VARIANTS])
def test_latest_runs_claim_only_queries_that_attend_exactly_their_latest_keys(variant):
    """``latest_runs`` against the dense mask: True only where a query's allowed keys are
    exactly its latest ones (sound for every variant), and exact for block_local and the
    windows, whose queries all attend such runs."""
    from zoo.decoding.bounds import latest_runs, query_bounds

    length = 64
    params = cache_params(variant, length)
    pattern = specialized(resolve_pattern(variant, True, params), length, length, "cpu")
    if pattern.per_head:
        pytest.skip("a pattern drawn per head has no runs of one layout")
    runs = latest_runs(pattern, length)
    dense = zoo.dense_mask(variant, length, causal=True, **params)
    count = query_bounds(pattern, length)[1]
    keys = torch.arange(length)
    for p in range(length):
        latest = (keys > p - count[p]) & (keys <= p)
        truth = bool(count[p] > 0) and torch.equal(dense[p], latest)
        assert not runs[p] or truth, (variant, p)
        if variant in ("block_local", "sliding_window", "local", "causal"):
            assert runs[p] == truth, (variant, p)


@pytest.mark.parametrize("rollback", [0, 3])
def test_a_block_local_step_reads_its_blocks_first_slots_without_a_mask(rollback, monkeypatch):
    """Rows of one length: a block-local query attends its block so far, held in the ring's
    first slots, and sdpa reads those alone, unmasked, at every step across several blocks; with
    spare ring slots (``rollback=3``) the block no longer starts at slot 0 and the step takes
    the mask. Both equal one causal forward."""
    from zoo.backends import base, sdpa

    widths, masks = [], []
    used_prefix, mask_within = sdpa.used_prefix, base.DecodeStep.mask_within

    def read(width, *rest):
        widths.append(width)
        return used_prefix(width, *rest)

    def masked(step, width):
        masks.append(width)
        return mask_within(step, width)

    kw = dict(variant="block_local", causal=True, block_size=8, backend="sdpa")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 40, 8, generator=g, dtype=torch.float64) for _ in range(3))
    cache = zoo.new_cache("block_local", batch_size=2, max_len=40, num_kv_heads=2, head_dim=8,
                          dtype=torch.float64, block_size=8, rollback=rollback)  # fmt: skip
    outs = [zoo.attention(q[:, :, :5], k[:, :, :5], v[:, :, :5], cache=cache, **kw)]
    monkeypatch.setattr(sdpa, "used_prefix", read)
    monkeypatch.setattr(base.DecodeStep, "mask_within", masked)
    for i in range(5, 40):
        part = slice(i, i + 1)
        outs.append(zoo.attention(q[:, :, part], k[:, :, part], v[:, :, part], cache=cache, **kw))
    want = zoo.attention(q, k, v, variant="block_local", causal=True, block_size=8)
    assert torch.allclose(torch.cat(outs, 2), want, atol=1e-10, rtol=0)
    if rollback:
        assert masks, "a block that does not start at slot 0 is read with the mask"
    else:
        assert widths == [i % 8 + 1 for i in range(5, 40)] and not masks, (widths, masks)


def test_the_slot_the_host_finds_is_the_plans_slot():
    """``KVCache.host_slot`` against ``Retention.slot`` at every position, for plans with pins
    and no ring, a ring and no pins, pins that are not a prefix beside a ring, a prefix beside
    one ring slot."""
    from zoo.patterns.retention import Retention

    plans = [
        Retention(32, 0, 0, torch.arange(32), prefix=True),
        Retention(32, 0, 1, torch.arange(31), prefix=True),
        Retention(32, 5, 6, torch.tensor([], dtype=torch.long)),
        Retention(32, 5, 6, torch.tensor([0, 3, 17])),
        Retention(32, 0, 0, torch.tensor([1, 4, 9])),
    ]
    for plan in plans:
        cache = _bare_cache(plan)
        want = plan.slot(torch.arange(32)).tolist()
        assert [cache.host_slot(p) for p in range(32)] == want, plan


def _bare_cache(plan):
    from zoo.decoding.cache import KVCache

    signature = {"variant": "x", "params": {}, "num_kv_heads": 1}
    return KVCache(pattern=None, plan=plan, signature=signature, batch_size=1, num_kv_heads=1,
                   head_dim=4, value_dim=4, max_len=plan.max_len, dtype=torch.float32,
                   device=torch.device("cpu"))  # fmt: skip


def test_an_eager_steps_mask_asks_the_pattern_about_the_slots_in_use_only(monkeypatch):
    """MoBA's cache keeps every position (max_len slots): an eager step on sdpa asks the pattern
    about the slots the host knows in use, not about the whole store (on a CPU that was most of
    the step's time); where the mask is one compiled graph (a GPU: ``fused`` says so, stood in
    for here, the graph run eagerly), it is asked about the whole store (one shape per cache)
    and cut to the same slots. Both give the reference."""
    import types

    from zoo.backends import base

    seen = []
    step_mask = base._step_mask.fn  # eager: what the graph computes, without compiling it

    def spy(q_pos, key_pos, *rest):
        seen.append(key_pos.shape[1])
        return step_mask(q_pos, key_pos, *rest)

    monkeypatch.setattr(base, "_step_mask", spy)
    kw = dict(variant="moba", causal=True, block_size=16, top_k=2, backend="sdpa")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 2, 40, 8, generator=g)
    want = zoo.attention(x, x, x, variant="moba", causal=True, block_size=16, top_k=2)
    for compiled in (False, True):
        seen.clear()
        with monkeypatch.context() as m:
            m.setattr(base, "fused_graphs", types.SimpleNamespace(fuses=lambda t, c=compiled: c))
            cache = zoo.new_cache("moba", batch_size=1, max_len=256, num_kv_heads=2,
                                  head_dim=8, num_heads=2, block_size=16, top_k=2)  # fmt: skip
            outs = [zoo.attention(x[:, :, :30], x[:, :, :30], x[:, :, :30], cache=cache, **kw)]
            for i in range(30, 40):
                step = x[:, :, i : i + 1]
                outs.append(zoo.attention(step, step, step, cache=cache, **kw))
        assert torch.allclose(torch.cat(outs, 2), want, atol=1e-5)
        assert seen[-10:] == ([256] * 10 if compiled else list(range(31, 41))), seen


def test_a_module_step_without_valid_lens_masks_no_padding_column():
    attn = zoo.create_attention("causal", dim=32, num_heads=4, num_kv_heads=2, causal=True).eval()
    cache = attn.new_cache(2, 64)
    x = torch.randn(2, 9, 32)
    with torch.no_grad():
        attn(x[:, :8], cache=cache)
        launches = Launches("scaled_dot_product_attention(")
        with launches:
            attn(x[:, 8:], cache=cache)
    assert "aten.masked_fill.Scalar" not in launches.names, launches.names


def test_constants_made_in_inference_mode_serve_a_later_step_that_records_gradients():
    """A cache used under torch.inference_mode, then by a step whose keys record gradients:
    an inference tensor saved for backward would raise there."""
    cache = zoo.new_cache("causal", batch_size=2, max_len=32, num_kv_heads=2, head_dim=8)
    with torch.inference_mode():
        q = torch.randn(2, 2, 4, 8)
        zoo.attention(q, q, q, variant="causal", causal=True, cache=cache, backend="reference")
    cache.reset()
    q = torch.randn(2, 2, 3, 8, requires_grad=True)
    out = zoo.attention(q, q, q, variant="causal", causal=True, cache=cache, backend="reference")
    out.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()
    twin = zoo.attention(q.detach(), q.detach(), q.detach(), variant="causal", causal=True)
    assert torch.allclose(out, twin, atol=1e-6)


@pytest.mark.parametrize("variant", [v for v in FIXED_VARIANTS if v not in GRAPH_VARIANTS])
@pytest.mark.parametrize("max_len", [48, 64])
def test_a_retention_kept_at_its_position_puts_each_kept_position_there(variant, max_len):
    """``Retention.kept_at_position``, which lets a step write a token at slot = position
    without computing the slot, holds exactly where ``slot`` maps every position it keeps
    (``keeps_below``) to itself."""
    params = cache_params(variant, max_len)
    pattern = specialized(resolve_pattern(variant, True, params), max_len, max_len, "cpu")
    plan = retention(pattern, max_len)
    positions = torch.arange(max_len)
    kept = torch.tensor([plan.keeps_below(p + 1) for p in range(max_len)])
    identity = bool((plan.slot(positions)[kept] == positions[kept]).all()) and bool(kept.any())
    if plan.kept_at_position:
        assert identity, (variant, plan)
    for ring in (1, 2):  # a ring beside the prefix: slots shared, never the position itself
        wider = plan.__class__(max_len, 0, ring, torch.arange(max_len // 2), prefix=True)
        assert not wider.kept_at_position


@pytest.mark.parametrize("variant", ["neighborhood_2d", "axial_2d", "block_local_2d"])
def test_a_cache_of_a_2d_pattern_needs_its_grid(variant):
    """Without ``grid`` the cache took the grid of max_len (8 x 8 at 64) while a call over 35
    tokens takes 5 x 7: prefill and steps then disagreed with one causal forward by up to 3.07.
    Refused by name; with a grid, decoding is that grid's."""
    with pytest.raises(ValueError, match="needs its grid: pass grid=\\(H, W\\)"):
        zoo.new_cache(variant, batch_size=1, max_len=64, num_kv_heads=1, head_dim=8)
    attn = zoo.create_attention(variant, dim=16, num_heads=2, causal=True)
    with pytest.raises(ValueError, match="needs its grid"):
        attn.new_cache(1, 64)
    params = cache_params(variant, 64)
    assert zoo.new_cache(variant, batch_size=1, max_len=64, num_kv_heads=1, head_dim=8, **params)


def test_a_constant_made_under_a_fake_mode_is_not_kept():
    """A real cache touched while a fake tensor mode is active (``zoo.testing.fake_cuda``
    installs one that takes real inputs) kept a fake constant: every later real step wrote
    nothing (slot positions stayed -1 while the lengths advanced)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    cache = zoo.new_cache("causal", batch_size=2, max_len=16, num_kv_heads=1, head_dim=8)
    with FakeTensorMode(allow_non_fake_inputs=True):
        cache.steps(1)
        cache.whole_counts(1)
    q, k = torch.randn(2, 2, 1, 8), torch.randn(2, 1, 1, 8)
    out = zoo.attention(q, k, k, variant="causal", causal=True, cache=cache)
    assert torch.equal(cache.slot_pos[:, 0], torch.zeros(2, dtype=torch.long))
    assert torch.equal(cache.lengths, torch.ones(2, dtype=torch.long))
    assert torch.allclose(out, zoo.attention(q, k, k, variant="causal", causal=True), atol=1e-6)


def test_moba_block_sums_made_in_inference_mode_serve_a_step_that_records_gradients():
    """MoBA's running block sums, first made under torch.inference_mode, were inference tensors:
    the next step recording gradients failed ("Inplace update to inference tensor")."""
    kwargs = dict(variant="moba", causal=True, block_size=16, top_k=2, backend="sdpa")
    cache = zoo.new_cache("moba", batch_size=1, max_len=64, num_kv_heads=1, head_dim=8,
                          num_heads=1, block_size=16, top_k=2)  # fmt: skip
    with torch.inference_mode():
        x = torch.randn(1, 1, 20, 8)
        zoo.attention(x, x, x, cache=cache, **kwargs)
    q, k, v = (torch.randn(1, 1, 1, 8, requires_grad=True) for _ in range(3))
    zoo.attention(q, k, v, cache=cache, **kwargs).sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()
