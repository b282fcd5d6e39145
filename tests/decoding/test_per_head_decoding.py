"""Generation with BigBird's random blocks drawn per query head (``random_per_head``, bigbird's
default): prefill + steps equal the causal forward on every decoding backend, with grouped heads;
the cache keeps the union of what the heads read (zoo.patterns.retention), or every key where
the number of query heads is not known (zoo.decoding.generation.new_cache)."""

import itertools

import pytest
import torch

import zoo
from zoo.backends import FlexBackend
from zoo.functional import resolve_pattern
from zoo.layout.block_layout import specialized, with_heads
from zoo.patterns.retention import last_needed, retention

PARAMS = dict(block_size=4, random_blocks=2)  # 12 blocks at 48 tokens: heads draw differently
CPU = torch.device("cpu")


def module(backend="auto", num_heads=4, kv_heads=2, **extra):
    torch.manual_seed(0)
    attn = zoo.create_attention(
        "bigbird", dim=32, num_heads=num_heads, num_kv_heads=kv_heads, causal=True, pos="rope",
        backend=backend, **PARAMS, **extra,
    )  # fmt: skip
    return attn.double().eval()


def decode(attn, x, cuts, max_len=48):
    cache = attn.new_cache(x.shape[0], max_len)
    bounds = [0, *cuts, *range(cuts[-1] + 1, x.shape[1] + 1)]
    outs = [attn(x[:, a:b], cache=cache) for a, b in itertools.pairwise(bounds)]
    return torch.cat(outs, 1), cache


@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("backend", ["sdpa", "reference"])
def test_prefill_and_steps_equal_the_causal_forward(backend, kv_heads):
    attn = module(backend, kv_heads=kv_heads)
    x = torch.randn(2, 45, 32, dtype=torch.float64)
    with torch.no_grad():
        got, cache = decode(attn, x, [9, 13])
        want = attn(x)
        assert (got - want).abs().max().item() <= 1e-10
        # The heads' own tables matter: one table for every head gives another output.
        shared = module(backend, kv_heads=kv_heads, random_per_head=False)(x)
        assert (shared - want).abs().max().item() > 1e-3
    assert cache.pattern.per_head and not cache.pattern.routed


def test_flex_decoding_equals_the_causal_forward():
    """Eager flex on CPU (float32, a block mask per head) against the float64 forward."""
    attn = module("reference")
    x = torch.randn(2, 30, 32, dtype=torch.float64)
    with torch.no_grad():
        want = attn(x)
        attn.backend = FlexBackend(block_size=16, compile=False)
        got, _ = decode(attn.float(), x.float(), [9])
    assert (got.double() - want).abs().max().item() <= 1e-5


def test_the_cache_keeps_the_union_of_what_the_heads_read():
    n, heads = 96, 4
    head0 = specialized(resolve_pattern("bigbird", True, dict(PARAMS)), n, n, CPU)
    drawn = with_heads(head0, heads)
    dense = drawn.dense(n, n)[0]  # (H, n, n)
    rows = torch.arange(n)[:, None].expand(n, n)
    truth = torch.maximum(torch.where(dense.any(0), rows, -1).amax(0), torch.arange(n) - 1)
    assert torch.equal(last_needed(drawn, n), truth)
    per_head = [torch.maximum(torch.where(d, rows, -1).amax(0), torch.arange(n) - 1) for d in dense]
    assert any(not torch.equal(p, truth) for p in per_head), "the union is more than one head"
    cache = zoo.new_cache("bigbird", batch_size=1, max_len=n, num_kv_heads=2, head_dim=8,
                          num_heads=heads, **PARAMS)  # fmt: skip
    union = retention(drawn, n)
    assert torch.equal(cache.plan.pinned, union.pinned) and cache.plan.ring == union.ring
    assert set(range(n)) > set(union.pinned.tolist()), "fewer keys pinned than every key"


def test_without_its_heads_a_cache_keeps_every_key_and_refuses_none():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 30, 8, generator=g, dtype=torch.float64) for _ in range(3))
    k, v = k[:, :2], v[:, :2]
    kw = dict(variant="bigbird", causal=True, **PARAMS)
    for num_heads in (None, 4):
        cache = zoo.new_cache("bigbird", batch_size=2, max_len=32, num_kv_heads=2, head_dim=8,
                              dtype=torch.float64, num_heads=num_heads, **PARAMS)  # fmt: skip
        if num_heads is None:
            assert cache.plan.slots == 32 and cache.plan.ring == 0, "every key kept"
        outs = [zoo.attention(q[:, :, :10], k[:, :, :10], v[:, :, :10], cache=cache, **kw)]
        for i in range(10, 30):
            one = slice(i, i + 1)
            outs.append(zoo.attention(q[:, :, one], k[:, :, one], v[:, :, one], cache=cache, **kw))
        want = zoo.attention(q, k, v, **kw)
        assert (torch.cat(outs, 2) - want).abs().max().item() <= 1e-10, num_heads
    cache = zoo.new_cache("bigbird", batch_size=2, max_len=32, num_kv_heads=2, head_dim=8,
                          dtype=torch.float64, num_heads=4, **PARAMS)  # fmt: skip
    with pytest.raises(ValueError, match="drawn for 4 query heads, the call has 2"):
        zoo.attention(q[:, :2, :1], k[:, :, :1], v[:, :, :1], cache=cache, **kw)
    with pytest.raises(ValueError, match="num_heads=3 must be a multiple of num_kv_heads=2"):
        zoo.new_cache("bigbird", batch_size=1, max_len=8, num_kv_heads=2, head_dim=8, num_heads=3)
