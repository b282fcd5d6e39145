"""``auto`` decodes a static cache on CUDA with flex (``zoo.decoding.decode.static_on_cuda``): a
static cache's step reads every slot with a mask, which sdpa runs on CUDA's memory-efficient
kernel over all slots, one thread block per row and key/value head (a compiled causal step at 16K
took 0.87 ms on an H200 against 0.37 ms for the eager step over the filled slots). Elsewhere auto
stays on sdpa. On CUDA flex's decoding step passes the cache's own keys, never a padded copy
(checked on fake CUDA tensors); its values at widths that are not whole blocks are checked against
the reference on a CPU by test_decode_backends."""

from __future__ import annotations

import pytest
import torch
from helpers import skip_without_fake_cuda

import zoo
from zoo.backends import flex_decode as flex_decode_module
from zoo.backends.flex import FlexBackend
from zoo.backends.sdpa import SdpaBackend
from zoo.core.scores import DotProduct
from zoo.decoding.decode import decode_backend, explain_decode
from zoo.testing.fake_cuda import fake_cuda

MAX_LEN = 200  # slots of a causal cache: not a multiple of flex's block of 128


def _steps_on(device: str, static: bool, monkeypatch) -> list[str]:
    """A prefill of 9 tokens and 3 one-token steps of causal attention under auto, 4 query heads
    on 2 key/value heads: the backends whose decoding step ran, in order."""
    ran = []
    for cls in (FlexBackend, SdpaBackend):
        original = cls.decode_step

        def spy(self, step, original=original):
            ran.append(self.name)
            return original(self, step)

        monkeypatch.setattr(cls, "decode_step", spy)
    with torch.device(device), torch.no_grad():
        attn = zoo.create_attention("causal", dim=32, num_heads=4, num_kv_heads=2, causal=True)
        x = torch.randn(2, 12, 32)
        cache = attn.eval().new_cache(2, MAX_LEN, static=static)
        attn(x[:, :9], cache=cache)
        for i in range(9, 12):
            out = attn(x[:, i : i + 1], cache=cache)
    assert out.shape == (2, 1, 32) and out.device.type == device
    return ran


@pytest.mark.parametrize("static", [False, True], ids=["growing", "static"])
def test_auto_decodes_a_static_cache_on_cuda_with_flex(static, monkeypatch):
    """Fake CUDA tensors: a static cache's prefill and steps run on flex, a growing cache's on
    sdpa."""
    skip_without_fake_cuda()
    with fake_cuda():
        ran = _steps_on("cuda", static, monkeypatch)
    assert ran == ["flex" if static else "sdpa"] * 4


def test_auto_decodes_a_static_cache_on_a_cpu_with_sdpa(monkeypatch):
    """On a CPU compiled flex compiles per shape and pads the query to a whole block: sdpa."""
    assert _steps_on("cpu", True, monkeypatch) == ["sdpa"] * 4


def test_only_autos_choice_changes():
    """A named sdpa stays; a step that records gradients still gets flex on CUDA (flex has a
    CUDA backward), one with dropout sdpa (flex has none); explain says why flex, and says the
    same as the call under dropout."""
    skip_without_fake_cuda()
    with fake_cuda(), torch.device("cuda"):
        attn = zoo.create_attention("causal", dim=32, num_heads=4, causal=True)
        cache = attn.new_cache(1, MAX_LEN, static=True)
        dot = DotProduct(0.125)
        assert decode_backend("auto", dot, 0.0, cache, 4).name == "flex"
        assert decode_backend("sdpa", dot, 0.0, cache, 4).name == "sdpa"
        assert decode_backend("auto", dot, 0.0, cache, 4, "cuda").name == "flex"
        assert decode_backend("auto", dot, 0.1, cache, 4).name == "sdpa", "flex has no dropout"
        said = explain_decode("auto", dot, cache, 4)
        q = torch.randn(1, 4, 1, 8)
        with_dropout = zoo.explain(q, q, q, variant="causal", causal=True, cache=cache,
                                   dropout_p=0.1)  # fmt: skip
        named = zoo.explain(q, q, q, variant="causal", causal=True, cache=cache, backend="flex")
    assert "a static cache on CUDA: flex's decoding kernel splits the slots" in said
    assert "decoding with a cache on sdpa" in with_dropout
    assert "decoding with a cache on flex" in named and "a static cache on CUDA" not in named


@pytest.mark.parametrize(
    "variant,heads,kv_heads,chosen",
    [
        ("causal", 8, 2, "flex"),  # 4 query heads per key/value head: the decoding kernel
        ("causal", 6, 2, "sdpa"),  # 3: Inductor's main kernel, which does not split the keys
        ("bigbird", 4, 4, "flex"),  # a mask per head, one query head per key/value head
        ("bigbird", 4, 2, "sdpa"),  # a mask per head shared by 2 query heads: the main kernel
        ("moba", 4, 2, "sdpa"),  # chosen by content: per head
        ("moba", 4, 4, "flex"),
    ],
)
def test_auto_keeps_sdpa_where_inductor_would_not_run_its_decoding_kernel(
    variant, heads, kv_heads, chosen
):
    """Inductor's decoding kernel (``_use_flex_decoding``) needs a power of two of query heads per
    key/value head and, where they share one, one block mask for all heads."""
    skip_without_fake_cuda()
    params = {"bigbird": {"block_size": 8, "random_per_head": True}, "moba": {"block_size": 8}}
    with fake_cuda(), torch.device("cuda"):
        attn = zoo.create_attention(variant, dim=8 * heads, num_heads=heads, num_kv_heads=kv_heads,
                                    causal=True, **params.get(variant, {}))  # fmt: skip
        cache = attn.new_cache(1, MAX_LEN, static=True)
        assert decode_backend("auto", DotProduct(0.125), 0.0, cache, heads).name == chosen


def test_flex_decoding_on_cuda_passes_the_cache_itself(monkeypatch):
    """Fake CUDA: a step's kernel gets the cache's keys and values, MAX_LEN slots (not padded to
    256 by a copy of every slot per step), and a block mask over those slots; the prefill its
    slots and its own 9 keys, not padded either."""
    skip_without_fake_cuda()
    seen = []
    original = flex_decode_module.run_kernel

    def spy(compiled, least, q, k, v, **kwargs):
        seen.append((q.shape[2], k.shape[2], v.shape[2], kwargs["block_mask"].seq_lengths))
        return original(compiled, least, q, k, v, **kwargs)

    monkeypatch.setattr(flex_decode_module, "run_kernel", spy)
    with fake_cuda(), torch.device("cuda"), torch.no_grad():
        attn = zoo.create_attention("causal", dim=32, num_heads=4, causal=True).eval()
        cache = attn.new_cache(2, MAX_LEN, static=True)
        x = torch.randn(2, 10, 32)
        attn(x[:, :9], cache=cache)
        attn(x[:, 9:], cache=cache)
    prefill = MAX_LEN + 9
    assert seen == [(9, prefill, prefill, (9, prefill)), (1, MAX_LEN, MAX_LEN, (1, MAX_LEN))]
