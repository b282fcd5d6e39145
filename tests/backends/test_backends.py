"""Every registry variant on every backend that claims it matches the reference: output and the
gradients of q, k and v, causal or not, padded or not, self- and cross-attention, at lengths that
are and are not multiples of the block size."""

from __future__ import annotations

import pytest
import torch
from helpers import (
    SELF_CONTAINED_VARIANTS,
    assert_within_convention,
    check_against_reference,
    gpu,
    outputs_and_grads,
    padding_mask,
    random_qkv,
    small_params,
)
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import zoo
from zoo.backends import BlockedBackend, FlexBackend

SHAPES = [(96, 96), (100, 100), (70, 100), (100, 70)]  # 96 divides by 16 and 32; 100 and 70 do not
BACKENDS = {
    "blocked-16": BlockedBackend(block_size=16),
    "blocked-64": BlockedBackend(),
    "sdpa": "sdpa",
}
VARIANTS = SELF_CONTAINED_VARIANTS


@pytest.mark.parametrize("q_len,kv_len", SHAPES)
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("variant", VARIANTS)
def test_backend_matches_reference(variant, backend, causal, padded, q_len, kv_len):
    check_against_reference(
        variant, BACKENDS[backend], q_len=q_len, kv_len=kv_len, causal=causal, padded=padded
    )


@pytest.mark.parametrize("q_len,kv_len", [(100, 100), (70, 100)])
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_blocked_merged_path_matches_reference(variant, causal, padded, q_len, kv_len):
    """The blocked backend's CPU path for one head size in q, k and v (``merged``, what
    models run on a CPU): its sources and parts merge by log-sum-exp. The test above, with values
    narrower than keys, takes the fused and explicit paths (those of CUDA)."""
    check_against_reference(
        variant, BACKENDS["blocked-16"], q_len=q_len, kv_len=kv_len, causal=causal,
        padded=padded, v_dim=16,
    )  # fmt: skip


# Eager flex costs ~0.3 s a case (FlexAttention traces each new mask_mod with dynamo), so padding
# meets one shape each: self-attention padded, cross-attention (fewer queries) unpadded; the
# compiled kernel runs padded cross-attention (test_flex.py).
@pytest.mark.parametrize(
    "padded,q_len,kv_len", [(True, 100, 100), (False, 70, 100)], ids=["padded", "cross"]
)
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_flex_forward_matches_reference(variant, causal, padded, q_len, kv_len):
    """FlexAttention's eager path with our BlockMask and mask_mod (forward: CPU has no backward).
    The compiled kernel is tested in test_flex.py."""
    backend = FlexBackend(block_size=16, compile=False)
    check_against_reference(
        variant, backend, q_len=q_len, kv_len=kv_len, causal=causal, padded=padded, grads=False
    )


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("backend", ["reference", "sdpa", "blocked"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_empty_batch_gives_empty_output_and_gradients(variant, backend, causal):
    """No sequences (a batch that a loader or a generation step left empty), as SDPA takes
    them: an empty output and empty gradients, not a crash in a backend's plan."""
    q, k, v = (torch.randn(0, 2, 40, 16, requires_grad=True) for _ in range(3))
    out = zoo.attention(
        q, k, v, variant=variant, backend=backend, causal=causal, **small_params(variant)
    )
    assert out.shape == (0, 2, 40, 16)
    out.sum().backward()
    assert all(t.grad is not None and t.grad.shape == t.shape for t in (q, k, v))


@pytest.mark.parametrize("variant", ["full", "local", "strided", "bigbird"])
def test_registry_defaults_match_reference(variant):
    """The registry's own parameters (windows of 128, blocks of 64), at a length where they are
    sparse."""
    check_against_reference(variant, "blocked", q_len=300, kv_len=300, padded=True, params={})


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_additive_score_blocked_matches_reference(variant, causal, padded):
    q, k, v = random_qkv(2, 2, 90, 90)
    key_padding = padding_mask(2, 90) if padded else None
    params = small_params(variant)
    score = zoo.AdditiveScore(num_heads=2, head_dim=16, hidden=8)
    grad_out = torch.randn(2, 2, 90, 16, generator=torch.Generator().manual_seed(2))

    def run(backend):
        def fn(q, k, v, *weights):
            return zoo.attention(
                q,
                k,
                v,
                variant=variant,
                backend=backend,
                causal=causal,
                key_padding_mask=key_padding,
                score=score,
                **params,
            )

        return fn

    tensors = [q, k, v, *score.parameters()]
    oracle_inputs = [t.detach().double().requires_grad_() for t in (q, k, v)]
    oracle = outputs_and_grads(run("reference"), oracle_inputs, grad_out.double())
    baseline = outputs_and_grads(run("reference"), [q, k, v], grad_out)
    got = outputs_and_grads(run(BlockedBackend(block_size=16)), [q, k, v], grad_out)
    assert_within_convention(got, baseline, oracle)
    # The score's own weights get the same gradients from both backends.
    w_ref = torch.autograd.grad(run("reference")(*tensors[:3]), list(score.parameters()), grad_out)
    w_blk = torch.autograd.grad(
        run(BlockedBackend(block_size=16))(*tensors[:3]), list(score.parameters()), grad_out
    )
    for a, b in zip(w_ref, w_blk, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend", ["reference", "sdpa", "blocked"])
def test_dropout_is_unbiased_and_random(backend):
    """Dropout on the weights: two draws differ; their mean approaches the dropout-free output."""
    q, k, v = (t.detach() for t in random_qkv(1, 2, 64, 64))
    kwargs = dict(variant="local", backend=backend, window_size=7)
    clean = zoo.attention(q, k, v, **kwargs)
    torch.manual_seed(0)
    draws = torch.stack([zoo.attention(q, k, v, dropout_p=0.3, **kwargs) for _ in range(200)])
    assert not torch.equal(draws[0], draws[1])
    assert (draws.mean(0) - clean).abs().mean() < 0.1 * clean.abs().mean()
    assert (draws[0] - clean).abs().mean() > 0.1 * clean.abs().mean()


def test_bfloat16_blocked_matches_reference():
    """Low precision on CPU: the convention's baseline is PyTorch attention in bfloat16."""
    backend = BlockedBackend(block_size=16)
    check_against_reference("longformer", backend, q_len=100, kv_len=100, dtype=torch.bfloat16)


def _forbid_dense_masks(monkeypatch) -> None:
    def no_mask(call):
        raise AssertionError("the sdpa backend built a dense mask")

    monkeypatch.setattr(zoo.backends.sdpa, "attention_mask", no_mask)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("q_len,kv_len", [(70, 100), (1, 37), (64, 65)])
def test_sdpa_causal_with_fewer_queries_builds_no_mask(monkeypatch, q_len, kv_len, kv_heads, dtype):
    """Causal attention of the last q_len of kv_len positions (a sharded causal call's, chunked
    prefill's) runs on sdpa without a q_len x kv_len mask, and matches the reference forward and
    backward, grouped heads included (v with q's head size: the CPU kernel takes one)."""
    _forbid_dense_masks(monkeypatch)
    check_against_reference(
        "causal", "sdpa", q_len=q_len, kv_len=kv_len, causal=True, v_dim=16, heads=4,
        kv_heads=kv_heads, dtype=dtype,
    )  # fmt: skip


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_gpu_sdpa_causal_with_fewer_queries_builds_no_mask(monkeypatch, kv_heads, dtype):
    """The same on a GPU, through ``causal_lower_right`` (FlashAttention or the efficient
    kernel, bottom-right aligned)."""
    _forbid_dense_masks(monkeypatch)
    check_against_reference(
        "causal", "sdpa", q_len=200, kv_len=300, causal=True, head_dim=64, v_dim=64, heads=4,
        kv_heads=kv_heads, dtype=dtype, device="cuda",
    )  # fmt: skip


class _PairPasses(TorchDispatchMode):
    """The operations dispatched on a tensor of (Lq, Lk) trailing dims, views left out: passes
    over a mask."""

    def __init__(self, q_len: int, kv_len: int) -> None:
        super().__init__()
        self.pairs, self.ops = (q_len, kv_len), []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        grids = [a for a in tree_leaves(args) if isinstance(a, torch.Tensor) and a.dim() >= 2]
        if not func.is_view and any(tuple(a.shape[-2:]) == self.pairs for a in grids):
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("q_len,kv_len", [(96, 96), (100, 70)])
def test_sdpa_guards_rows_without_a_key_only_where_there_can_be_one(monkeypatch, q_len, kv_len):
    """SDPA gives NaN for a row with no allowed key, so sdpa lets such rows see every key and
    zeroes them after: passes over the (Lq, Lk) mask each call. A fixed pattern that gives
    every row a key at the shape (local at 96 x 96) makes none; padding, a pattern chosen by
    content (MoBA) or a shape that leaves rows without a key (queries past the keys) keep the
    guard. The values are the reference's (the registry tests); here, which calls make the
    guard's pass (SDPA stubbed)."""

    def stub(q, k, v, **kwargs):
        return q.new_zeros(*q.shape[:-1], v.shape[-1])

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", stub)
    q, k, v = random_qkv(2, 2, q_len, kv_len)

    def guarded(variant: str, **kwargs) -> bool:
        zoo.attention(q, k, v, variant=variant, backend="sdpa", **kwargs)  # its shape's masks
        with _PairPasses(q_len, kv_len) as seen:
            zoo.attention(q, k, v, variant=variant, backend="sdpa", **kwargs)
        return "aten.any.dim" in seen.ops

    assert guarded("local", window_size=7) == (q_len > kv_len)
    assert guarded("local", window_size=7, key_padding_mask=padding_mask(2, kv_len))
    assert guarded("moba", **small_params("moba"))
