"""The flex backend's kernel options on CUDA, checked on a CPU: every block size it accepts has
kernel tiles that Inductor's CUDA lowering takes (its configurations for an H100/H200, read from
torch itself, and the lowering's filters as torch 2.11-2.13 apply them), lengths that are
multiples of 128 are declared so (``IS_DIVISIBLE``), and a block size no kernel can tile is
refused with a sentence. The GPU run of 2026-11-28 failed 12 decoding tests at block_size=16
(`eval/results/gpu-campaign-h200-2026-11-28`): the GPU test stands beside these."""

from __future__ import annotations

import pytest
import torch

import zoo
from zoo.backends import flex_kernel
from zoo.backends.flex import FlexBackend
from zoo.backends.flex_kernel import cuda_block_reason, cuda_kernel_options
from zoo.testing.fake_cuda import FakeCudaUnavailable, fake_cuda


def _fake_cuda_or_skip():
    try:
        return fake_cuda()
    except FakeCudaUnavailable as error:  # no C++ compiler on a CPU-only build
        pytest.skip(str(error))


def _inductor_configs(monkeypatch, head: int, dtype: torch.dtype):
    """Inductor's forward and decoding configurations on a compute capability 9.0 GPU."""
    from torch._inductor.choices import InductorChoices

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    choices = InductorChoices()
    fwd = [(c.block_m, c.block_n) for c in choices.get_flex_attention_fwd_configs(head, dtype)]
    decode = [c.block_n for c in choices.get_flex_decode_configs(head, dtype)]
    return fwd, decode


def _next_power_of_two(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _lowers(block: int, q_len: int, group: int, options: dict, fwd, decode) -> str | None:
    """Why Inductor's CUDA lowering finds no kernel for the call, or None: the decoding kernel
    for fewer than 128 queries (a power-of-two group, not forced off), else the main one."""
    if q_len < 128 and not options.get("FORCE_USE_FLEX_ATTENTION") and group & (group - 1) == 0:
        block_m = options.get("BLOCK_M", max(_next_power_of_two(q_len * group), 16))
        chosen = [
            n for n in (min(n, block) for n in decode) if block % block_m == 0 and block % n == 0
        ]
        if not chosen:
            return f"decoding kernel: no configuration (query tile {block_m})"
        final_m = options.get("fwd_BLOCK_M", block_m)  # the prefix applies per configuration
        if final_m % group or block % final_m:
            return f"decoding kernel: query tile {final_m} for {group} heads per key head"
        if final_m != block_m:  # SAFE_M_BOUNDARY is read from BLOCK_M: rows past the end
            return f"decoding kernel: runs tile {final_m}, bounds from {block_m}"
        return None
    for m, n in fwd:
        m = options.get("fwd_BLOCK_M", options.get("BLOCK_M", m))
        n = options.get("fwd_BLOCK_N", options.get("BLOCK_N", n))
        if block % m == 0 and block % n == 0:
            return None
    return f"main kernel: no tile of {fwd} divides {block}"


def _cuda(*shape):
    """A tensor of this shape (the options read shapes only)."""
    return torch.empty(*shape, device="meta")


@pytest.mark.parametrize("head", [64, 128])
@pytest.mark.parametrize("block", [16, 32, 48, 64, 96, 128, 192, 256])
def test_every_accepted_block_size_lowers_for_every_query_count(monkeypatch, block, head):
    """Prompts and steps of 1-300 queries with 1-8 query heads per key head: the kernel Inductor
    picks has a configuration. Without the options, blocks under 128 and GQA prompts of 33-127
    tokens found none (block 128, 4 heads per key head, 50 queries: a query tile of 256)."""
    fwd, decode = _inductor_configs(monkeypatch, head, torch.bfloat16)
    assert cuda_block_reason(block, head, torch.bfloat16, backward=False) is None
    failures_without = 0
    for q_len in (1, 7, 12, 50, 100, 127, 128, 300):
        for group in (1, 2, 3, 4, 8):
            q, k = _cuda(2, 2 * group, q_len, head), _cuda(2, 2, 640, head)
            options = cuda_kernel_options(block, q, k, {})
            assert _lowers(block, q_len, group, options, fwd, decode) is None, (q_len, group)
            failures_without += _lowers(block, q_len, group, {}, fwd, decode) is not None
    assert failures_without > 0  # each of these blocks needed an option somewhere


def test_the_gpu_runs_failing_decoding_calls_lower_now(monkeypatch):
    """The two failures of the GPU run at block_size=16: a 12-token prompt with 2 query heads per
    key head (decoding kernel, query tile 32) and the main kernel's default tiles."""
    fwd, decode = _inductor_configs(monkeypatch, 16, torch.float32)
    q, k = _cuda(2, 4, 12, 16), _cuda(2, 2, 64, 16)
    assert _lowers(16, 12, 2, {}, fwd, decode) is not None
    assert _lowers(16, 12, 2, cuda_kernel_options(16, q, k, {}), fwd, decode) is None
    forced = {"FORCE_USE_FLEX_ATTENTION": True}
    assert _lowers(16, 12, 2, forced, fwd, decode) is not None  # the main kernel's own tiles
    assert _lowers(16, 12, 2, {**forced, **cuda_kernel_options(16, q, k, {})}, fwd, decode) is None


def test_lengths_inductor_would_call_whole_in_blocks_that_do_not_divide_them_are_not():
    """Inductor declares static lengths that are multiples of 128 whole in tiles
    (``IS_DIVISIBLE``), and the kernel then walks a listed block's every tile unchecked: a
    length of 384 in blocks of 256 read 128 keys past the end. False there; elsewhere nothing
    (never True: a second compiled family beside the other lengths)."""
    n384, n512 = _cuda(1, 4, 384, 64), _cuda(1, 4, 512, 64)
    assert cuda_kernel_options(256, n384, n384, {})["IS_DIVISIBLE"] is False
    assert cuda_kernel_options(256, n512, n384, {})["IS_DIVISIBLE"] is False
    assert cuda_kernel_options(48, _cuda(1, 4, 128, 64), _cuda(1, 4, 128, 64), {})[
        "IS_DIVISIBLE"
    ] is False  # fmt: skip
    assert "IS_DIVISIBLE" not in cuda_kernel_options(256, n512, n512, {})
    n8192, n8000 = _cuda(1, 4, 8192, 64), _cuda(1, 4, 8000, 64)
    for q, k in ((n8192, n8192), (n8000, n8192), (n8192, n8000)):  # blocks of 128: one family
        assert cuda_kernel_options(128, q, k, {}) == {}
    assert cuda_kernel_options(256, n384, n384, {"IS_DIVISIBLE": True})["IS_DIVISIBLE"] is True


def test_a_cuda_call_hands_its_options_to_the_kernel_and_a_cpu_call_none(monkeypatch):
    """What ``run_kernel`` passes: on fake CUDA tensors the tiles of a block of 48 and the
    backend's own options; on a CPU only the backend's."""
    seen = []

    def kernel(q, k, v, **kwargs):
        seen.append(kwargs.get("kernel_options"))
        return torch.empty_like(q)

    monkeypatch.setattr(flex_kernel, "_kernel", lambda *args: kernel)
    backend = FlexBackend(block_size=48, kernel_options={"num_stages": 2})
    with _fake_cuda_or_skip():
        q = torch.randn(1, 2, 240, 32, device="cuda")
        zoo.attention(q, q, q, variant="local", window_size=16, backend=backend)
    q = torch.randn(1, 2, 240, 32)
    zoo.attention(q, q, q, variant="local", window_size=16, backend=backend)
    tiles = {"fwd_BLOCK_M": 16, "fwd_BLOCK_N": 16}
    assert seen == [{"num_stages": 2, **tiles}, {"num_stages": 2}]


def test_a_decoding_step_hands_the_backends_options_to_the_kernel(monkeypatch):
    """``FlexBackend(kernel_options=...)`` reached the forward kernel only; the decoding step
    (``flex_decode``) dropped them."""
    seen = []
    real = flex_kernel.run_kernel

    def spy(*args, **kwargs):
        seen.append(kwargs.get("kernel_options"))
        return real(*args, **kwargs)

    monkeypatch.setattr("zoo.backends.flex_decode.run_kernel", spy)
    backend = FlexBackend(compile=False, kernel_options={"num_stages": 2})
    attn = zoo.create_attention("sliding_window", dim=32, num_heads=2, causal=True,
                                window_size=8, backend=backend).eval()  # fmt: skip
    x = torch.randn(1, 6, 32)
    with torch.no_grad():
        cache = attn.new_cache(1, 16)
        attn(x[:, :5], cache=cache)
        attn(x[:, 5:], cache=cache)
    assert seen and all(options == {"num_stages": 2} for options in seen)


def test_a_block_size_no_cuda_kernel_tiles_is_refused_by_name():
    backend = FlexBackend(block_size=24)
    with _fake_cuda_or_skip():
        q = torch.randn(1, 2, 96, 32, device="cuda")
        text = zoo.explain(q, q, q, variant="local", window_size=8, backend=backend)
        with pytest.raises(ValueError, match="block_size=24"):
            zoo.attention(q, q, q, variant="local", window_size=8, backend=backend)
    assert "block_size=24" in text and "power of two from 16" in text
    assert cuda_block_reason(48, 64, torch.bfloat16, backward=False) is None  # tiles of 16
    with _fake_cuda_or_skip():
        q = torch.randn(1, 2, 96, 32, device="cuda")
        text = zoo.explain(
            q, q, q, variant="local", window_size=8, backend=FlexBackend(block_size=48)
        )
    assert "forward tiles of 16 (block_size=48 is no multiple of Inductor's 128)" in text


def test_a_backward_the_gpus_tiles_do_not_divide_is_refused(monkeypatch):
    """Inductor picks the backward kernel's tiles per GPU before any option applies: on an
    H100/H200 at head size 64 in bfloat16 (64, 128, 128, 64), so blocks of 64 have no backward
    there (the benchmark's BigBird with 64-token blocks on 64-token flex blocks). Refused with a
    sentence where a GPU answers; forward and blocks of 128 run."""
    monkeypatch.setattr(flex_kernel, "_backward_tiles", lambda head, dtype: [(64, 128, 128, 64)])
    reason = cuda_block_reason(64, 64, torch.bfloat16, backward=True)
    assert "block_size=64" in reason and "multiple of 128" in reason
    assert cuda_block_reason(64, 64, torch.bfloat16, backward=False) is None
    assert cuda_block_reason(128, 64, torch.bfloat16, backward=True) is None
    assert cuda_block_reason(256, 64, torch.bfloat16, backward=True) is None
    monkeypatch.setattr(flex_kernel, "_backward_tiles", lambda head, dtype: None)  # no GPU
    assert cuda_block_reason(64, 64, torch.bfloat16, backward=True) is None


def test_the_backward_tiles_are_read_from_inductor_on_a_gpu(monkeypatch):
    """Where a GPU answers, the tiles are Inductor's own for that GPU (here a capability 9.0
    stand-in); without one, none."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert flex_kernel._backward_tiles(64, torch.bfloat16) is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    flex_kernel._backward_tiles_on.cache_clear()
    tiles = flex_kernel._backward_tiles(64, torch.bfloat16)
    flex_kernel._backward_tiles_on.cache_clear()  # not kept for a real GPU's answer
    assert tiles and max(max(t) for t in tiles) == 128
    assert "multiple of 128" in cuda_block_reason(64, 64, torch.bfloat16, backward=True)
    assert cuda_block_reason(128, 64, torch.bfloat16, backward=True) is None


def test_the_options_are_computed_once_per_shape_and_traced_without_the_cache():
    """A call on a GPU asks for its options every time: they are kept per block, shapes and
    options (the same as computed afresh, True and 1 apart), and a traced call computes them
    without the cache (dynamo warns at an lru_cache-wrapped function)."""
    import warnings

    from zoo.backends import flex_kernel

    q, k = torch.randn(1, 4, 384, 16), torch.randn(1, 2, 384, 16)
    for block, options in ((256, {}), (128, {"IS_DIVISIBLE": True}), (128, {"IS_DIVISIBLE": 1})):
        kept = flex_kernel._cuda_options_now(block, q, k, options)
        assert kept == cuda_kernel_options(block, q, k, options)
        assert [type(v) for v in kept.values()] == [
            type(v) for v in cuda_kernel_options(block, q, k, options).values()
        ]
    assert flex_kernel._cuda_options_of.cache_info().currsize >= 3
    torch._dynamo.reset()
    traced = torch.compile(
        lambda x, y: (x, flex_kernel._cuda_options_now(256, x, y, {})), backend="eager",
        fullgraph=True,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert traced(q, k)[1] == {"IS_DIVISIBLE": False}
    torch._dynamo.reset()
