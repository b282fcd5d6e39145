"""The math of the positional encodings, checked against independent formulas and properties."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from zoo.positional import (
    ENCODINGS,
    AlibiEncoding,
    LearnedEncoding,
    RotaryEncoding,
    SinusoidalEncoding,
    T5RelativeBias,
    alibi_slopes,
    draw_encoding,
    relative_position_bucket,
)

BIAS_ENCODINGS = [
    pytest.param(AlibiEncoding, {}, id="alibi"),
    pytest.param(T5RelativeBias, {"causal": False}, id="t5-bidirectional"),
    pytest.param(T5RelativeBias, {"causal": True}, id="t5-causal"),
]


def grid(h: int, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Heads, query and key positions shaped (H,1,1), (1,Lq,1), (1,1,Lk)."""
    return torch.arange(h)[:, None, None], q[None, :, None], k[None, None, :]


# sinusoidal


@pytest.mark.parametrize(("dim", "base", "offset"), [(8, 1e4, 0), (17, 1e4, 37), (64, 100.0, 5000)])
def test_sinusoidal_table_is_the_formula(dim: int, base: float, offset: int) -> None:
    enc = SinusoidalEncoding(dim=dim, num_heads=1, base=base)
    pos = torch.arange(offset, offset + 50, dtype=torch.float64)
    expected = torch.empty(50, dim, dtype=torch.float64)
    for c in range(dim):
        w = base ** (-(c - c % 2) / dim)
        expected[:, c] = torch.sin(pos * w) if c % 2 == 0 else torch.cos(pos * w)
    got = enc.table(50, offset)
    assert got.dtype == torch.float32 and got.shape == (50, dim)
    torch.testing.assert_close(got.double(), expected, atol=1e-6, rtol=0)
    x = torch.randn(2, 50, dim)
    torch.testing.assert_close(enc.embed(x, offset), x + got)


@pytest.mark.parametrize("base", [1e4, 500.0])
def test_sinusoidal_shift_is_a_rotation_independent_of_position(base: float) -> None:
    dim = 32
    p = SinusoidalEncoding(dim=dim, num_heads=1, base=base).table(5000).double()
    for j in (0, 3, dim // 2 - 1):
        w = base ** (-2 * j / dim)
        for delta in (1, 7, 250):
            a = delta * w
            turn = torch.tensor([[math.cos(a), math.sin(a)], [-math.sin(a), math.cos(a)]])
            for i in (0, 5, 123, 4000):
                pair = p[i, 2 * j : 2 * j + 2]
                shifted = p[i + delta, 2 * j : 2 * j + 2]
                torch.testing.assert_close(shifted, turn.double() @ pair, atol=2e-6, rtol=0)


def test_sinusoidal_long_lengths_and_dropout() -> None:
    enc = SinusoidalEncoding(dim=16, num_heads=2, dropout=0.5)
    table = enc.table(100_000)
    last = torch.tensor([math.sin(99_999 * 1e4 ** (-c / 16)) for c in range(0, 16, 2)])
    torch.testing.assert_close(table[-1, 0::2], last, atol=1e-6, rtol=0)
    x = torch.zeros(1, 100_000, 16)
    enc.eval()
    torch.testing.assert_close(enc.embed(x)[0], table)
    enc.train()
    out = enc.embed(x)[0]
    kept = out != 0
    assert 0.3 < kept.float().mean() < 0.7
    torch.testing.assert_close(out[kept], 2 * table[kept])


# learned


def test_learned_gradient_and_too_long_input() -> None:
    enc = LearnedEncoding(dim=8, num_heads=2, max_len=16)
    assert 0.005 < enc.weight.std() < 0.05
    enc.embed(torch.randn(3, 5, 8), offset=4).sum().backward()
    expected = torch.zeros(16, 8)
    expected[4:9] = 3.0
    torch.testing.assert_close(enc.weight.grad, expected)
    with pytest.raises(ValueError, match=r"max_len=16.*17"):
        enc.embed(torch.randn(1, 10, 8), offset=7)
    with pytest.raises(ValueError, match=r"max_len=16.*20"):
        enc.check(q_len=4, kv_len=20, head_dim=4)


# rope


def rope_reference(x: torch.Tensor, pos: torch.Tensor, base: float, r: int) -> torch.Tensor:
    """Half-split RoPE in float64 with complex numbers: (x_j + i x_{j+r/2}) * exp(i pos w_j)."""
    half = r // 2
    w = base ** (-torch.arange(half, dtype=torch.float64) * 2 / r)
    z = torch.complex(x[..., :half].double(), x[..., half:r].double())
    z = z * torch.polar(torch.ones(()).double(), pos.double()[:, None] * w)
    return torch.cat((z.real, z.imag, x[..., r:].double()), dim=-1)


@pytest.mark.parametrize(("fraction", "r"), [(1.0, 16), (0.5, 8), (0.25, 4)])
def test_rope_matches_reference_and_keeps_norms(fraction: float, r: int) -> None:
    enc = RotaryEncoding(dim=64, num_heads=4, base=100.0, rotary_fraction=fraction)
    q, k = torch.randn(2, 4, 6, 16), torch.randn(2, 4, 9, 16)
    q_pos, k_pos = torch.arange(40, 46), torch.arange(9)
    q2, k2 = enc.rotate(q, k, q_pos, k_pos)
    torch.testing.assert_close(q2.double(), rope_reference(q, q_pos, 100.0, r), atol=1e-5, rtol=0)
    torch.testing.assert_close(k2.double(), rope_reference(k, k_pos, 100.0, r), atol=1e-5, rtol=0)
    assert torch.equal(q2[..., r:], q[..., r:])
    assert not torch.allclose(q2[..., :r], q[..., :r], atol=1e-3)
    pair_norm = q[..., : r // 2] ** 2 + q[..., r // 2 : r] ** 2
    torch.testing.assert_close(q2[..., : r // 2] ** 2 + q2[..., r // 2 : r] ** 2, pair_norm)


def test_rope_scores_depend_only_on_the_offset() -> None:
    enc = RotaryEncoding(dim=32, num_heads=1)
    q, k = torch.randn(1, 1, 5, 32), torch.randn(1, 1, 7, 32)

    def scores(q_shift: int, k_shift: int) -> torch.Tensor:
        q2, k2 = enc.rotate(q, k, torch.arange(5) + q_shift, torch.arange(7) + k_shift)
        return q2 @ k2.transpose(-1, -2)

    base = scores(0, 0)
    for shift in (3, 100, 1000):
        torch.testing.assert_close(scores(shift, shift), base, atol=2e-3, rtol=0)
        assert (scores(shift, 0) - base).abs().max() > 0.1
        assert (scores(0, shift) - base).abs().max() > 0.1


def test_rope_keeps_dtype_and_rejects_odd_splits() -> None:
    enc = RotaryEncoding(dim=32, num_heads=2)
    q = torch.randn(1, 2, 4, 16)
    q16, _ = enc.rotate(q.bfloat16(), q.bfloat16(), torch.arange(4), torch.arange(4))
    q32, _ = enc.rotate(q, q, torch.arange(4), torch.arange(4))
    assert q16.dtype == torch.bfloat16
    torch.testing.assert_close(q16.float(), q32, atol=3e-2, rtol=2e-2)
    with pytest.raises(ValueError, match=r"head_dim=3.*rotary_fraction=1\.0"):
        RotaryEncoding(dim=12, num_heads=4)
    with pytest.raises(ValueError, match=r"head_dim=4.*rotary_fraction=0\.25"):
        RotaryEncoding(dim=16, num_heads=4, rotary_fraction=0.25)
    with pytest.raises(ValueError, match=r"head_dim=5"):
        enc.check(q_len=4, kv_len=4, head_dim=5)
    with pytest.raises(ValueError, match=r"q_pos.*\(4\)"):
        enc.rotate(q, q, torch.arange(3), torch.arange(4))


# alibi


def test_alibi_slopes_follow_the_paper() -> None:
    assert alibi_slopes(8) == pytest.approx([1 / 2**k for k in range(1, 9)], rel=1e-12)
    twelve = [1 / 2**k for k in range(1, 9)] + [2**-0.5, 2**-1.5, 2**-2.5, 2**-3.5]
    assert alibi_slopes(12) == pytest.approx(twelve, rel=1e-12)
    assert alibi_slopes(6) == pytest.approx([2**-2, 2**-4, 2**-6, 2**-8, 2**-1, 2**-3])
    enc = AlibiEncoding(dim=96, num_heads=12)
    torch.testing.assert_close(enc.slopes, torch.tensor(twelve))
    assert not enc.slopes.requires_grad and len(list(enc.parameters())) == 0


def test_alibi_bias_is_minus_slope_times_distance() -> None:
    enc = AlibiEncoding(dim=32, num_heads=4)
    pos = torch.arange(50)
    bias = enc.bias(*grid(4, pos, pos))
    distance = (pos[:, None] - pos[None, :]).abs().float()
    for h, slope in enumerate([2**-2, 2**-4, 2**-6, 2**-8]):
        torch.testing.assert_close(bias[h], -slope * distance)
    assert torch.all(bias.diagonal(dim1=1, dim2=2) == 0)
    torch.testing.assert_close(bias, bias.transpose(1, 2))


# t5

BIDIRECTIONAL = [(0, 0), (-1, 1), (-7, 7), (-8, 8), (-11, 8), (-12, 9), (-16, 10), (-22, 10)]
BIDIRECTIONAL += [(-23, 11), (-45, 12), (-46, 13), (-90, 14), (-91, 15), (-(10**6), 15)]
BIDIRECTIONAL += [(1, 17), (7, 23), (8, 24), (31, 27), (64, 30), (91, 31), (5000, 31)]
CAUSAL = [(0, 0), (-1, 1), (-15, 15), (-16, 16), (-18, 16), (-19, 17), (-40, 23), (-112, 30)]
CAUSAL += [(-113, 31), (-(10**6), 31), (1, 0), (7, 0), (500, 0)]


@pytest.mark.parametrize(
    ("bidirectional", "rel", "bucket"),
    [(True, *case) for case in BIDIRECTIONAL] + [(False, *case) for case in CAUSAL],
)
def test_t5_buckets_by_hand(bidirectional: bool, rel: int, bucket: int) -> None:
    assert relative_position_bucket(torch.tensor(rel), bidirectional).item() == bucket


def test_t5_bias_gradient_and_argument_shapes() -> None:
    enc = T5RelativeBias(dim=24, num_heads=3, causal=False)
    assert 0.005 < enc.weight.std() < 0.05
    q_pos, k_pos = torch.arange(10, 20), torch.arange(30)
    bias = enc.bias(*grid(3, q_pos, k_pos))
    assert bias.shape == (3, 10, 30)
    buckets = relative_position_bucket(k_pos[None, :] - q_pos[:, None], True)
    torch.testing.assert_close(bias, enc.weight.detach()[:, buckets])
    one = enc.bias(torch.tensor(2), torch.tensor(12), torch.tensor(3))
    assert one.shape == () and one == bias[2, 2, 3]
    bias.sum().backward()
    counts = torch.bincount(buckets.flatten(), minlength=32).float()
    torch.testing.assert_close(enc.weight.grad, counts.expand(3, 32))


# every bias encoding


@pytest.mark.parametrize(("cls", "params"), BIAS_ENCODINGS)
def test_bias_works_under_vmap(cls: type, params: dict) -> None:
    enc = cls(dim=32, num_heads=4, **params)
    h, q_pos, k_pos = torch.arange(4), torch.arange(3, 40), torch.arange(60)
    expected = enc.bias(*grid(4, q_pos, k_pos))
    f = torch.func.vmap(enc.bias, in_dims=(None, None, 0))
    f = torch.func.vmap(f, in_dims=(None, 0, None))
    f = torch.func.vmap(f, in_dims=(0, None, None))
    torch.testing.assert_close(f(h, q_pos, k_pos), expected)


@pytest.mark.parametrize(("cls", "params"), BIAS_ENCODINGS)
def test_bias_as_flex_attention_score_mod(cls: type, params: dict) -> None:
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    enc = cls(dim=32, num_heads=4, **params)
    q, k, v = torch.randn(3, 1, 4, 24, 8).unbind(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # unfused eager FlexAttention: fine for a check
        out = flex.flex_attention(q, k, v, score_mod=lambda s, b, h, i, j: s + enc.bias(h, i, j))
    pos = torch.arange(24)
    scores = q @ k.transpose(-1, -2) / math.sqrt(8) + enc.bias(*grid(4, pos, pos))
    torch.testing.assert_close(out, scores.softmax(-1) @ v, atol=1e-5, rtol=1e-5)
    if list(enc.parameters()):
        out.sum().backward()
        assert enc.weight.grad is not None and enc.weight.grad.abs().sum() > 0


# the registry, the base class and errors


def test_encodings_registry_and_absent_hooks() -> None:
    kinds = {n: cls.kind for n, cls in ENCODINGS.items()}
    assert kinds == {
        "none": "none",
        "sinusoidal": "embed",
        "learned": "embed",
        "rope": "rotate",
        "alibi": "bias",
        "t5": "bias",
    }
    for name, cls in ENCODINGS.items():
        enc = cls(dim=16, num_heads=2, causal=True)
        assert enc.name == name and enc.head_dim == 8 and "num_heads=2" in enc.extra_repr()
        enc.check(q_len=100, kv_len=100, head_dim=8)
    x = torch.randn(2, 3, 16)
    assert ENCODINGS["none"](dim=16, num_heads=2).embed(x) is x
    with pytest.raises(NotImplementedError, match=r"'alibi' encoding has no embed\(\).*bias"):
        AlibiEncoding(dim=16, num_heads=2).embed(x)
    with pytest.raises(NotImplementedError, match=r"'rope' encoding has no bias\(\).*rotate"):
        RotaryEncoding(dim=16, num_heads=2).bias(*grid(2, torch.arange(3), torch.arange(3)))


@pytest.mark.parametrize(
    ("cls", "params", "words"),
    [
        (SinusoidalEncoding, {"base": 1.0}, ["base", "1.0"]),
        (SinusoidalEncoding, {"dropout": 1.5}, ["dropout", "1.5"]),
        (LearnedEncoding, {"max_len": 0}, ["max_len", "0"]),
        (RotaryEncoding, {"rotary_fraction": 0.0}, ["rotary_fraction", "0.0"]),
        (RotaryEncoding, {"base": float("nan")}, ["base", "nan"]),
        (T5RelativeBias, {"num_buckets": 3}, ["num_buckets", "3"]),
        (T5RelativeBias, {"max_distance": 4}, ["max_distance=4"]),
        (AlibiEncoding, {"num_heads": 3, "dim": 10}, ["dim=10", "num_heads=3"]),
        (AlibiEncoding, {"dim": 0}, ["dim", "0"]),
        (AlibiEncoding, {"causal": "yes"}, ["causal", "'yes'"]),
    ],
)
def test_bad_params_name_the_parameter_and_value(cls: type, params: dict, words: list) -> None:
    kwargs = {"dim": 16, "num_heads": 2, **params}
    with pytest.raises(ValueError) as info:
        cls(**kwargs)
    assert all(w in str(info.value) for w in words), str(info.value)


# plot


def test_draw_encoding_writes_a_png(tmp_path) -> None:
    image = pytest.importorskip("matplotlib.image")
    path = draw_encoding(SinusoidalEncoding(dim=32, num_heads=2), 60, tmp_path / "p.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    height, width, _ = image.imread(path).shape
    assert 200 < height < 2000 and 500 < width < 3000
    with pytest.raises(ValueError, match=r"'rope'.*no table P"):
        draw_encoding(RotaryEncoding(dim=32, num_heads=2), 60, tmp_path / "r.png")
    with pytest.raises(ValueError, match=r"columns.*\[0, 32\).*40"):
        draw_encoding(SinusoidalEncoding(dim=32, num_heads=2), 60, tmp_path / "c.png", [1, 40])
