"""What a GPU compiles of a decoding step (``zoo.core.fused``): the pairs the pattern allows
(``DecodeStep.mask``) and sdpa's packing of each row's allowed keys (``sdpa.gather_allowed``),
each one graph where eagerly they were 20 to 50 launches a step. Forced to compile on a CPU:
a prefill, a step of 3 tokens, then one token at a time to 43 tokens (a 2-D grid's 64; rows of
different lengths too), equal to the eager steps; each function compiles a few graphs over the
steps, not one a step, and none fails back to eager. CI compiles a sample; ZOO_SLOW=1 every
variant that decodes. The packing per query head (a mask chosen by content) is held apart."""

from __future__ import annotations

import itertools

import pytest
import torch
from helpers import FIXED_VARIANTS, GRAPH_VARIANTS, cache_params
from torch._dynamo.eval_frame import _debug_get_cache_entry_list

import zoo
from zoo.backends import base, sdpa
from zoo.core import fused

pytestmark = pytest.mark.usefixtures("scalar_cpu_code")  # the graphs a GPU runs (conftest)

VARIANTS = [v for v in FIXED_VARIANTS if v not in GRAPH_VARIANTS] + ["moba"]
# tables (bigbird) and chosen blocks (moba), whose keys this short cache does not pack; a strided
# pattern and a 2-D one, whose keys it packs (one mask for every head)
SAMPLE = {"bigbird", "moba", "strided", "neighborhood_2d"}
FUNCTIONS = (base._step_mask, sdpa._packed)


def _decode(attn, x: torch.Tensor, lens: list[torch.Tensor] | None) -> torch.Tensor:
    cache = attn.new_cache(x.shape[0], 64)
    bounds = [0, 11, 14, *range(15, x.shape[1] + 1)]
    outs = []
    for i, (a, b) in enumerate(itertools.pairwise(bounds)):
        valid = None if lens is None else lens[min(i, len(lens) - 1)]
        outs.append(attn(x[:, a:b], cache=cache, valid_lens=valid))
    return torch.cat(outs, 1)


@pytest.mark.parametrize("rows", ["even", "uneven"])
@pytest.mark.parametrize(
    "variant", [v if v in SAMPLE else pytest.param(v, marks=pytest.mark.slow) for v in VARIANTS]
)
def test_the_step_compiled_as_on_a_gpu_equals_the_eager_step(variant, rows, monkeypatch):
    torch._dynamo.reset()
    for function in FUNCTIONS:
        function.__dict__.pop("compiled", None)
        monkeypatch.setattr(function, "failures", {})
    packed = []  # the steps whose allowed keys were packed (where that pays)
    gather = sdpa.gather_allowed

    def spied(*args):
        out = gather(*args)
        packed.append(out is not None)
        return out

    monkeypatch.setattr(sdpa, "gather_allowed", spied)
    torch.manual_seed(0)
    attn = zoo.create_attention(variant, dim=16, num_heads=4, num_kv_heads=2, causal=True,
                                backend="sdpa", **cache_params(variant)).eval()  # fmt: skip
    x = torch.randn(2, 64 if "grid" in cache_params(variant) else 43, 16)
    # uneven: a prefill of 11 and 6 tokens, a step adding 3 and 1, then one token and none
    lens = None if rows == "even" else [torch.tensor(n) for n in ([11, 6], [3, 1], [1, 0])]
    with torch.no_grad():
        eager = _decode(attn, x, lens)
        with monkeypatch.context() as m:
            m.setattr(fused, "fuses", lambda t: not torch.compiler.is_compiling())
            compiled = _decode(attn, x, lens)
    torch.testing.assert_close(compiled, eager, atol=1e-6, rtol=1e-5)
    graphs = [len(_debug_get_cache_entry_list(f.fn.__code__)) for f in FUNCTIONS]
    assert all(f.failed is None for f in FUNCTIONS), [f.failed for f in FUNCTIONS]
    # a static graph, one of symbolic sizes, a one-token step's; the packing's width too
    assert 1 <= graphs[0] <= 3 and graphs[1] <= 4, graphs
    assert (graphs[1] > 0) == any(packed), (graphs, packed)


def test_keys_packed_per_query_head_compiled_as_on_a_gpu_equal_the_eager_packing(monkeypatch):
    """A mask per query head (MoBA's, where few keys are chosen): the packing compiled (forced on
    a CPU) equals the eager one at three slot counts and bounds, grouped heads, rows with no key;
    one graph of symbolic sizes."""
    torch._dynamo.reset()
    sdpa._packed.__dict__.pop("compiled", None)
    monkeypatch.setattr(sdpa._packed, "failures", {})
    g = torch.Generator().manual_seed(0)
    for slots, most in ((300, 24), (517, 40), (777, 33)):
        mask = torch.rand(2, 4, slots, generator=g) < most / slots / 2  # (B, H, S), per head
        mask[1, 3] = False  # a head of a row with no key
        keys, values = (torch.randn(2, 2, slots, 8, generator=g) for _ in range(2))
        key_pos = torch.arange(slots).expand(2, 1, slots)
        eager = sdpa.gather_allowed(mask, keys, values, key_pos, most)
        with monkeypatch.context() as m:
            m.setattr(fused, "fuses", lambda t: not torch.compiler.is_compiling())
            compiled = sdpa.gather_allowed(mask, keys, values, key_pos, most)
        assert eager is not None and eager[1].shape == (2, 4, most, 8)
        for a, b in zip(eager, compiled, strict=True):
            assert torch.equal(a, b), slots
    assert sdpa._packed.failed is None
    assert len(_debug_get_cache_entry_list(sdpa._packed.fn.__code__)) == 1
