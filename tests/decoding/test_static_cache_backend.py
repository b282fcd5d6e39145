"""A static cache on CUDA: ``auto`` decodes it with sdpa, as every other cache on CUDA (which
splits its many masked slots into runs, tests/backends/test_split_keys.py). Flex's decoding
kernel splits the slots too and skips empty blocks, but a step compiled whole on flex failed in
Inductor on an H200 (torch 2.11), so flex is the backend one names for it
(``zoo.decoding.decode``). Named, on
CUDA flex's decoding step passes the cache's own keys, never a padded copy (checked on fake CUDA
tensors); its values at widths that are not whole blocks are checked against the reference on a
CPU by test_decode_backends."""

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
    with torch.no_grad():
        with torch.device(device):
            attn = zoo.create_attention("causal", dim=32, num_heads=4, num_kv_heads=2, causal=True)
            x = torch.randn(2, 12, 32)
            cache = attn.eval().new_cache(2, MAX_LEN, static=static)
        # run outside torch.device(device), as users do, so that a CPU tensor shows
        attn(x[:, :9], cache=cache)
        for i in range(9, 12):
            out = attn(x[:, i : i + 1], cache=cache)
    assert out.shape == (2, 1, 32) and out.device.type == device
    return ran


@pytest.mark.parametrize("static", [False, True], ids=["growing", "static"])
def test_auto_decodes_every_cache_on_cuda_with_sdpa(static, monkeypatch):
    """Fake CUDA tensors: a static cache's prefill and steps run on sdpa, as a growing cache's."""
    skip_without_fake_cuda()
    with fake_cuda():
        ran = _steps_on("cuda", static, monkeypatch)
    assert ran == ["sdpa"] * 4


def test_auto_decodes_a_static_cache_on_a_cpu_with_sdpa(monkeypatch):
    assert _steps_on("cpu", True, monkeypatch) == ["sdpa"] * 4


def test_flex_named_decodes_a_static_cache_on_cuda():
    """A named flex decodes a static CUDA cache, with or without gradients, and refuses dropout
    (flex has none), naming the backends that can; explain says which backend runs."""
    skip_without_fake_cuda()
    with fake_cuda():
        with torch.device("cuda"):  # built here; the calls run outside it, as users do
            attn = zoo.create_attention("causal", dim=32, num_heads=4, causal=True)
            cache = attn.new_cache(1, MAX_LEN, static=True)
            q = torch.randn(1, 4, 1, 8)
        dot = DotProduct(0.125)
        assert decode_backend("auto", dot, 0.0, cache).name == "sdpa"
        assert decode_backend("flex", dot, 0.0, cache).name == "flex"
        assert decode_backend("flex", dot, 0.0, cache, "cuda").name == "flex"
        with pytest.raises(ValueError, match=r"backend 'flex' cannot decode this call: .*sdpa"):
            decode_backend("flex", dot, 0.1, cache)
        named = zoo.explain(q, q, q, variant="causal", causal=True, cache=cache, backend="flex")
        chosen = explain_decode("auto", dot, cache)
    assert named.startswith("decoding with a cache on flex")
    assert chosen.startswith("decoding with a cache on sdpa")


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
    with fake_cuda(), torch.no_grad():
        with torch.device("cuda"):
            attn = zoo.create_attention("causal", dim=32, num_heads=4, causal=True, backend="flex")
            cache = attn.eval().new_cache(2, MAX_LEN, static=True)
            x = torch.randn(2, 10, 32)
        attn(x[:, :9], cache=cache)
        attn(x[:, 9:], cache=cache)
    prefill = MAX_LEN + 9
    assert seen == [(9, prefill, prefill, (9, prefill)), (1, MAX_LEN, MAX_LEN, (1, MAX_LEN))]
