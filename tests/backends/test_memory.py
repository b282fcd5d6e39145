"""The sparse backends never allocate an n x n tensor.

For ``blocked``, every tensor that any operator creates, forward and backward, is watched through
a TorchDispatchMode; the largest must stay far below n^2 elements. For compiled ``flex``, whose
kernel allocates outside the dispatcher, a subprocess's peak memory must stay far below the 4 GiB
that one float32 n x n matrix would take at n = 32K.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from helpers import SELF_CONTAINED_VARIANTS, LargestTensor, subprocess_timeout

import zoo


@pytest.mark.parametrize(
    "variant,params",
    [
        ("local", {"window_size": 64}),
        ("strided", {"stride": 128, "window_size": 16}),
        ("bigbird", {"block_size": 64}),
        ("longformer", {"window_size": 64, "dilation": 2}),
    ],
)
def test_blocked_never_allocates_n_squared(variant, params):
    n = 16384
    q, k, v = (torch.randn(1, 1, n, 16, requires_grad=True) for _ in range(3))
    watch = LargestTensor()
    with watch:
        out = zoo.attention(q, k, v, variant=variant, backend="blocked", causal=True, **params)
        out.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()
    assert watch.largest <= n * n // 32, f"largest tensor {watch.largest} elements vs n^2 = {n * n}"


def test_compiled_flex_peak_memory_is_far_below_n_squared():
    script = textwrap.dedent(
        """
        import resource, torch, zoo
        n = 32768
        q, k, v = (torch.randn(1, 1, n, 16) for _ in range(3))
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        out = zoo.attention(q, k, v, variant="local", backend="flex", window_size=64)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        assert torch.isfinite(out).all()
        print((peak - before) * 1024)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=subprocess_timeout(600),
    )
    assert done.returncode == 0, done.stderr[-2000:]
    grown = int(done.stdout.strip().splitlines()[-1])
    n_squared_bytes = 32768 * 32768 * 4
    assert grown < n_squared_bytes // 8, (
        f"peak memory grew by {grown / 2**30:.2f} GiB during the call"
    )


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_a_choice_by_content_is_never_a_queries_by_blocks_layout(monkeypatch, causal):
    """MoBA's choice is kept as its picks (n * top_k block indices), and blocked's runs and
    flex's block mask read the per-query layout a slice of queries at a time: with the slices
    made small, no tensor reaches half the (B, H, Lq, key blocks) mask that the choice was
    (n^2 / block: 537 MB at 128K tokens, 16 heads, blocks of 512), in the choice, blocked's
    runs, flex's block mask (over the queries gathered by chosen block), and (bidirectional:
    FULL runs, no masks) blocked's forward and backward. Causal MoBA's PARTIAL runs (each
    query's own block) carry a (queries, 512) mask, linear in n and larger than this layout at
    32K: that call is not watched whole."""
    import zoo.backends.blocked.by_key as by_key
    import zoo.patterns.moba as moba
    import zoo.patterns.routed as routed
    from zoo.backends import BlockedBackend, FlexBackend
    from zoo.backends.flex_chosen import gathered_rows
    from zoo.functional import prepare_call

    for module, name in ((moba, "CHOICE_ELEMENTS"), (routed, "COUNT_CHUNK"),
                         (by_key, "STATE_CHUNK")):  # fmt: skip
        monkeypatch.setattr(module, name, 1 << 16)
    n, heads, block = 32768, 4, 512
    layout = heads * n * (n // block)  # elements of the choice as a mask
    params = {"block_size": block, "top_k": 3}
    q, k, v = (torch.randn(1, heads, n, 4, requires_grad=True) for _ in range(3))
    watch = LargestTensor()
    with watch:
        call = prepare_call(q, k, v, variant="moba", causal=causal, **params)
        scored = BlockedBackend().scored_pairs(call)
        mask = FlexBackend(compile=False).block_mask(call)
    assert watch.largest < layout // 2, (watch.largest, layout)
    assert n * 3 * block * 0.9 < scored <= n * 3 * block
    # flex's mask is over the (query, chosen block) rows (``flex_chosen``): n * top_k of them
    # and a partly filled kernel block per segment, not the queries x blocks layout
    rows = gathered_rows(n, 3, n // block, 128, fixed=causal)
    assert mask.kv_num_blocks.shape == (1, heads, rows // 128)
    if causal:
        return
    with watch:
        out = zoo.attention(q, k, v, variant="moba", backend="blocked", **params)
        out.sum().backward()
    assert torch.isfinite(q.grad).all()
    assert watch.largest < layout // 2, (watch.largest, layout)


def test_sdpa_with_grouped_heads_does_not_copy_a_shared_mask_per_head():
    """On a CPU a mask that the heads share goes to SDPA once, grouped heads and all
    (``masked_sdpa`` folds them into query rows only on CUDA, or where the mask differs per
    head): folded, a (1, 1, n, n) mask was copied per query head of a key/value head."""
    n = 1024
    q = torch.randn(1, 8, n, 16)
    k, v = torch.randn(1, 2, n, 16), torch.randn(1, 2, n, 16)
    watch = LargestTensor()
    with watch:
        out = zoo.attention(q, k, v, variant="sliding_window", window_size=64, backend="sdpa")
    assert out.shape == q.shape
    assert watch.largest <= n * n, (watch.largest, n * n)


def _bench_params(variant: str) -> dict:
    """The GPU benchmark's parameters of a variant (eval/configs/bench.yaml), else its own."""
    from pathlib import Path

    import yaml

    root = Path(__file__).resolve().parents[2]
    config = yaml.safe_load((root / "eval" / "configs" / "bench.yaml").read_text())
    return dict(config["params"].get(variant, {}))


@pytest.mark.parametrize("variant", SELF_CONTAINED_VARIANTS)
def test_every_variants_cuda_path_at_131072_tokens_allocates_nothing_near_n_squared(
    monkeypatch, variant
):
    """The CUDA path (auto's choice, and ``explain``) of every variant at 131072 tokens, 16 heads,
    bfloat16, on fake CUDA tensors with the kernels stubbed (their own memory is theirs: flex's
    is linear, SDPA's FlashAttention's too; on fake tensors SDPA runs its n^2 math form): no
    tensor of the zoo's own path (block masks, layouts, choices, gathers, merges) is larger than
    4 copies of the inputs (MoBA's gathered rows hold each query once per chosen block, top 3,
    padded to whole kernel blocks: 3.25 copies). Causal for every other variant, to keep the CPU
    time of the host's tables down."""
    from zoo.backends import flex_kernel
    from zoo.testing.fake_cuda import FakeCudaUnavailable, fake_cuda

    def stubbed_flex(*args):
        def kernel(q, k, v, return_aux=None, return_lse=False, **kwargs):
            out = q.new_empty(*q.shape[:-1], v.shape[-1])
            lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
            return (out, lse) if return_aux is not None or return_lse else out

        return kernel

    def stubbed_sdpa(q, k, v, *args, **kwargs):
        return q.new_empty(*q.shape[:-1], v.shape[-1])

    monkeypatch.setattr(flex_kernel, "_kernel", stubbed_flex)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", stubbed_sdpa)
    n, heads, causal = 131072, 16, SELF_CONTAINED_VARIANTS.index(variant) % 2 == 1
    try:
        context = fake_cuda()
    except FakeCudaUnavailable as error:  # no C++ compiler on a CPU-only build
        pytest.skip(str(error))
    with context:
        q = torch.randn(1, heads, n, 64, device="cuda", dtype=torch.bfloat16)
        watch = LargestTensor()
        with watch:
            kwargs = dict(variant=variant, causal=causal, **_bench_params(variant))
            zoo.explain(q, q, q, **kwargs)
            out = zoo.attention(q, q, q, **kwargs)
    assert out.shape == q.shape and out.device.type == "cuda"
    assert watch.largest <= 4 * q.numel(), (
        f"largest tensor {watch.largest} elements: {watch.largest / n**2:.3g} of n^2"
    )
