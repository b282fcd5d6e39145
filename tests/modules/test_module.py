"""zoo.MultiHeadAttention and zoo.create_attention."""

from __future__ import annotations

import pytest
import torch
from helpers import SELF_CONTAINED_VARIANTS, small_params

import zoo


@pytest.mark.parametrize("variant", SELF_CONTAINED_VARIANTS)
def test_every_variant_builds_runs_and_trains(variant):
    attn = zoo.create_attention(variant, dim=32, num_heads=4, **small_params(variant))
    x = torch.randn(2, 100, 32, requires_grad=True)
    y = attn(x, key_padding_mask=torch.arange(100)[None, :] >= torch.tensor([[100], [60]]))
    assert y.shape == (2, 100, 32) and torch.isfinite(y).all()
    y.square().mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in attn.parameters())


def test_the_quick_start_snippet():
    attn = zoo.create_attention("bigbird", dim=512, num_heads=8)
    x = torch.randn(2, 300, 512)
    pad = torch.zeros(2, 300, dtype=torch.bool)
    pad[1, 200:] = True
    assert attn(x, key_padding_mask=pad).shape == (2, 300, 512)
    q = torch.randn(1, 4, 300, 32)
    assert zoo.attention(q, q, q, variant="longformer", causal=True).shape == (1, 4, 300, 32)


def test_full_variant_equals_torch_multihead_attention():
    """Projections and the head split match nn.MultiheadAttention with the same weights, at
    every real position (a padded position of x is read as zeros, its own query too)."""
    ours = zoo.MultiHeadAttention(32, 4, variant="full")
    theirs = torch.nn.MultiheadAttention(32, 4, batch_first=True)
    with torch.no_grad():
        theirs.in_proj_weight.copy_(
            torch.cat([ours.q_proj.weight, ours.k_proj.weight, ours.v_proj.weight])
        )
        theirs.in_proj_bias.copy_(torch.cat([ours.q_proj.bias, ours.k_proj.bias, ours.v_proj.bias]))
        theirs.out_proj.weight.copy_(ours.out_proj.weight)
        theirs.out_proj.bias.copy_(ours.out_proj.bias)
    x = torch.randn(2, 20, 32)
    pad = torch.zeros(2, 20, dtype=torch.bool)
    pad[1, 15:] = True
    expected, _ = theirs(x, x, x, key_padding_mask=pad)
    got = ours(x, key_padding_mask=pad)
    torch.testing.assert_close(got[~pad], expected[~pad], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours(x), theirs(x, x, x)[0], rtol=1e-5, atol=1e-5)


def test_cross_attention_with_another_width_and_length():
    attn = zoo.MultiHeadAttention(
        32, 4, variant="local", window_size=3, kv_dim=24, backend="blocked"
    )
    x, context = torch.randn(2, 10, 32), torch.randn(2, 30, 24)
    y, weights = attn(x, context=context, return_weights=True)
    assert y.shape == (2, 10, 32) and weights.shape == (2, 4, 10, 30)
    # Queries sit at the context's last 10 positions (20..29): query 0 sees keys 17..23.
    assert (weights[0, 0, 0] > 0).nonzero().flatten().tolist() == list(range(17, 24))
    torch.testing.assert_close(
        attn(x, context=context), y
    )  # weights come from the reference backend


def test_a_cross_attention_module_called_without_context_says_so():
    """kv_dim != dim: self-attention had reported "context must have shape (2, kv_len, 24)"
    for a call without context, and a cached call "mat1 and mat2 shapes cannot be multiplied"."""
    attn = zoo.MultiHeadAttention(32, 4, kv_dim=24, causal=True)
    x = torch.randn(2, 10, 32)
    message = r"reads keys and values from context \(kv_dim=24\).*dim=32"
    with pytest.raises(ValueError, match=message):
        attn(x)
    with pytest.raises(ValueError, match=message):
        attn(x, cache=attn.new_cache(2, 16))


def test_valid_lens_equals_the_padding_mask():
    attn = zoo.create_attention("longformer", dim=32, num_heads=2, window_size=4)
    x = torch.randn(3, 50, 32)
    lens = torch.tensor([50, 20, 1])
    pad = torch.arange(50)[None, :] >= lens[:, None]
    torch.testing.assert_close(attn(x, valid_lens=lens), attn(x, key_padding_mask=pad))


def test_weights_are_a_distribution_over_allowed_keys():
    attn = zoo.create_attention("strided", dim=32, num_heads=2, stride=5, window_size=1)
    _, weights = attn(torch.randn(1, 40, 32), return_weights=True)
    allowed = zoo.dense_mask("strided", 40, stride=5, window_size=1)
    assert torch.allclose(weights.sum(-1), torch.ones(1, 2, 40))
    assert weights[..., ~allowed].abs().max() == 0


def test_projection_bias_can_be_turned_off():
    attn = zoo.MultiHeadAttention(32, 4, bias=False)
    assert all(
        layer.bias is None for layer in (attn.q_proj, attn.k_proj, attn.v_proj, attn.out_proj)
    )


def test_additive_score_runs_sparse_on_auto():
    attn = zoo.create_attention("local", dim=32, num_heads=4, window_size=3, score="additive")
    x = torch.randn(2, 30, 32, requires_grad=True)
    y = attn(x)
    y.sum().backward()
    assert attn.score.w_v.grad is not None and attn.score.w_v.grad.abs().sum() > 0
    _, weights = attn(x, return_weights=True)
    assert weights[0, 0, 10, :7].sum() == 0 and weights[0, 0, 10, 7:14].sum() > 0.99


def test_dropout_only_in_training():
    attn = zoo.create_attention("local", dim=32, num_heads=2, window_size=4, dropout=0.5)
    x = torch.randn(1, 30, 32)
    attn.eval()
    torch.testing.assert_close(attn(x), attn(x))
    attn.train()
    assert not torch.equal(attn(x), attn(x))


def test_module_options_and_pattern_parameters_mix_in_create_attention():
    attn = zoo.create_attention(
        "sliding_window", dim=16, num_heads=2, window_size=2, bias=False, backend="reference"
    )
    _, weights = attn(torch.randn(1, 8, 16), return_weights=True)
    assert (weights[0, 0] > 0).sum(1).tolist() == [1, 2, 3, 3, 3, 3, 3, 3]
    assert "window_size=2" in repr(attn)


@pytest.mark.parametrize(
    ("pos", "sizes", "message"),
    [
        (
            "alibi",
            dict(dim=64, num_heads=8),
            "was built for 8 heads, but the module has num_heads=4",
        ),
        ("t5", dict(dim=32, num_heads=2), "was built for 2 heads, but the module has num_heads=4"),
        (
            "sinusoidal",
            dict(dim=16, num_heads=4),
            "was built for dim=16, but the module has dim=32",
        ),
    ],
)
def test_an_encoding_built_for_other_sizes_is_refused_when_the_module_is_built(pos, sizes, message):
    """A cached step had used a bias for 8 heads on 4 (its first 4 slopes, silently) or failed
    with an IndexError; the uncached call refused it at every forward."""
    encoding = zoo.build_encoding(pos, **sizes)
    with pytest.raises(ValueError, match=message):
        zoo.MultiHeadAttention(32, 4, pos=encoding, causal=True)


@pytest.mark.parametrize("cross", [False, True])
def test_padding_holding_nan_leaves_every_gradient_finite(cross):
    """Padding may hold anything: the projections' weight gradients sum their input over every
    position, so NaN at a padded one made them all NaN (0 * NaN), as in a cached prefill it
    did not. The real rows are unchanged."""
    torch.manual_seed(0)
    module = zoo.MultiHeadAttention(
        16, 2, variant="local", window_size=3, kv_dim=8 if cross else None
    )
    x = torch.randn(2, 7, 16)
    source = torch.randn(2, 9, 8) if cross else x
    lens = torch.tensor([source.shape[1], 4])
    context = {"context": source} if cross else {}
    want = module(x, valid_lens=lens, **context).detach()
    source[1, 4:] = float("nan")
    out = module(x, valid_lens=lens, **context)
    real = slice(None) if cross else slice(0, 4)
    torch.testing.assert_close(out[:, real], want[:, real], rtol=0, atol=1e-6)
    out[:, real].sum().backward()
    for name, parameter in module.named_parameters():
        assert parameter.grad.isfinite().all(), name


def test_positions_that_are_not_an_integer_tensor_are_refused_naming_them():
    module = zoo.MultiHeadAttention(16, 2, causal=True)
    cache = module.new_cache(1, 8)
    x = torch.randn(1, 2, 16)
    for positions, shown in (([[0, 1]], "list"), (torch.tensor([[False, True]]), "torch.bool")):
        with pytest.raises(TypeError, match=f"positions must be an integer tensor .*got .*{shown}"):
            module(x, cache=cache, positions=positions)
    module(x, cache=cache, positions=torch.tensor([[0, 1]]))  # the same call, rightly typed
