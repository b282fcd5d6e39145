"""Plans of decoding steps (``zoo.core.call_plans.step_signature``): a call with a cache whose
signature ran before on a cache built alike runs that call's plan, without the checks, and
computes exactly what the checked path computes; a cache built for something else, another
batch or a cleared registry takes the checked path again, and the checks that read the cache's
state (its length bound) run at every step."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from helpers import FIXED_VARIANTS, cache_params, skip_without_fake_cuda

import zoo
from zoo.backends import clear_caches
from zoo.core import call_plans

CHECKS = "zoo.functional._check_cached_call"


@pytest.fixture(autouse=True)
def fresh_plans():
    clear_caches()
    yield
    clear_caches()


def _unplanned():
    """Every step takes the checked path (plans of calls without a cache still run)."""
    find = call_plans.find
    return mock.patch.object(
        call_plans, "find", lambda key: None if key[0] == "step" else find(key)
    )


def _generate(variant: str, pos, backend: str, steps: int = 12):
    """A prefill of 20 tokens, then one token at a time, through ``zoo.attention`` with a cache:
    the outputs and the cache."""
    torch.manual_seed(0)
    params = cache_params(variant, 64)
    cache = zoo.new_cache(variant, batch_size=2, max_len=64, num_kv_heads=2, head_dim=8, **params)
    kwargs = dict(variant=variant, causal=True, cache=cache, pos=pos, backend=backend, **params)
    outs = [zoo.attention(*_qkv(20), **kwargs)]
    outs += [zoo.attention(*_qkv(1), **kwargs) for _ in range(steps)]
    return outs, cache


def _qkv(t: int, device=None):
    return (torch.randn(2, 4, t, 8, device=device), torch.randn(2, 2, t, 8, device=device),
            torch.randn(2, 2, t, 8, device=device))  # fmt: skip


@pytest.mark.parametrize("pos", [None, "rope", "alibi"])
@pytest.mark.parametrize("variant", [*FIXED_VARIANTS, "moba"])
def test_planned_steps_compute_what_the_checked_path_computes(variant, pos):
    """Outputs and the cache's contents equal, bit for bit, and the checks ran once for the
    prefill and once for the steps."""
    with mock.patch(CHECKS, wraps=zoo.functional._check_cached_call) as checks:
        planned, cache = _generate(variant, pos, "auto")
    assert checks.call_count == 2  # a signature each: the prefill's (20 tokens), a step's
    with _unplanned():
        checked, twin = _generate(variant, pos, "auto")
    for got, want in zip(planned, checked, strict=True):
        assert torch.equal(got, want)
    for name in ("keys", "values", "slot_pos", "lengths"):
        assert torch.equal(getattr(cache, name), getattr(twin, name)), name


def test_a_plan_serves_every_cache_built_alike_and_no_other():
    """A model's layers share one plan; a cache built for another window, or another batch,
    is refused as before the plan (its signature is in the plan's)."""
    params = {"window_size": 4}

    def cache(batch=2, **built):
        made = zoo.new_cache("sliding_window", batch_size=batch, max_len=32, num_kv_heads=2,
                             head_dim=8, **{**params, **built})  # fmt: skip
        return made

    def step(c):
        return zoo.attention(*_qkv(1), variant="sliding_window", causal=True, cache=c, **params)

    first, second = cache(), cache()
    step(first)
    with mock.patch(CHECKS, side_effect=AssertionError("checked")):
        step(second)  # built alike: the first cache's plan
        step(first)
    with pytest.raises(ValueError, match="window_size"):
        step(cache(window_size=8))
    with pytest.raises(ValueError, match="cache holds 3 sequences"):
        step(cache(batch=3))


def test_a_prefill_keeps_no_plan():
    """A prompt's length seldom comes again: its call is checked and keeps nothing (a plan per
    length would push the forward's plans, which hold block masks, out of the shared LRU)."""
    cache = zoo.new_cache("causal", batch_size=2, max_len=64, num_kv_heads=2, head_dim=8)
    for t in (20, 7):
        zoo.attention(*_qkv(t), variant="causal", causal=True, cache=cache)
    assert not call_plans._PLANS


def test_the_cache_bound_is_checked_at_every_planned_step():
    cache = zoo.new_cache("causal", batch_size=2, max_len=3, num_kv_heads=2, head_dim=8)
    for _ in range(3):
        zoo.attention(*_qkv(1), variant="causal", causal=True, cache=cache)
    assert len(call_plans._PLANS) == 1
    with pytest.raises(ValueError, match="past the cache's max_len=3"):
        zoo.attention(*_qkv(1), variant="causal", causal=True, cache=cache)
    assert cache.lengths.tolist() == [3, 3]  # refused before anything was written


def test_a_clear_drops_the_step_plans():
    cache = zoo.new_cache("causal", batch_size=2, max_len=8, num_kv_heads=2, head_dim=8)
    zoo.attention(*_qkv(1), variant="causal", causal=True, cache=cache)
    clear_caches()
    with mock.patch(CHECKS, wraps=zoo.functional._check_cached_call) as checks:
        zoo.attention(*_qkv(1), variant="causal", causal=True, cache=cache)
    assert checks.call_count == 1


@pytest.mark.parametrize(
    "options",
    [{"key_padding_mask": torch.zeros(2, 1, dtype=torch.bool)}, {"dropout_p": 0.1},
     {"backend": zoo.backends.SdpaBackend()}],
    ids=["padding", "dropout", "backend_instance"],
)  # fmt: skip
def test_a_step_that_is_not_plain_is_checked_every_time(options):
    cache = zoo.new_cache("causal", batch_size=2, max_len=8, num_kv_heads=2, head_dim=8)
    for _ in range(2):
        with mock.patch(CHECKS, wraps=zoo.functional._check_cached_call) as checks:
            zoo.attention(*_qkv(1), variant="causal", causal=True, cache=cache, **options)
        assert checks.call_count == 1
    assert not call_plans._PLANS


def test_a_step_recording_gradients_gets_its_own_plan():
    """The cache's stores record gradients after a step that did (``recording_device``): that
    is part of the signature, so a later step without gradients on q, k and v is checked for
    the backends that can record them, not run on the plan of a step that recorded none."""
    cache = zoo.new_cache("causal", batch_size=2, max_len=8, num_kv_heads=2, head_dim=8)
    zoo.attention(*_qkv(1), variant="causal", causal=True, cache=cache)
    q, k, v = (t.requires_grad_() for t in _qkv(1))
    zoo.attention(q, k, v, variant="causal", causal=True, cache=cache).sum().backward()
    assert cache.keys.requires_grad
    assert len(call_plans._PLANS) == 2
    with mock.patch(CHECKS, wraps=zoo.functional._check_cached_call) as checks:
        zoo.attention(*_qkv(1), variant="causal", causal=True, cache=cache)
    assert checks.call_count == 1 and len(call_plans._PLANS) == 3


# block_local: its block read from the ring's first slots; longformer: a slot found among pins
@pytest.mark.parametrize(
    "variant", ["causal", "sliding_window", "bigbird", "moba", "block_local", "longformer"]
)
def test_a_step_plan_runs_on_fake_cuda_tensors(variant):
    """The plan a checked step returns, run for later steps on CUDA tensors faked on a machine
    without a GPU (fake tensors get no plan through ``attention``, so it is made here as
    ``attention`` makes it): no device mix, no device value read (a fake tensor has none), the
    output on the cache's device."""
    skip_without_fake_cuda()
    from zoo.functional import _cached_step
    from zoo.testing.fake_cuda import fake_cuda

    params = cache_params(variant, 64)
    # inputs built with device="cuda"; the calls run outside torch.device("cuda"), as users do
    with fake_cuda(), torch.no_grad():
        with torch.device("cuda"):
            cache = zoo.new_cache(variant, batch_size=2, max_len=64, num_kv_heads=2, head_dim=8,
                                  num_heads=4, device="cuda", **params)  # fmt: skip
        zoo.attention(*_qkv(20, "cuda"), variant=variant, causal=True, cache=cache, pos="rope",
                      **params)  # fmt: skip
        _, step = _cached_step(
            *_qkv(1, "cuda"), cache, None, variant=variant, backend="auto", causal=True,
            dropout_p=0.0, scale=None, score=None, pos="rope", params=params,
        )  # fmt: skip
        outs = [step(*_qkv(1, "cuda"), cache) for _ in range(3)]
    assert all(out.device.type == "cuda" and out.shape == (2, 4, 1, 8) for out in outs)
