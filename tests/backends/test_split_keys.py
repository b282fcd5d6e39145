"""sdpa's masked decoding step with its keys split into runs side by side
(``zoo.backends.split_keys``): the merge of the runs equals one masked SDPA over all keys, for
shared and per-head masks, boolean and additive, grouped heads, runs whose keys a query may not
read and a last run shorter than the others; compiled as on a GPU, it equals the eager split over
growing slot counts from three graphs; on CUDA a static cache's steps take it (CUDA tensors that
hold CPU values, the memory-efficient kernel stood in for by its emulation, which raises where the
kernel would refuse) and equal the same steps on a CPU, and the runs are views of the cache, never
a copy. Where it does not split: a CPU, dropout, gradients (a mask's too), head sizes and dtypes
the kernel does not take, keys that are no view, few slots, many rows. GPU tests run the kernel
itself and the compiled static steps split (tests/decoding/test_decode_compiled.py)."""

from __future__ import annotations

import math

import pytest
import torch
from efficient_attention_emulation import EmulatedEfficientOps
from helpers import assert_within_convention, gpu, skip_without_fake_cuda
from torch._dynamo.eval_frame import _debug_get_cache_entry_list
from torch.multiprocessing.reductions import StorageWeakRef

import zoo
from zoo.backends import lse_kernel, split_keys
from zoo.backends.sdpa import SdpaBackend
from zoo.backends.split_keys import key_chunk, split_keys_attention
from zoo.core import fused
from zoo.testing.fake_cuda import FakeCudaUnavailable, fake_cuda, tagged_cuda


def _whole(q, keys, values, mask):
    """One masked SDPA over all keys, grouped heads repeated: what the split must equal."""
    groups = q.shape[1] // keys.shape[1]
    keys, values = (x.repeat_interleave(groups, dim=1) for x in (keys, values))
    return torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=mask)


@pytest.mark.parametrize("chunk", [32, 48, 100, 203])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (8, 1)])
@pytest.mark.parametrize("mask_kind", ["shared", "per_head", "additive"])
def test_the_runs_merged_equal_one_masked_call(chunk, heads, kv_heads, mask_kind):
    """203 slots of a larger store (a view, as a cache's slots in use are): runs of ``chunk``
    slots and a shorter last one (none for 203); slots 50-119 allowed to no query, so some runs
    have no key for it."""
    g = torch.Generator().manual_seed(chunk * 10 + heads)
    B, S, D = 3, 203, 16
    q = torch.randn(B, heads, 1, D, generator=g)
    keys, values = (torch.randn(B, kv_heads, S + 29, D, generator=g)[:, :, :S] for _ in "kv")
    mask = torch.rand(B, 1 if mask_kind == "shared" else heads, 1, S, generator=g) < 0.3
    mask[..., 50:120] = False
    mask[..., 7] = True  # every query some key
    if mask_kind == "additive":  # a positional bias where allowed
        mask = torch.randn(mask.shape, generator=g).masked_fill(~mask, -math.inf)
    got = split_keys_attention(q, keys, values, mask, None, chunk)
    assert got.shape == (B, heads, 1, D) and got.dtype == q.dtype
    torch.testing.assert_close(got, _whole(q, keys, values, mask), atol=2e-6, rtol=1e-5)


@pytest.mark.usefixtures("scalar_cpu_code")  # the graph a GPU runs (conftest)
def test_the_split_compiled_as_on_a_gpu_equals_the_eager_split(monkeypatch):
    """``split_keys_attention`` is one compiled graph on a GPU (``zoo.core.fused``), forced to
    compile here: at slot counts that grow as a cache's do, with a last run and without, its
    output equals the eager one, from three graphs (a static one, then one of symbolic sizes
    with a last run, and one without)."""
    torch._dynamo.reset()
    split_keys_attention.__dict__.pop("compiled", None)
    monkeypatch.setattr(split_keys_attention, "failures", {})
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, 1, 16, generator=g)
    store = torch.randn(2, 2, 800, 16, generator=g)
    for slots in (515, 516, 600, 640, 681, 704):  # runs of 64: 640 and 704 leave none over
        keys, values = store[:, :, :slots], store.flip(2)[:, :, :slots]
        mask = torch.rand(2, 1, 1, slots, generator=g) < 0.4
        mask[..., 0] = True
        eager = split_keys_attention(q, keys, values, mask, None, 64)
        with monkeypatch.context() as m:
            m.setattr(fused, "fuses", lambda t: not torch.compiler.is_compiling())
            compiled = split_keys_attention(q, keys, values, mask, None, 64)
        torch.testing.assert_close(compiled, eager, atol=1e-6, rtol=1e-5)
    assert split_keys_attention.failed is None
    assert len(_debug_get_cache_entry_list(split_keys_attention.fn.__code__)) == 3


@pytest.fixture
def tagged(monkeypatch):
    """CUDA tensors with CPU values, the memory-efficient kernel emulated (it counts its calls),
    and runs short enough that a cache of a few hundred slots splits."""
    ops = EmulatedEfficientOps()
    monkeypatch.setitem(lse_kernel.KERNELS, "cuda", lse_kernel.cuda_kernel(ops))
    monkeypatch.setattr(split_keys, "CHUNK", 32)
    try:
        with tagged_cuda() as tag:
            yield tag, ops
    except FakeCudaUnavailable as error:
        pytest.skip(str(error))


def _static_steps(device: str, variant: str, pos: str | None, head_dim: int, v_dim: int,
                  made=None) -> list[torch.Tensor]:  # fmt: skip
    """A static cache of 300 slots (4 query heads on 2 key/value heads, batch 2, rows of 150 and
    137 tokens), then 3 one-token steps: their outputs."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 154, head_dim, generator=g)
    k = torch.randn(2, 2, 154, head_dim, generator=g)
    v = torch.randn(2, 2, 154, v_dim, generator=g)
    made = made or (lambda x: x.to(device))
    kw = dict(variant=variant, causal=True, pos=pos)
    cache = zoo.new_cache(variant, batch_size=2, max_len=300, num_kv_heads=2, head_dim=head_dim,
                          value_dim=v_dim, device=device, static=True)  # fmt: skip
    padding = torch.zeros(2, 150, dtype=torch.bool)
    padding[1, 137:] = True
    with torch.no_grad():
        zoo.attention(*(made(x[:, :, :150]) for x in (q, k, v)), cache=cache,
                      key_padding_mask=made(padding), **kw)  # fmt: skip
        return [
            zoo.attention(*(made(x[:, :, i : i + 1]) for x in (q, k, v)), cache=cache, **kw)
            for i in range(150, 153)
        ]


@pytest.mark.parametrize(
    "variant,pos,head_dim,v_dim",
    [("causal", None, 16, 16), ("causal", None, 16, 8), ("causal", "alibi", 16, 16)],
)
def test_a_static_cache_on_cuda_splits_its_keys_and_equals_the_cpu(
    variant, pos, head_dim, v_dim, tagged, monkeypatch
):
    """Causal attention: a static cache reads all its slots, masked (with ALiBi's bias,
    additive), where a growing one reads the filled slots unmasked."""
    tag, ops = tagged
    taken = []

    def spy(*args):
        taken.append(key_chunk(*args))
        return taken[-1]

    monkeypatch.setattr(zoo.backends.sdpa, "key_chunk", spy)
    got = _static_steps("cuda", variant, pos, head_dim, v_dim, made=tag)
    # the prefill in one piece; each step in runs of 32 slots: 9 and a last run of 12, two
    # kernel calls
    assert taken == [0, 32, 32, 32] and ops.calls["forward"] == 2 * 3
    want = _static_steps("cpu", variant, pos, head_dim, v_dim)
    for a, b in zip(got, want, strict=True):
        assert a.device.type == "cuda"
        torch.testing.assert_close(a.values, b, atol=1e-5, rtol=1e-5)


def test_the_runs_are_views_of_the_cache():
    """On fake CUDA tensors (shapes and strides, the real kernel's meta): each run's keys and
    values passed to the kernel share the cache's storage, and the output has the step's shape."""
    skip_without_fake_cuda()
    seen = []
    forward = lse_kernel.KERNELS["cuda"].forward

    def spy(q, k, v, mask, scale):
        seen.append((k, v))
        return forward(q, k, v, mask, scale)

    kernel = lse_kernel.KERNELS["cuda"]
    with pytest.MonkeyPatch.context() as patch, fake_cuda():
        patch.setitem(lse_kernel.KERNELS, "cuda", lse_kernel.LseKernel(
            "cuda", kernel.head_multiple, spy, kernel.backward))  # fmt: skip
        with torch.device("cuda"):  # built here; the call runs outside it, as users do
            cache = zoo.new_cache("causal", batch_size=8, max_len=16384, num_kv_heads=4,
                                  head_dim=128, dtype=torch.bfloat16, device="cuda",
                                  static=True)  # fmt: skip
            q = torch.randn(8, 16, 1, 128, dtype=torch.bfloat16)
            k = torch.randn(8, 4, 1, 128, dtype=torch.bfloat16)
        with torch.no_grad():
            out = zoo.attention(q, k, k, cache=cache, variant="causal", causal=True)
    assert out.shape == (8, 16, 1, 128)
    # 8 rows x 4 key/value heads: 16 runs of 1024 slots, no slot left over
    assert [tuple(k.shape) for k, _ in seen] == [(32, 16, 1024, 128)]
    for k, v in seen:
        assert StorageWeakRef(k.untyped_storage()) == StorageWeakRef(cache.keys.untyped_storage())
        assert StorageWeakRef(v.untyped_storage()) == StorageWeakRef(cache.values.untyped_storage())


def test_where_a_step_does_not_split():
    """No split (0): on a CPU; on CUDA with dropout, with gradients (of the mask too: the
    kernel's log-sum-exp carries none), head sizes the kernel does not take as they are (not a
    multiple of 8), float64, keys that are no view of a (rows x heads, slots) store, fewer
    slots than two runs, and rows x heads enough to fill the GPU."""
    skip_without_fake_cuda()
    q, keys, mask = torch.randn(8, 16, 1, 128), torch.randn(8, 4, 16384, 128), torch.ones(1)
    assert key_chunk(q, keys, keys, mask, 0.0) == 0  # a CPU
    with fake_cuda(), torch.no_grad():
        with torch.device("cuda"):  # built here; key_chunk runs outside it, as users' calls do
            q = torch.randn(8, 16, 1, 128, dtype=torch.bfloat16)
            keys = torch.randn(8, 4, 16384, 128, dtype=torch.bfloat16)
            mask = torch.zeros(8, 1, 1, 16384, dtype=torch.bfloat16)
            many = torch.randn(64, 4, 4096, 128, dtype=torch.bfloat16)  # 256 rows x heads
        assert key_chunk(q, keys, keys, mask, 0.0) == 1024
        assert key_chunk(q, keys, keys, mask, 0.1) == 0
        with torch.enable_grad():
            assert key_chunk(q.requires_grad_(), keys, keys, mask, 0.0) == 0
            assert key_chunk(q.detach(), keys, keys, mask.requires_grad_(), 0.0) == 0
        q, mask = q.detach(), mask.detach()
        assert key_chunk(q[..., :12], keys[..., :12], keys[..., :12], mask, 0.0) == 0
        assert key_chunk(q.double(), keys.double(), keys.double(), mask.double(), 0.0) == 0
        assert key_chunk(q, keys.transpose(0, 1), keys, mask, 0.0) == 0
        assert key_chunk(q, keys[:, :, :2047], keys[:, :, :2047], mask, 0.0) == 0
        assert key_chunk(q, keys[:, :, :2048], keys[:, :, :2048], mask, 0.0) == 1024
        assert key_chunk(q[:1].expand(64, -1, -1, -1), many, many, mask, 0.0) == 0
        assert key_chunk(q[:1].expand(63, -1, -1, -1), many[:63], many[:63], mask, 0.0) == 1024


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_gpu_the_chunks_on_the_kernel_equal_one_masked_call(dtype):
    """The memory-efficient kernel itself: 5240 slots in 5 runs of 1024 and a last run of 120, a
    shared mask with slots no query reads, within twice masked SDPA's own error in the dtype
    (both against float64)."""
    g = torch.Generator().manual_seed(3)
    B, H, kv_heads, S, D = 2, 8, 2, 5240, 64
    q = torch.randn(B, H, 1, D, generator=g)
    keys, values = (torch.randn(B, kv_heads, S, D, generator=g) for _ in "kv")
    mask = torch.rand(B, 1, 1, S, generator=g) < 0.5
    mask[..., 1000:2500] = False
    want = _whole(*(x.double() for x in (q, keys, values)), mask)
    q, keys, values, mask = (x.to("cuda", dtype if x.is_floating_point() else x.dtype)
                             for x in (q, keys, values, mask))  # fmt: skip
    with torch.no_grad():
        assert key_chunk(q, keys, values, mask, 0.0) == 1024
        got = split_keys_attention(q, keys, values, mask, None, 1024)
        base = _whole(q, keys, values, mask)
    assert_within_convention([got.cpu()], [base.cpu()], [want], names=("out",))


def test_sdpa_split_keys_is_an_option():
    assert repr(SdpaBackend()) == "SdpaBackend()"
    assert repr(SdpaBackend(split_keys=False)) == "SdpaBackend(split_keys=False)"
    with pytest.raises(TypeError, match="split_keys must be True or False, got 'no'"):
        SdpaBackend(split_keys="no")
