"""The exchange plan's wide query rows (``zoo.parallel.exchange_plan``), from the plan alone (no
processes): Longformer's global token is computed where the keys are, so the bytes every rank
receives are the same at two sequence lengths, and equal a count made from the dense mask."""

from __future__ import annotations

import math

import torch

from zoo.backends.lse_merge import partial
from zoo.functional import resolve_pattern
from zoo.layout.block_layout import specialized
from zoo.parallel import ShardLayout, exchange_plan
from zoo.parallel.at_positions import AtPositions
from zoo.parallel.sharded import received_bytes, ship_ratio
from zoo.parallel.wide import own_keys_partial
from zoo.positional.t5 import T5RelativeBias

WORLD, BLOCK, HEADS, HEAD_DIM = 4, 32, 4, 32
PARAMS = dict(window_size=64, global_tokens=1)


def _shards(length: int) -> tuple[torch.Tensor, ...]:
    """q, k, v of one rank's shard, float32 (only their shapes and dtype count)."""
    return tuple(torch.empty(1, HEADS, length // WORLD, HEAD_DIM) for _ in range(3))


def _plan_bytes(length: int) -> list[int]:
    pattern = specialized(resolve_pattern("longformer", False, PARAMS), length, length,
                          torch.device("cpu"))  # fmt: skip
    q, k, v = _shards(length)
    layout = ShardLayout(WORLD, length // WORLD, "contiguous")
    plan = exchange_plan(pattern, layout, BLOCK, torch.device("cpu"), ship_ratio(q, k, v))
    return [received_bytes(plan, rank, q, k, v, False) for rank in range(WORLD)]


def _counted_bytes(length: int) -> list[int]:
    """Rank 0 ships its first block (the global token's) to every other rank; every other row
    of every rank reads its keys from the dense mask, fetched by blocks of BLOCK."""
    pattern = specialized(resolve_pattern("longformer", False, PARAMS), length, length,
                          torch.device("cpu"))  # fmt: skip
    dense = pattern.dense(length, length).reshape(length, length)
    shard = length // WORLD
    kv_row, q_row = 2 * HEADS * HEAD_DIM * 4, HEADS * HEAD_DIM * 4
    partial_row = HEADS * (HEAD_DIM + 1) * 4
    counted = []
    for rank in range(WORLD):
        first = rank * shard + (BLOCK if rank == 0 else 0)  # rank 0's first block is shipped
        reads = dense[first : (rank + 1) * shard].any(dim=0)
        fetched = sum(
            BLOCK
            for lo in range(0, length, BLOCK)
            if lo // shard != rank and bool(reads[lo : lo + BLOCK].any())
        )
        shipped = BLOCK * q_row if rank else 0
        partials = BLOCK * (WORLD - 1) * partial_row if rank == 0 else 0
        counted.append(fetched * kv_row + shipped + partials)
    return counted


def test_longformer_bytes_per_rank_are_constant_in_the_length_and_counted():
    short, long = _plan_bytes(1024), _plan_bytes(2048)
    assert short == long
    assert short == _counted_bytes(1024)
    assert long == _counted_bytes(2048)


def test_a_wide_partial_gives_a_learned_bias_its_gradient():
    """A shipped global row's partial against another rank's keys, with a T5 bias: out, lse and
    the gradients of q, k, v and of the bias table equal the dense masked softmax's (float64).
    The CPU kernel's backward gives its additive mask no gradient, which dropped the table's
    share from every wide row."""
    length, heads, dim = 32, 2, 8
    pattern = specialized(resolve_pattern("longformer", False, dict(window_size=4,
                          global_tokens=1)), length, length, torch.device("cpu"))  # fmt: skip
    q_pos, kv_pos = torch.arange(4), torch.arange(16, 32)  # the global block, the last shard
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, heads, 4, dim, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, heads, 16, dim, generator=g, dtype=torch.float64) for _ in range(2))
    bias = T5RelativeBias(dim=dim, num_heads=heads).double()
    with torch.no_grad():
        bias.weight.normal_(generator=g)
    grads = []
    for partial_of in (_kernel_partial, _dense_partial):
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        bias.zero_grad()
        out, lse = partial_of(*inputs, pattern, q_pos, kv_pos, bias)
        (out.pow(2).sum() + lse.sum()).backward()
        grads.append([out, lse, *(t.grad for t in inputs), bias.weight.grad])
    for got, expected in zip(*grads, strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


def _kernel_partial(q, k, v, pattern, q_pos, kv_pos, bias):
    wrapper = AtPositions(pattern, q_pos, kv_pos)
    return own_keys_partial(q, k, v, None, [wrapper], 0.5, None, bias.bias)


def _dense_partial(q, k, v, pattern, q_pos, kv_pos, bias):
    heads = torch.arange(q.shape[1])[:, None, None]
    scores = (q @ k.mT) * 0.5 + bias.bias(heads, q_pos[:, None], kv_pos[None, :])
    allowed = pattern.allowed(q_pos[:, None], kv_pos[None, :])
    return partial(scores.masked_fill(~allowed, -math.inf), v)
