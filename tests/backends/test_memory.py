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
from helpers import LargestTensor, subprocess_timeout

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
