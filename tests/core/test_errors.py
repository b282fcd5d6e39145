"""Bad input gets an error that names the argument, the value and what was expected."""

from __future__ import annotations

import warnings

import pytest
import torch

import zoo


def qkv(*shapes, dtype=torch.float32):
    return [torch.randn(*s, dtype=dtype) for s in shapes]


GOOD = [(2, 4, 16, 8)] * 3


@pytest.mark.parametrize(
    "kwargs,error,message",
    [
        (dict(variant="bigbrid"), ValueError, r"unknown variant 'bigbrid'; did you mean 'bigbird'"),
        (
            dict(variant="local", windowsize=3),
            TypeError,
            r"no parameter 'windowsize' \(its parameters: window_size\)",
        ),
        (dict(variant="local", window_size="3"), TypeError, r"window_size must be an int, got '3'"),
        (
            dict(variant="local", window_size=-1),
            ValueError,
            r"window_size must be at least 0, got -1",
        ),
        (
            dict(variant="block_local", block_size=0),
            ValueError,
            r"block_size must be positive, got 0",
        ),
        (dict(variant="strided", stride=2.5), TypeError, r"stride must be an int, got 2.5"),
        (
            dict(variant="global", global_tokens=[40]),
            ValueError,
            r"global position at 40, beyond the 16 keys",
        ),
        (
            dict(variant="full", backend="flesh"),
            ValueError,
            r"unknown backend 'flesh'; did you mean 'flex'",
        ),
        (dict(variant="full", scale=0), ValueError, r"scale must be a positive number or None"),
        (
            dict(variant="full", dropout_p=1.5),
            ValueError,
            r"dropout_p must be a number in \[0, 1\), got 1.5",
        ),
        (dict(variant="full", causal="yes"), TypeError, r"causal must be True or False, got 'yes'"),
        (
            dict(variant="full", key_padding_mask=torch.zeros(2, 15, dtype=torch.bool)),
            ValueError,
            r"key_padding_mask must have shape \(batch, kv_len\) = \(2, 16\), got \(2, 15\)",
        ),
        (
            dict(variant="full", key_padding_mask=torch.zeros(2, 16)),
            TypeError,
            r"key_padding_mask must be a bool tensor",
        ),
        # a listed run of global positions past the keys: before, only its start was checked
        (
            dict(variant="longformer", global_tokens=[15, 16, 17]),
            ValueError,
            r"global position at 17, beyond the 16 keys",
        ),
        (dict(variant="full", backend=3), TypeError, r"backend must be 'auto', a name .* got 3"),
        (
            dict(variant="full", return_weights="no"),
            TypeError,
            r"return_weights must be True or False, got 'no'",
        ),
        (
            dict(variant="full", score="additive"),
            TypeError,
            r"score must be a zoo.core.scores.AdditiveScore .* got 'additive' \(str\)",
        ),
        (
            dict(variant="full", score=zoo.core.scores.AdditiveScore(2, 8)),
            ValueError,
            r"AdditiveScore for 2 heads of size 8, but q has 4 heads of size 8",
        ),
        (
            dict(variant="full", score=zoo.core.scores.AdditiveScore(4, 8), scale=0.5),
            ValueError,
            r"scale=0.5 scales dot-product scores; .* leave scale=None",
        ),
        (
            dict(variant="axial_2d"),
            ValueError,
            r"grid=None: 17 keys make no grid of more than one row",
        ),
    ],
)
def test_bad_arguments(kwargs, error, message):
    if kwargs.get("variant") == "axial_2d":  # a prime length
        with pytest.raises(error, match=message):
            zoo.attention(*qkv(*[(2, 4, 17, 8)] * 3), **kwargs)
        zoo.attention(*qkv(*[(2, 4, 17, 8)] * 3), variant="axial_2d", grid=(1, 17))  # on purpose
        return
    with pytest.raises(error, match=message):
        zoo.attention(*qkv(*GOOD), **kwargs)


@pytest.mark.parametrize(
    "shapes,message",
    [
        (
            [(2, 4, 16, 8), (3, 4, 16, 8), (3, 4, 16, 8)],
            r"must agree in batch \(dim 0\), got shapes \(2, 4, 16, 8\), \(3, 4, 16, 8\)",
        ),
        ([(2, 4, 16, 8), (2, 3, 16, 8), (2, 3, 16, 8)], r"q has 4 heads, k and v have 3"),
        ([(2, 4, 16, 8), (2, 2, 16, 8), (2, 1, 16, 8)], r"k and v must have the same number"),
        ([(2, 4, 16, 8), (2, 4, 16, 4), (2, 4, 16, 8)], r"q and k must have the same head_dim"),
        ([(2, 4, 16, 8), (2, 4, 16, 8), (2, 4, 12, 8)], r"k and v must have the same length"),
        (
            [(2, 16, 8), (2, 16, 8), (2, 16, 8)],
            r"q must have 4 dimensions \(batch, heads, length, head_dim\), got shape \(2, 16, 8\)",
        ),
        ([(2, 4, 0, 8), (2, 4, 16, 8), (2, 4, 16, 8)], r"need at least one position"),
        ([(2, 0, 16, 8), (2, 1, 16, 8), (2, 1, 16, 8)], r"need at least one head \(dim 1\)"),
    ],
)
def test_bad_shapes(shapes, message):
    with pytest.raises(ValueError, match=message):
        zoo.attention(*qkv(*shapes), variant="full")


def test_dtypes_that_do_not_agree():
    q, k, v = qkv(*GOOD)
    with pytest.raises(
        TypeError, match=r"share one dtype, got torch.float32, torch.float16 and torch.float32"
    ):
        zoo.attention(q, k.half(), v, variant="full")
    with pytest.raises(TypeError, match=r"k must be a floating-point tensor"):
        zoo.attention(q, k.long(), v, variant="full")


def test_a_backend_that_cannot_run_the_call_names_those_that_can():
    q, k, v = qkv(*GOOD)
    score = zoo.AdditiveScore(4, 8)
    with pytest.raises(
        ValueError,
        match=r"backend 'sdpa' cannot run this call: it computes dot scores, not additive; "
        r"backends that can: blocked, reference",
    ):
        zoo.attention(q, k, v, variant="local", backend="sdpa", score=score)
    with pytest.raises(
        ValueError,
        match=r"backend 'blocked' cannot run this call: it does not return attention weights; "
        r"backends that can: reference",
    ):
        zoo.attention(q, k, v, variant="local", backend="blocked", return_weights=True)
    with pytest.raises(
        ValueError,
        match=r"backend 'flex' cannot run this call: "
        r"it takes float32, bfloat16, float16, not float64",
    ):
        zoo.attention(*qkv(*GOOD, dtype=torch.float64), variant="local", backend="flex")


@pytest.mark.parametrize(
    "args,kwargs,error,message",
    [
        ((30, 4), {}, ValueError, r"num_heads \(4\) must divide dim \(30\)"),
        ((32, 0), {}, ValueError, r"num_heads must be positive, got 0"),
        ((32, 4), dict(variant="bigbrid"), ValueError, r"did you mean 'bigbird'"),
        ((32, 4), dict(variant="local", window=3), TypeError, r"no parameter 'window'"),
        (
            (32, 4),
            dict(score="multiplicative"),
            ValueError,
            r"score must be one of \('dot', 'additive'\)",
        ),
        ((32, 4), dict(dropout=-0.1), ValueError, r"dropout must be a number in \[0, 1\)"),
    ],
)
def test_bad_module_arguments(args, kwargs, error, message):
    with pytest.raises(error, match=message):
        zoo.MultiHeadAttention(*args, **kwargs)


def test_bad_forward_arguments():
    attn = zoo.MultiHeadAttention(32, 4, variant="local", window_size=2)
    x = torch.randn(2, 10, 32)
    with pytest.raises(
        ValueError, match=r"x must have shape \(batch, length, 32\), got \(2, 10, 31\)"
    ):
        attn(torch.randn(2, 10, 31))
    with pytest.raises(ValueError, match=r"valid_lens must lie in \[0, 10\]"):
        attn(x, valid_lens=torch.tensor([3, 11]))
    with pytest.raises(ValueError, match=r"give key_padding_mask or valid_lens, not both"):
        attn(
            x,
            valid_lens=torch.tensor([3, 4]),
            key_padding_mask=torch.zeros(2, 10, dtype=torch.bool),
        )
    with pytest.raises(ValueError, match=r"key_padding_mask must have shape"):
        attn(x, key_padding_mask=torch.zeros(2, 9, dtype=torch.bool))


def test_dense_mask_rejects_non_positive_lengths():
    with pytest.raises(ValueError, match=r"q_len must be a positive int, got 0"):
        zoo.dense_mask("local", 0)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(waste=-1.0), r"waste must be a number in \[0, 1\], got -1.0"),  # it hung
        (dict(waste="x"), r"waste must be a number in \[0, 1\], got 'x'"),
        (dict(compute_dtype=torch.int32), r"compute_dtype must be a floating torch.dtype"),
    ],
)
def test_bad_blocked_options_are_refused_when_made(kwargs, message):
    with pytest.raises(ValueError, match=message):
        zoo.backends.BlockedBackend(**kwargs)
    assert zoo.backends.BlockedBackend(waste=1).waste == 1.0  # one group: allowed


def test_global_tokens_by_count_are_the_first_ones_that_exist():
    """``global_tokens=n`` means the first n: a prompt shorter than n has fewer global keys (as
    the dense mask of the pattern restricted to its positions), not an error."""
    q, k, v = qkv(*[(1, 2, 3, 8)] * 3)
    out = zoo.attention(q, k, v, variant="longformer", global_tokens=4, window_size=1,
                        backend="reference")  # fmt: skip
    assert torch.allclose(out, zoo.attention(q, k, v, variant="full", backend="reference"))


def test_dense_mask_checks_causal_and_a_stray_graph():
    """``causal="no"`` was taken as True, and an edge_index for a variant that reads no graph
    gave one column of the mask."""
    with pytest.raises(TypeError, match="causal must be True or False, got 'no'"):
        zoo.dense_mask("local", 10, window_size=2, causal="no")
    edges = torch.tensor([[0, 1], [1, 0]])
    with pytest.raises(ValueError, match="variant 'local' reads no graph"):
        zoo.dense_mask("local", 4, window_size=1, edge_index=edges)


def test_allowed_pairs_names_what_it_takes():
    with pytest.raises(TypeError, match="allowed_pairs takes a zoo Pattern, got 'local'"):
        zoo.allowed_pairs("local", 10, 10)


def test_explain_explains_the_backend_it_is_given():
    """``explain(backend=...)`` says what that backend runs, or why it cannot (before, it said
    what auto would choose)."""
    q, k, v = qkv(*GOOD)
    said = zoo.explain(q, k, v, variant="local", window_size=2, backend="blocked")
    assert said.startswith("blocked, as named")
    q.requires_grad_(True)
    said = zoo.explain(q, k, v, variant="local", window_size=2, backend="flex")
    assert said.startswith("backend 'flex' cannot run this call: it has no backward pass on cpu")
    assert zoo.explain(q, k, v, variant="local", window_size=2).startswith("auto -> ")


def test_the_module_names_an_input_of_another_dtype():
    attn = zoo.create_attention("local", dim=16, num_heads=2, window_size=2)
    with pytest.raises(ValueError, match=r"x is torch.float64 but the module's parameters are"):
        attn(torch.randn(1, 8, 16, dtype=torch.float64))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast casts the projections' inputs
        assert attn(torch.randn(1, 8, 16, dtype=torch.bfloat16)).shape == (1, 8, 16)
    with warnings.catch_warnings():  # torch.ao.quantization is deprecated (torch 2.10 on)
        warnings.simplefilter("ignore")
        quantized = torch.ao.quantization.quantize_dynamic(attn, {torch.nn.Linear}, torch.qint8)
        assert quantized(torch.randn(1, 8, 16)).shape == (1, 8, 16)  # weight() a method: no check
