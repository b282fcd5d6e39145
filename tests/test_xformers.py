"""The xformers backend: unavailable with its reason where it cannot run, never chosen by auto
then, and on a GPU with working operators equal to the reference for the patterns it claims."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from helpers import check_against_reference, gpu, random_qkv

import zoo
from zoo.backends import get_backend
from zoo.backends.xformers import attention_bias, window_of
from zoo.functional import resolve_pattern

NATIVE = [
    ("full", False),
    ("causal", False),
    ("full", True),
    ("local", False),
    ("local", True),
    ("sliding_window", False),
]
HAS_XFORMERS = importlib.util.find_spec("xformers") is not None


def test_unavailable_backends_say_why_and_auto_passes_them_over():
    backend = get_backend("xformers")
    if backend.unavailable() is None:
        pytest.skip("xformers runs here; the unavailable path cannot be seen")
    q, k, v = random_qkv(1, 2, 64, 64)
    with pytest.raises(
        ValueError, match=r"backend 'xformers' cannot run this call: .*(xformers|CUDA)"
    ):
        zoo.attention(q, k, v, variant="local", backend="xformers", window_size=4)
    assert "xformers" not in zoo.list_backends(available_only=True)
    assert not zoo.explain(q, q, q, variant="full").startswith("auto -> xformers")


def test_only_native_patterns_are_claimed():
    for variant, causal in NATIVE:
        assert window_of(resolve_pattern(variant, causal, {})) != ""
    for variant in ("bigbird", "strided", "longformer", "block_local", "global"):
        assert window_of(resolve_pattern(variant, False, {})) == ""


@pytest.mark.skipif(
    not HAS_XFORMERS, reason="xformers is not installed (pip install attention-zoo[xformers])"
)
@pytest.mark.parametrize("variant,causal", NATIVE)
def test_xformers_bias_is_the_pattern(variant, causal):
    """xFormers' bias objects materialise on CPU: they must allow exactly the zoo's pairs."""
    params = {"window_size": 3} if "window_size" in zoo.get_spec(variant).parameters() else {}
    pattern = resolve_pattern(variant, causal, params)
    for q_len, kv_len in [(20, 20), (12, 20), (20, 12)]:
        bias = attention_bias(pattern)
        expected = zoo.dense_mask(variant, q_len, kv_len, causal=causal, **params)
        got = (
            torch.ones(q_len, kv_len, dtype=torch.bool)
            if bias is None
            else bias.materialize((q_len, kv_len)) == 0
        )
        assert torch.equal(got, expected), (variant, causal, q_len, kv_len)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("variant,causal", NATIVE)
def test_xformers_matches_reference_on_gpu(variant, causal, dtype):
    reason = get_backend("xformers").unavailable()
    if reason is not None:
        pytest.skip(reason)
    params = {"window_size": 7} if "window_size" in zoo.get_spec(variant).parameters() else {}
    for q_len, kv_len in [(256, 256), (200, 300)]:
        check_against_reference(
            variant, "xformers", q_len=q_len, kv_len=kv_len, causal=causal, params=params,
            dtype=dtype, device="cuda", head_dim=64,
        )  # fmt: skip
