"""Positional encodings plugged into every variant on every backend (the math of each encoding is
tested in test_positional_math.py)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from helpers import SELF_CONTAINED_VARIANTS, check_against_reference, random_qkv

import zoo
from zoo.backends import Backend, BlockedBackend, Capabilities, FlexBackend
from zoo.backends.reference import ReferenceBackend

ATTENTION_ENCODINGS = ["rope", "alibi", "t5"]  # the kinds that act inside attention
VARIANTS = SELF_CONTAINED_VARIANTS


def encoding(name, causal):
    torch.manual_seed(0)
    pos = zoo.build_encoding(name, dim=32, num_heads=2, causal=causal)
    if name == "t5":  # a table far from zero, so that errors in its gradient show
        torch.nn.init.normal_(pos.weight, std=1.0)
    return pos


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("backend", ["blocked", "sdpa"])
@pytest.mark.parametrize("name", ATTENTION_ENCODINGS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_encoding_on_backend_matches_reference(variant, name, backend, causal):
    """Output and gradients of q, k, v and of the encoding's own parameters."""
    chosen = BlockedBackend(block_size=16) if backend == "blocked" else backend
    for q_len, kv_len, padded in [(100, 100, True), (70, 100, False)]:
        check_against_reference(
            variant, chosen, q_len=q_len, kv_len=kv_len, causal=causal, padded=padded,
            pos=encoding(name, causal),
        )  # fmt: skip


# The score_mod that carries a bias does not depend on the pattern; flex runs every variant in
# tests/backends/test_backends.py. One variant of each kind of mask (eager flex costs ~1 s a
# case on CPU). The compiled kernel carries alibi and t5 in tests/backends/test_flex.py.
# Each encoding meets both causalities among them.
FLEX_CASES = [("local", True), ("bigbird", False), ("strided", True), ("neighborhood_2d", False),
              ("moba", True)]  # fmt: skip


@pytest.mark.parametrize("name", ATTENTION_ENCODINGS)
@pytest.mark.parametrize("variant,causal", FLEX_CASES)
def test_encoding_on_flex_matches_reference(variant, causal, name):
    """FlexAttention's score_mod carries the bias (eager path; forward, as CPU has no backward)."""
    backend = FlexBackend(block_size=16, compile=False)
    check_against_reference(
        variant, backend, q_len=100, kv_len=100, causal=causal, padded=True, grads=False,
        pos=encoding(name, causal),
    )  # fmt: skip


@pytest.mark.parametrize("name", zoo.list_encodings())
def test_every_encoding_in_the_module_on_every_capable_backend(name):
    """Embed encodings act on the module input; every backend then sees the same q, k, v."""
    torch.manual_seed(0)
    attn = zoo.create_attention("bigbird", dim=32, num_heads=2, block_size=16, pos=name)
    x = torch.randn(2, 100, 32)
    pad = torch.zeros(2, 100, dtype=torch.bool)
    pad[1, 60:] = True
    expected = attn(x, key_padding_mask=pad, return_weights=True)[0]
    for backend in ("sdpa", BlockedBackend(block_size=16)):
        attn.backend = backend
        torch.testing.assert_close(attn(x, key_padding_mask=pad), expected, rtol=1e-5, atol=1e-5)
    if name in ("learned", "t5"):
        attn(x).sum().backward()
        assert next(attn.pos.parameters()).grad.abs().sum() > 0


def test_positions_follow_the_alignment_in_cross_attention():
    """With rope, a query at the keys' end scores like the last query of the square case."""
    q, k, v = (t.detach() for t in random_qkv(1, 2, 100, 100))
    full = zoo.attention(q, k, v, variant="local", window_size=5, pos="rope")
    last = zoo.attention(q[:, :, -10:], k, v, variant="local", window_size=5, pos="rope")
    torch.testing.assert_close(last, full[:, :, -10:])


def test_sinusoidal_module_is_position_aware():
    """Without an encoding attention is permutation-equivariant; with one it is not."""
    x = torch.randn(1, 20, 32)
    perm = torch.randperm(20)
    for name, equivariant in [
        ("none", True),
        ("sinusoidal", False),
        ("rope", False),
        ("alibi", False),
    ]:
        torch.manual_seed(0)
        attn = zoo.create_attention("full", dim=32, num_heads=2, pos=name)
        same = torch.allclose(attn(x)[:, perm], attn(x[:, perm]), atol=1e-5)
        assert same == equivariant, name


class NoBiasBackend(ReferenceBackend):
    name = "no_bias"
    capabilities = Capabilities(
        devices=("cpu",), backward=("cpu",), dtypes=(torch.float32,), patterns="any"
    )


def test_a_backend_that_cannot_carry_a_bias_says_which_can():
    q, k, v = (t.detach() for t in random_qkv(1, 2, 16, 16))
    assert isinstance(NoBiasBackend(), Backend)
    message = r"cannot add a positional bias.*can: blocked, flex, reference, sdpa"
    with pytest.raises(ValueError, match=message):
        zoo.attention(q, k, v, variant="local", backend=NoBiasBackend(), pos="alibi")


def test_bad_encodings():
    q, k, v = random_qkv(1, 2, 16, 16)
    with pytest.raises(ValueError, match=r"unknown encoding 'alibii'; did you mean 'alibi'"):
        zoo.create_attention("local", dim=32, num_heads=2, pos="alibii")
    with pytest.raises(ValueError, match=r"max_len=8 .* positions up to 16"):
        zoo.create_attention(
            "local", dim=32, num_heads=2, pos="learned", pos_params={"max_len": 8}
        )(torch.randn(1, 16, 32))
    with pytest.raises(ValueError, match=r"rope cannot split head_dim=9"):
        zoo.create_attention("local", dim=36, num_heads=4, pos="rope")
    with pytest.raises(ValueError, match=r"pos='sinusoidal' adds a table to a model's input"):
        zoo.attention(q, k, v, variant="local", pos="sinusoidal")
    with pytest.raises(ValueError, match=r"pos='t5' has learned parameters"):
        zoo.attention(q, k, v, variant="local", pos="t5")
    with pytest.raises(TypeError, match=r"encoding 'rope' has no parameter 'bse'"):
        zoo.create_attention("local", dim=32, num_heads=2, pos="rope", pos_params={"bse": 10})


def test_user_encoding_from_a_yaml_entry(tmp_path, monkeypatch):
    (tmp_path / "my_positions.py").write_text(
        textwrap.dedent(
            """
            import torch
            from zoo.positional import PositionalEncoding

            class Nearby(PositionalEncoding):
                name = "nearby"
                kind = "bias"

                def __init__(self, *, dim, num_heads, causal=False, strength=1.0):
                    super().__init__(dim=dim, num_heads=num_heads, causal=causal)
                    self.strength = strength

                def bias(self, h, q_pos, k_pos):
                    return -self.strength * (q_pos - k_pos).abs().float() + 0 * h
            """
        )
    )
    (tmp_path / "mine.yaml").write_text(
        "positional:\n  nearby:\n    encoding: my_positions:Nearby\n    params: {strength: 2.0}\n"
        "    description: d\n"
    )
    code = textwrap.dedent(
        """
        import torch, zoo
        attn = zoo.create_attention("local", dim=16, num_heads=2, window_size=3, pos="nearby")
        print(zoo.list_encodings(), attn.pos.strength, attn(torch.randn(1, 10, 16)).shape)
        """
    )
    env = {"ZOO_REGISTRY": str(tmp_path / "mine.yaml"), "PYTHONPATH": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "'nearby'" in done.stdout and "2.0 torch.Size([1, 10, 16])" in done.stdout


def test_encoding_picture_from_the_command_line(tmp_path):
    out = tmp_path / "sinusoidal.png"
    cmd = [
        sys.executable,
        "-m",
        "zoo",
        "encoding",
        "sinusoidal",
        "--length",
        "64",
        "--dim",
        "32",
        "--out",
        str(out),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
