"""The CUDA paths on a machine without a GPU: every variant on every backend with fake CUDA tensors
(``zoo.testing.fake_cuda``), so that a cpu/cuda mix or a shape a CUDA kernel refuses shows in CI,
not first on a GPU. Fake tensors carry shapes and devices only: these tests check that the CUDA
path runs and where its tensors live; the values are checked on the GPU (``gpu`` tests).

Inputs require grad where torch can record autograd on fake CUDA tensors: always on a CUDA build
of torch; on a CPU-only build, not through FlexAttention, whose forward traces its backward
(which torch cannot run there). The autograd functions' forwards of blocked and sdpa, where a
backward's device mix would be built, run with grad everywhere.
"""

from __future__ import annotations

import pytest
import torch
from helpers import SELF_CONTAINED_VARIANTS, small_params

import zoo
from zoo.backends import flex_kernel
from zoo.backends.flex_kernel import run_kernel
from zoo.testing.fake_cuda import FakeCudaUnavailable, fake_cuda

try:
    with fake_cuda():
        pass
except FakeCudaUnavailable as error:  # no C++ compiler on a CPU-only build
    pytest.skip(str(error), allow_module_level=True)

HEADS = [8, 16, 24, 64, 128]
BACKENDS = ["auto", "flex", "blocked", "sdpa"]


def _grad_recorded(backend: str) -> bool:
    return torch.backends.cuda.is_built() or backend in ("blocked", "sdpa")


@pytest.mark.parametrize("head", HEADS)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", SELF_CONTAINED_VARIANTS)
def test_every_variant_runs_its_cuda_path_on_fake_cuda_tensors(variant, backend, head):
    """Forward on fake CUDA tensors: grouped heads, a value head of another size, a length that is
    no multiple of any block, fewer queries than keys; causal and padded in turn by head size."""
    causal, padded = head in (8, 24, 128), head in (16, 24)
    grad = _grad_recorded(backend)
    with fake_cuda():
        q = torch.randn(2, 4, 150, head, device="cuda", requires_grad=grad)
        k = torch.randn(2, 2, 200, head, device="cuda", requires_grad=grad)
        v = torch.randn(2, 2, 200, max(head // 2, 1), device="cuda", requires_grad=grad)
        padding = torch.zeros(2, 200, dtype=torch.bool, device="cuda") if padded else None
        out = zoo.attention(
            q, k, v, variant=variant, backend=backend, causal=causal, key_padding_mask=padding,
            **small_params(variant),
        )  # fmt: skip
    assert out.device.type == "cuda"
    assert out.shape == (2, 4, 150, v.shape[-1])
    assert out.requires_grad == grad


@pytest.mark.parametrize("variant", ["local", "bigbird", "moba", "neighborhood_2d"])
def test_flex_hands_its_cuda_kernel_heads_of_at_least_16(variant, monkeypatch):
    """Inductor's CUDA lowering of FlexAttention refuses heads under 16 (tl.dot's least): the
    backend pads q/k and v with zeros on CUDA, and says so in explain."""
    seen = []

    def kernel(q, k, v, **kwargs):
        seen.append((q.shape[-1], k.shape[-1], v.shape[-1], kwargs["scale"]))
        return torch.empty(*q.shape[:-1], v.shape[-1], device=q.device, dtype=q.dtype)

    monkeypatch.setattr(flex_kernel, "_kernel", lambda *args: kernel)
    with fake_cuda():
        q = torch.randn(1, 2, 100, 8, device="cuda")
        v = torch.randn(1, 2, 100, 4, device="cuda")
        out = zoo.attention(q, q, v, variant=variant, backend="flex", **small_params(variant))
        said = zoo.explain(q, q, v, variant=variant, **small_params(variant))
    assert seen == [(16, 16, 16, pytest.approx(8**-0.5))]  # the scale stays the true head's
    assert out.shape == (1, 2, 100, 4)
    assert "auto -> flex" in said
    assert "pads q/k head size 8 and v head size 4 with zeros to 16" in said


def test_explain_says_nothing_of_padding_where_heads_are_large_enough():
    with fake_cuda():
        q = torch.randn(1, 2, 100, 64, device="cuda")
        said = zoo.explain(q, q, q, variant="local", window_size=7)
    assert "auto -> flex" in said and "pads" not in said


def test_explain_counts_flexs_full_and_partial_blocks():
    """Where auto takes flex, explain says how many of its blocks are partial (the mask_mod runs
    per element there): block_local of 128 on whole blocks has none, BigBird of 64 mostly."""
    with fake_cuda():
        q = torch.randn(1, 2, 1024, 64, device="cuda")
        aligned = zoo.explain(q, q, q, variant="block_local", block_size=128)
        bigbird = zoo.explain(q, q, q, variant="bigbird", block_size=64)
    assert "flex block mask of 128: 8 full and 0 partial of 64 blocks" in aligned, aligned
    assert "auto -> flex" in bigbird and " partial of 64 blocks" in bigbird, bigbird
    assert " and 0 partial" not in bigbird


def test_zero_padded_heads_leave_output_and_gradients_unchanged(monkeypatch):
    """The padding itself, where values exist: q/k of 8 and v of 4 padded to 16 give the
    unpadded call's output and gradients (a dense kernel stands in for FlexAttention, which has
    no backward on a CPU)."""

    def dense(q, k, v, *, block_mask=None, scale=None):
        scores = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
        return torch.softmax(scores, dim=-1) @ v

    monkeypatch.setattr(flex_kernel, "_kernel", lambda *args: dense)
    tensors = [torch.randn(1, 2, 64, d, dtype=torch.float64, requires_grad=True) for d in (8, 8, 4)]
    grad_out = torch.randn(1, 2, 64, 4, dtype=torch.float64)
    results = []
    for least in (None, 16):
        out = run_kernel(False, least, *tensors)
        results.append([out, *torch.autograd.grad(out, tensors, grad_out)])
    for plain, padded in zip(*results, strict=True):
        torch.testing.assert_close(padded, plain, rtol=0, atol=1e-12)


NSA_SMALL = dict(block_length=8, block_stride=4, select_block=8, window=8)


@pytest.mark.parametrize("length", [5, 100])
@pytest.mark.parametrize("variant", ["sliding_window", "bigbird", "moba", "neighborhood_2d", "nsa"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_the_module_runs_its_cuda_path_on_fake_cuda_tensors(variant, backend, length):
    """A layer built on the CUDA device under a fake mode (as meta-device initialisation and
    torch.export on a CPU build machine make it), with padding, rope and grouped heads. The call
    runs outside ``torch.device("cuda")``, as a model's forward does: under it a tensor made with
    no device lands on CUDA and hides a CPU one (NSA chose its blocks on the CPU for a sequence
    shorter than one compression block)."""
    if variant == "neighborhood_2d" and length == 5:
        pytest.skip("a grid of 5 tokens: neighborhood_2d fits no 2-D grid at a prime length")
    grad = _grad_recorded(backend)
    params = NSA_SMALL if variant == "nsa" else {"pos": "rope", **small_params(variant)}
    if variant != "nsa":
        params["causal"] = True  # nsa is causal by definition, with no such option
    with fake_cuda(), torch.set_grad_enabled(grad):
        with torch.device("cuda"):
            attn = zoo.create_attention(
                variant, dim=64, num_heads=4, num_kv_heads=2, backend=backend, **params
            )
            x, valid_lens = torch.randn(2, length, 64), torch.tensor([length, 3])
        y = attn(x, valid_lens=valid_lens)
    assert y.device.type == "cuda" and y.shape == (2, length, 64)


@pytest.fixture
def fake_ranks(monkeypatch):
    """Rank 1 of a fake process group of 4 (its collectives do nothing): one process runs one
    rank's whole sharded call. The ranks' agreement on the call is taken as given."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)

    def agreed(out, obj, group=None):
        out[:] = [obj] * len(out)

    monkeypatch.setattr(dist, "all_gather_object", agreed)
    yield dist.group.WORLD
    dist.destroy_process_group()


SHARDED = ["sliding_window", "longformer", "bigbird", "causal", "full", "strided"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_sharded_call_runs_its_cuda_path_on_fake_cuda_tensors(backend, fake_ranks):
    """Context parallelism's rank path (plans, exchange, calls at global positions, the joined
    output) on fake CUDA tensors; a choice by content, planned from the data, says it cannot."""
    grad = _grad_recorded(backend)
    for variant in SHARDED:
        causal = variant != "full"
        with fake_cuda():
            q = torch.randn(1, 4, 64, 16, device="cuda", requires_grad=grad)
            k = torch.randn(1, 2, 64, 16, device="cuda", requires_grad=grad)
            out = zoo.attention(
                q, k, k, variant=variant, backend=backend, causal=causal, cp_group=fake_ranks,
                **small_params(variant),
            )  # fmt: skip
        assert out.device.type == "cuda" and out.shape == (1, 4, 64, 16), variant
    with fake_cuda(), pytest.raises(ValueError, match="chooses its blocks by content: sharded"):
        q = torch.randn(1, 4, 64, 16, device="cuda")
        zoo.attention(q, q, q, variant="moba", backend=backend, cp_group=fake_ranks, block_size=16)


def test_parts_in_their_own_orders_run_their_cuda_path_on_fake_cuda_tensors():
    """strided with its band on flex, each part in its own order merged by log-sum-exp, on fake
    CUDA tensors: padding, alibi, causal; the output on the call's device and dtype."""
    from zoo.backends import get_backend
    from zoo.functional import prepare_call

    params = {"stride": 16, "window_size": 15}
    with fake_cuda():
        q = torch.randn(2, 4, 4000, 64, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(2, 2, 4000, 64, device="cuda", dtype=torch.bfloat16)
        padding = torch.zeros(2, 4000, dtype=torch.bool, device="cuda")
        call = prepare_call(q, k, k, variant="strided", key_padding_mask=padding, **params)
        assert get_backend("flex").own_orders(call) is not None
        for options in ({"key_padding_mask": padding}, {"pos": "alibi", "causal": True}):
            out = zoo.attention(q, k, k, variant="strided", backend="flex", **params, **options)
            assert (out.shape, out.device.type, out.dtype) == (q.shape, "cuda", torch.bfloat16)


@pytest.mark.parametrize("pos", ["alibi", "t5"])
def test_an_encoding_left_on_the_cpu_is_named_on_the_cuda_path(pos):
    """An ALiBi or T5 instance built on the CPU with CUDA q, k, v: explain said the call ran, and
    the call failed inside torch indexing the CPU table with CUDA positions (found by review).
    Now both say where the encoding's tensors are and how to move them; ALiBi, which has no
    learned table, may be given by name instead."""
    encoding = zoo.build_encoding(pos, dim=32, num_heads=2)
    with fake_cuda():
        q = torch.randn(1, 2, 100, 16, device="cuda")
        for run in (zoo.attention, zoo.explain):
            said = r"pos \(\w+\) holds its tensors on cpu, q is on cuda:0; move it there"
            with pytest.raises(ValueError, match=said) as error:
                run(q, q, q, variant="local", window_size=7, pos=encoding)
            assert ("pass its name (pos='alibi')" in str(error.value)) == (pos == "alibi")


READ_MODS: list = []  # the block masks whose mask_mod the kernel below evaluated


def _kernel_reading_the_mods(*args):
    """A flex kernel that evaluates the block mask's mask_mod and the score_mod on index tensors
    on q's device, and checks where the block mask lives: flex's own kernel on fake tensors
    returns an output of the right shape without calling either, so a table on the CPU read by
    a mod (a device mix a GPU would refuse) passed unseen (found by review)."""

    def kernel(q, k, v, score_mod=None, block_mask=None, return_aux=None, return_lse=False, **kw):
        (batch, heads, rows, _), cols, device = q.shape, k.shape[2], q.device
        shapes = ((-1, 1, 1, 1), (1, -1, 1, 1), (1, 1, -1, 1), (1, 1, 1, -1))
        sizes = (batch, heads, rows, cols)
        b, h, i, j = (torch.arange(n, device=device).view(shape)
                      for n, shape in zip(sizes, shapes, strict=True))  # fmt: skip
        if block_mask is not None:
            for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
                held = getattr(block_mask, name)
                assert held is None or held.device == device, f"block_mask.{name} on {held.device}"
            assert block_mask.mask_mod(b, h, i, j).device == device
            READ_MODS.append(block_mask)
        if score_mod is not None:
            scores = torch.zeros(batch, heads, rows, cols, device=device)
            assert score_mod(scores, b, h, i, j).device == device
        out = q.new_empty(batch, heads, rows, v.shape[-1])
        lse = q.new_empty(batch, heads, rows, dtype=torch.float32)
        return (out, lse) if return_aux is not None or return_lse else out

    return kernel


@pytest.mark.parametrize("pos, padded, causal", [(None, True, False), ("alibi", False, True),
                                                 ("t5", True, True)])  # fmt: skip
@pytest.mark.parametrize("variant", SELF_CONTAINED_VARIANTS)
def test_flexs_mask_and_score_functions_read_tensors_on_the_cuda_device(
    monkeypatch, variant, pos, padded, causal
):
    monkeypatch.setattr(flex_kernel, "_kernel", _kernel_reading_the_mods)
    if pos == "t5":  # a learned table, on the device by the caller
        pos = zoo.build_encoding("t5", dim=64, num_heads=4)
    with fake_cuda():
        q = torch.randn(2, 4, 300, 16, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(2, 2, 700, 16, device="cuda", dtype=torch.bfloat16)
        padding = torch.zeros(2, 700, dtype=torch.bool, device="cuda") if padded else None
        encoding = pos.to("cuda") if isinstance(pos, torch.nn.Module) else pos
        READ_MODS.clear()
        out = zoo.attention(q, k, k, variant=variant, backend="flex", causal=causal,
                            key_padding_mask=padding, pos=encoding,
                            **small_params(variant))  # fmt: skip
    assert out.device.type == "cuda" and out.shape == (2, 4, 300, 16)
    assert READ_MODS, "no block mask reached the kernel: nothing was checked"
