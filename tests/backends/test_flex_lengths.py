"""Compiled FlexAttention at every length, not only at multiples of a block.

Why: compiled FlexAttention on CPU (torch 2.13.0) was reported to return wrong values or NaN at
lengths that are not a multiple of 16 (L = 8, 56, 72, 120 among them), with a failing set that
changed from one process to the next. The reporter reproduced it with torch alone::

    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    L = 56
    q, k, v = (torch.randn(1, 2, L, 16) for _ in range(3))
    causal = lambda b, h, q_idx, kv_idx: q_idx >= kv_idx
    block_mask = create_block_mask(causal, 1, 1, L, L, device="cpu")
    out = torch.compile(flex_attention, dynamic=False)(q, k, v, block_mask=block_mask)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    print((out - ref).abs().max())  # expected ~1e-7; reported up to 1.4, or nan

(On the 2-core Xeon where this test was written the script above printed ~1e-7 for every length
tried, so the fault depends on the machine or on memory contents.) The flex backend now pads to
whole blocks on CPU (see ``zoo/backends/flex.py``); this test holds it to the reference at every
residue of the length modulo the kernel's block of 128, across its first boundary (lengths 1 to
140), and a large odd length, for several variants, causal or not, with key
padding, in a fresh process (the reported failures changed between processes; seed 1 runs the
other configuration at each length). Every length from 1 to 300 took 70-90 s of the suite on a
2-core CPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import subprocess_timeout

# Runs in a fresh process: each length once, then a large odd one. Each compiled graph
# costs seconds on CPU (one per configuration and padded length), so a process alternates two
# configurations (variant, causal, key padding) by length, and the second process, which swaps
# them, finds the first one's graphs in inductor's cache.
SWEEP = r"""
import json, os, sys, torch, zoo
sys.path.insert(0, sys.argv[2])
from helpers import small_params

seed = int(sys.argv[1])
# one thread beside another pytest worker (two processes of two threads on two cores crawl)
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else 2)
generator = torch.Generator().manual_seed(seed)
configs = [("local", True, True), ("longformer", False, False)]
# Every residue modulo the kernel's block of 128, across its first boundary
lengths = range(1, 141)
cases = [(n, *configs[(n + seed) % 2]) for n in lengths]
cases += [(1999, "bigbird", True, True)]  # causal, padded, many blocks (16 of 128), random ones
failures = []
for n, variant, causal, padded in cases:
    q, k, v = (torch.randn(2, 2, n, 16, generator=generator) for _ in range(3))
    padding = None
    if padded and n > 1:
        padding = torch.zeros(2, n, dtype=torch.bool)
        padding[1, n // 2 + 1 :] = True
    kwargs = dict(variant=variant, causal=causal, key_padding_mask=padding, **small_params(variant))
    out = zoo.attention(q, k, v, backend="flex", **kwargs)
    ref = zoo.attention(q, k, v, backend="reference", **kwargs)
    error = (out - ref).abs().max().item()
    if not error <= 1e-4:  # NaN fails too
        failures.append([n, variant, causal, padded, error])
print(json.dumps({"cases": len(cases), "failures": failures}))
"""


@pytest.mark.parametrize("seed", [0])  # a second seed swaps the configurations: 45 s more
def test_compiled_flex_matches_reference_at_every_length(seed):
    tests_dir = str(Path(__file__).parents[1])
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(
        [sys.executable, "-c", SWEEP, str(seed), tests_dir],
        capture_output=True, text=True, timeout=subprocess_timeout(480), env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["cases"] == 141
    assert result["failures"] == [], f"compiled flex differs from the reference: {result}"


def test_the_cpu_kernel_only_sees_whole_blocks(monkeypatch):
    """The defence itself, where the fault does not show: on CPU the compiled kernel is handed q, k
    and v padded to whole blocks, and the caller gets its own length back."""
    import torch

    import zoo
    from zoo.backends import FlexBackend, flex, flex_kernel

    seen = []

    def recording_kernel(q, k, v, **kwargs):
        seen.append((q.shape[-2], k.shape[-2], kwargs["block_mask"].seq_lengths))
        return flex._flex_module().flex_attention(q, k, v, **kwargs)

    monkeypatch.setattr(flex_kernel, "_kernel", lambda *args: recording_kernel)
    q, k, v = (torch.randn(1, 2, n, 16) for n in (37, 56, 56))
    out = zoo.attention(q, k, v, variant="local", backend=FlexBackend(block_size=16), window_size=3)
    ref = zoo.attention(q, k, v, variant="local", backend="reference", window_size=3)
    assert seen == [(48, 64, (48, 64))]
    assert out.shape == (1, 2, 37, 16)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
