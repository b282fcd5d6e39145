"""Setting a cache's lengths back (a rollback, as speculative decoding makes when it rejects
drafted tokens): the row forgets its later tokens, so the next calls give the output of one causal
forward over what the row kept plus its new tokens; a ring that has overwritten what a query reads
refuses, unless built with ``rollback=`` spare slots (zoo.decoding.cache, zoo.patterns.retention).

Compared in float64, where the decoding path and the full forward agree to rounding."""

from __future__ import annotations

import pytest
import torch
from helpers import FIXED_VARIANTS, cache_params

import zoo
from zoo.decoding.block_sums import block_sums
from zoo.testing.fake_cuda import FakeCudaUnavailable, fake_cuda

VARIANTS = [v for v in [*FIXED_VARIANTS, "moba"] if "grid" not in zoo.get_spec(v).parameters()]
WINDOWED = ["local", "sliding_window", "dilated", "block_local", "longformer"]


def module(variant):
    torch.manual_seed(0)
    attn = zoo.create_attention(variant, dim=16, num_heads=2, num_kv_heads=1, causal=True,
                                **cache_params(variant, 64))  # fmt: skip
    return attn.double().eval()


def filled(attn, x, rollback=0):
    """A cache holding x (B, 40, dim): a prefill of 30, then ten steps of one token."""
    cache = attn.new_cache(x.shape[0], 64, rollback=rollback)
    attn(x[:, :30], cache=cache)
    for i in range(30, 40):
        attn(x[:, i : i + 1], cache=cache)
    return cache


def snapshot(cache):
    return [t.clone() for t in (cache.keys, cache.values, cache.slot_pos, cache.lengths)]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("back, spare", [((1, 1), 0), ((5, 2), 4)])
def test_steps_after_a_rollback_equal_the_forward_over_what_was_kept(variant, back, spare):
    """Rows set back by different counts, then a call of 3 tokens (which reads the slots and its
    own keys: before, a forgotten key there was read twice) and single steps."""
    attn = module(variant)
    x = torch.randn(2, 40, 16, dtype=torch.float64)
    y = torch.randn(2, 9, 16, dtype=torch.float64)
    with torch.no_grad():
        cache = filled(attn, x, rollback=spare)
        cache.lengths = cache.lengths - torch.tensor(back)
        assert cache.host_lengths() == (40 - min(back), back[0] == back[1])
        got = torch.cat([attn(y[:, :3], cache=cache)]
                        + [attn(y[:, j : j + 1], cache=cache) for j in range(3, 9)], 1)  # fmt: skip
        for row, b in enumerate(back):
            kept = 40 - b
            want = attn(torch.cat([x[row : row + 1, :kept], y[row : row + 1]], 1))[:, kept:]
            assert torch.allclose(got[row : row + 1], want, atol=1e-10, rtol=0), (variant, row)
    assert cache.lengths.tolist() == [40 - b + 9 for b in back]


@pytest.mark.parametrize("variant", WINDOWED)
def test_a_ring_refuses_to_go_back_past_what_it_holds(variant):
    """A window's ring of window + 1 slots rolls back one token; five need ``rollback=4``. The
    refusal names the way out and changes nothing."""
    attn = module(variant)
    x = torch.randn(2, 40, 16, dtype=torch.float64)
    with torch.no_grad():
        cache = filled(attn, x)
        assert cache.plan.ring == cache.plan.window + 1
        before = snapshot(cache)
        with pytest.raises(ValueError, match=r"set back further.*rollback=N.*row 0 holds 40.*35"):
            cache.lengths = cache.lengths - 5
        assert all(torch.equal(a, b) for a, b in zip(before, snapshot(cache), strict=True))
        roomy = filled(attn, x, rollback=4)
        assert roomy.plan.ring == cache.plan.ring + 4
        roomy.lengths = roomy.lengths - 5


@pytest.mark.parametrize("variant", ["causal", "full", "moba", "strided", "bigbird"])
def test_a_cache_that_keeps_what_it_reads_rolls_back_any_number(variant):
    attn = module(variant)
    x = torch.randn(2, 40, 16, dtype=torch.float64)
    y = torch.randn(2, 4, 16, dtype=torch.float64)
    with torch.no_grad():
        cache = filled(attn, x)
        cache.lengths = torch.tensor([3, 0])
        assert (cache.slot_pos < 3).all() and (cache.slot_pos[1] < 0).all()
        got = torch.cat([attn(y[:, j : j + 1], cache=cache) for j in range(4)], 1)
        want = attn(torch.cat([x[:1, :3], y[:1]], 1))[:, 3:]
        assert torch.allclose(got[:1], want, atol=1e-10, rtol=0)
        assert torch.allclose(got[1:], attn(y[1:]), atol=1e-10, rtol=0)


def test_lengths_are_the_caches_own():
    """``cache.lengths`` is a copy and setting it copies in: what a caller keeps does not move
    with the cache's steps, one tensor set on two caches leaves them apart, an expanded tensor is
    taken, and a refused ``-=`` changes nothing (before, the cache kept the caller's tensor and
    advanced it in place, and ``-=`` had changed the lengths before the check refused)."""
    attn = module("sliding_window")
    x = torch.randn(2, 40, 16, dtype=torch.float64)
    with torch.no_grad():
        first, second = filled(attn, x), filled(attn, x)
        saved = first.lengths
        new = saved - 1
        first.lengths, second.lengths = new, new
        attn(x[:, 39:40], cache=first)
        assert saved.tolist() == [40, 40] and new.tolist() == [39, 39]
        assert first.lengths.tolist() == [40, 40] and second.lengths.tolist() == [39, 39]
        third = filled(attn, x)
        third.lengths = torch.tensor(39).expand(2)
        attn(x[:, 39:40], cache=third)
        assert third.lengths.tolist() == [40, 40]
        before, bound = snapshot(first), first.host_lengths()
        with pytest.raises(ValueError, match="set back further"):
            first.lengths -= 5
        assert all(torch.equal(a, b) for a, b in zip(before, snapshot(first), strict=True))
        assert first.host_lengths() == bound


def test_in_place_arithmetic_is_a_rollback_too():
    """``cache.lengths -= n`` refuses and forgets as an assignment does."""
    attn = module("sliding_window")
    x = torch.randn(2, 40, 16, dtype=torch.float64)
    with torch.no_grad():
        cache = filled(attn, x)
        with pytest.raises(ValueError, match="set back further"):
            cache.lengths -= 5
        cache = filled(attn, x)
        cache.lengths -= 1
        assert cache.lengths.tolist() == [39, 39] and int(cache.slot_pos.max()) == 38


def test_moba_block_sums_forget_the_rolled_back_keys():
    """MoBA scores blocks from sums the cache keeps: after a rollback and new steps they equal
    the sums of the kept keys computed afresh (before, forgotten keys stayed in them; the float32
    sums differ by rounding only: 5e-7 before any rollback)."""
    attn = module("moba")
    x = torch.randn(2, 40, 16, dtype=torch.float64)
    with torch.no_grad():
        cache = filled(attn, x)
        assert cache._block_sums, "the steps made block sums"
        cache.lengths = torch.tensor([33, 21])
        for j in range(4):
            attn(x[:, j : j + 1], cache=cache)
        for block, sums in cache._block_sums.items():
            want, counts = block_sums(cache.keys, cache.slot_pos >= 0, block)
            assert torch.equal(sums.counts, counts)  # float32 sums: added up, or at once
            assert torch.allclose(sums.sums, want, rtol=0, atol=1e-5)


def test_a_rollback_by_an_int_takes_out_those_keys_alone(monkeypatch):
    """``rollback(n)`` with an int: the block sums lose the last n keys of each row (rows of 41
    and 26 tokens, n = 7 and 20: across blocks of 8), not a pass over every key
    (``block_sums``, which reads the whole cache: a speculative round's rollback would read as
    much as a dense step); they equal the kept keys' sums computed afresh."""
    import zoo.decoding.block_sums as sums_module

    attn = module("moba")
    x = torch.randn(2, 40, 16, dtype=torch.float64)
    passes = []
    for n in (7, 20):
        with torch.no_grad():
            cache = filled(attn, x)
            cache.lengths = torch.tensor([40, 25])
            attn(x[:, :1], cache=cache)  # a step: the sums kept from here
            monkeypatch.setattr(sums_module, "block_sums", lambda *a: passes.append(a))
            cache.rollback(n)
            monkeypatch.undo()
            assert passes == [] and cache.lengths.tolist() == [41 - n, 26 - n]
            for block, sums in cache._block_sums.items():
                want, counts = block_sums(cache.keys, cache.slot_pos >= 0, block)
                assert torch.equal(sums.counts, counts), n
                assert torch.allclose(sums.sums, want, rtol=0, atol=1e-5), n


@pytest.mark.parametrize("variant", ["causal", "sliding_window", "moba"])
def test_a_static_cache_rolls_back_without_a_recompile(variant):
    """A static cache copies new lengths into its own tensor (a CUDA graph recorded its
    address), so its compiled step (fullgraph, static shapes) runs on after a rollback without
    compiling again, equal to eager steps on a growing cache rolled back the same."""
    torch._dynamo.reset()
    attn = module(variant)
    x = torch.randn(2, 40, 16, dtype=torch.float64)
    compiled = torch.compile(attn, backend="eager", fullgraph=True, dynamic=False)
    with torch.no_grad(), torch._dynamo.config.patch(error_on_recompile=True):
        mine, theirs = attn.new_cache(2, 64, static=True), attn.new_cache(2, 64)
        attn(x[:, :20], cache=mine), attn(x[:, :20], cache=theirs)
        address = mine._lengths.data_ptr()
        for i in range(20, 40):
            if i in (26, 33):  # rows set back by one token each, then on
                mine.lengths -= torch.tensor([1, 0])
                theirs.lengths -= torch.tensor([1, 0])
            got = compiled(x[:, i : i + 1], cache=mine)
            assert torch.allclose(got, attn(x[:, i : i + 1], cache=theirs), atol=1e-10), i
    assert mine._lengths.data_ptr() == address and mine.lengths.tolist() == [38, 40]
    torch._dynamo.reset()


@pytest.mark.parametrize(
    "value, expected",
    [
        (torch.tensor([-1, 3]), r"\[0, max_len=64\]; row 0 holds 40 tokens, set to -1"),
        (torch.tensor([3, 65]), r"\[0, max_len=64\]; row 1 holds 40 tokens, set to 65"),
        (torch.tensor([3.0, 4.0]), r"a \(2,\) int tensor on cpu, got \(2,\) torch.float32"),
        (torch.tensor([3]), r"a \(2,\) int tensor on cpu, got \(1,\)"),
        ([3, 4], r"a \(2,\) int tensor on cpu, got \[3, 4\]"),
    ],
)
def test_bad_lengths_are_refused_by_name(value, expected):
    attn = module("causal")
    with torch.no_grad():
        cache = filled(attn, torch.randn(2, 40, 16, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"cache\.lengths must .*" + expected):
        cache.lengths = value


def test_a_rollback_on_fake_cuda_reads_no_value():
    """On a device the checks are assertions there (no synchronisation); fake tensors, which
    hold no values, pass through (torch.export of a generation loop)."""
    try:
        with fake_cuda(), torch.no_grad():
            with torch.device("cuda"):
                attn = zoo.create_attention("sliding_window", dim=16, num_heads=2, num_kv_heads=1,
                                            causal=True, window_size=4).eval()  # fmt: skip
                cache = attn.new_cache(2, 64)
                x, y = torch.randn(2, 30, 16), torch.randn(2, 1, 16)
            # run outside torch.device("cuda"), as users do, so that a CPU tensor shows
            attn(x, cache=cache)
            cache.lengths = cache.lengths - 1
            attn(y, cache=cache)
    except FakeCudaUnavailable as error:
        pytest.skip(str(error))
    assert cache.lengths.device.type == "cuda" and cache.longest is not None


@pytest.mark.parametrize("variant", ["causal", "sliding_window", "moba"])
def test_rollback_keeps_the_hosts_bound(variant):
    """``cache.rollback(n)`` sets rows back as ``lengths -= n`` does and keeps the host's bound
    of the lengths (an assignment leaves it to be read again: a synchronisation on a GPU);
    per-row counts leave an upper bound, no longer exact. The steps after it are the same."""
    attn = module(variant)
    x = torch.randn(2, 40, 16, dtype=torch.float64)
    y = torch.randn(2, 3, 16, dtype=torch.float64)
    with torch.no_grad():
        kept, assigned = filled(attn, x), filled(attn, x)
        kept.rollback(1)
        assigned.lengths -= 1
        assert (kept.longest, kept.even) == (39, True) and assigned.longest is None
        for j in range(3):
            got, want = (attn(y[:, j : j + 1], cache=c) for c in (kept, assigned))
            assert torch.equal(got, want)
        kept.rollback(torch.tensor([1, 0]))
        assert (kept.longest, kept.even) == (42, False) and kept.lengths.tolist() == [41, 42]
        with pytest.raises(ValueError, match="rollback: n must hold counts >= 0"):
            kept.rollback(torch.tensor([-1, 0]))
