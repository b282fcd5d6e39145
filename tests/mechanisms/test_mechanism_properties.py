"""Properties of the mechanisms that their papers state (zoo/mechanisms/), and the module path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import random_qkv
from test_mechanisms import MECHANISMS, SMALL, build

import zoo
from zoo.mechanisms.kernel import feature_attention
from zoo.mechanisms.nystrom import newton_schulz_pinv, nystrom_attention
from zoo.mechanisms.performer import orthogonal_features, positive_features


def recurrent(phi_q, phi_k, v):
    """The causal recurrent form (Lq = Lk): running S = Σ φ(k_j) v_jᵀ and z = Σ φ(k_j)."""
    state = torch.zeros(*phi_k.shape[:2], phi_k.shape[-1], v.shape[-1], dtype=v.dtype)
    norm = torch.zeros(*phi_k.shape[:2], phi_k.shape[-1], dtype=v.dtype)
    out = []
    for i in range(phi_q.shape[2]):
        state = state + phi_k[:, :, i, :, None] * v[:, :, i, None, :]
        norm = norm + phi_k[:, :, i]
        num = torch.einsum("bhm,bhmd->bhd", phi_q[:, :, i], state)
        out.append(num / torch.einsum("bhm,bhm->bh", phi_q[:, :, i], norm)[..., None])
    return torch.stack(out, dim=2)


@pytest.mark.parametrize("chunk_size", [1, 5, 16, 64])
def test_chunked_causal_equals_recurrent(chunk_size):
    """The chunked form (any chunk, lengths not multiples of it) is the recurrent form, to
    float32 precision: within a few ulps of the float64 recurrence, as the fp32 recurrence is."""
    q, k, v = (t.detach() for t in random_qkv(2, 2, 45, 45, seed=3))
    for phi in (
        lambda x: F.elu(x) + 1,
        lambda x: positive_features(x, orthogonal_features(24, 16, 0).float(), 0.25),
    ):
        phi_q, phi_k = phi(q), phi(k)
        exact = recurrent(phi_q.double(), phi_k.double(), v.double())
        fp32 = recurrent(phi_q, phi_k, v)
        chunked = feature_attention(phi_q, phi_k, v, causal=True, chunk_size=chunk_size)
        budget = 2 * (fp32.double() - exact).abs().max().item() + 1e-6
        assert (chunked.double() - exact).abs().max().item() <= budget
        # features φ(k)·exp(c), c spread far beyond float32's range, given as ψ (at most 1)
        # and its log-scale: a query's sums are representable only relative to the keys it sees
        spread = torch.randn(phi_k.shape[:3], generator=torch.Generator().manual_seed(5)) * 40
        top = phi_k.amax(-1)
        psi, scale = phi_k / top[..., None], spread + top.log()
        exact = recurrent(
            phi_q.double(), psi.double() * scale.double().exp()[..., None], v.double()
        )
        scaled = feature_attention(
            phi_q, psi, v, causal=True, chunk_size=chunk_size, key_log_scale=scale
        )
        assert (scaled.double() - exact).abs().max().item() <= budget, chunk_size


def test_performer_causal_output_never_depends_on_a_later_key():
    """Causal performer: a query's keys are taken relative to the largest among the keys it
    sees, never a later one. With large keys (log-features far below 0) and a small last key,
    one largest over the sequence rounded every earlier key to 0 in float32 and rows 0..6 gave
    zeros (off by 2.07); padded or not, with keys before the first query (Lk > Lq)."""
    mech = build("performer", heads=1, head_dim=16).float()
    generator = torch.Generator().manual_seed(0)
    q, v = (torch.randn(2, 1, 40, 16, generator=generator) for _ in range(2))
    k = torch.randn(2, 1, 40, 16, generator=generator) * 12
    k[:, :, -1] = 0.0
    for mask in (
        None,
        torch.zeros(2, 40, dtype=torch.bool).index_fill_(1, torch.tensor([3]), True),
    ):
        for start in (0, 5):  # Lq = Lk, and 5 keys before the first query

            def run(n, dtype=torch.float32, start=start, mask=mask):
                part = None if mask is None else mask[:, :n]
                return zoo.attention(q[:, :, start:n].to(dtype), k[:, :, :n].to(dtype),
                                     v[:, :, :n].to(dtype), variant=mech.to(dtype), causal=True,
                                     key_padding_mask=part)  # fmt: skip

            whole, shorter, exact = run(40)[:, :, :-1], run(39), run(39, torch.float64)
            assert torch.equal(whole, shorter)
            assert (whole.double() - exact).abs().max() < 1e-4


def test_causal_lq_longer_than_lk_gives_zeros_before_the_first_key():
    q, k, v = (t.detach() for t in random_qkv(1, 2, 20, 12, seed=4))
    out = zoo.attention(q, k, v, variant="linear", causal=True)
    assert torch.equal(out[:, :, :8], torch.zeros_like(out[:, :, :8]))
    assert out[:, :, 8:].abs().amax() > 0


def test_performer_kernel_estimate_is_unbiased():
    """The mean of φ(q)·φ(k) over 2000 draws of W is exp(s·q·k) within 3%, while one draw is off
    by far more: the average, not luck, makes it right (Q's signs unfixed gave 14%)."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(6, 8, generator=generator, dtype=torch.float64) * 0.3
    exact = torch.exp(x @ x.T / 8**0.5)
    draws = []
    for seed in range(2000):
        phi = positive_features(x, orthogonal_features(8, 8, seed), 8**-0.5)
        draws.append(phi @ phi.T)
    draws = torch.stack(draws)
    mean_error = ((draws.mean(0) - exact).abs() / exact).max().item()
    one_draw_error = ((draws - exact).abs() / exact).amax(dim=(1, 2)).median().item()
    assert mean_error < 0.03 and one_draw_error > 0.3


def test_performer_error_against_softmax_falls_with_more_features():
    q, k, v = (t.detach().double() * 0.5 for t in random_qkv(1, 2, 64, 64, head_dim=8, seed=5))
    exact = torch.softmax(q @ k.transpose(-1, -2) / 8**0.5, -1) @ v
    errors = []
    for m in (8, 64, 2048):
        per_seed = [
            (zoo.attention(q, k, v, variant="performer", num_features=m, seed=s) - exact)
            .abs()
            .mean()
            for s in range(4)
        ]
        errors.append(torch.stack(per_seed).mean().item())
    assert errors[0] > errors[1] > errors[2]
    assert errors[2] < errors[0] / 5  # about 1/sqrt(m): 16x fewer from 8 to 2048 features


def test_nystrom_with_a_landmark_per_token_and_an_exact_inverse_is_softmax_attention():
    q, k, v = (t.detach().double() for t in random_qkv(2, 2, 24, 24, seed=6))
    exact = torch.softmax(q @ k.transpose(-1, -2) / 4, -1) @ v
    out = nystrom_attention(q, k, v, num_landmarks=24, scale=1 / 4, inverse=torch.linalg.pinv)
    assert (out - exact).abs().max() < 1e-9
    # the iterative inverse converges to the same: with enough iterations, the same output
    many = zoo.attention(q, k, v, variant="nystrom", num_landmarks=24, pinv_iterations=40)
    assert (many - exact).abs().max() < 1e-8


def test_nystrom_is_the_same_however_many_padded_keys_follow():
    """Fewer keys than landmarks: m had been min(num_landmarks, Lq, Lk), Lk counting padded
    keys, so each padded key added a landmark and re-cut the query segments (0.6 apart at 5
    padded keys). The same 10 valid keys now give the same output behind 0 to 90 of them."""
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(2, 2, n, 8, generator=g, dtype=torch.float64) for n in (100, 10, 10))
    want = zoo.attention(q, k, v, variant="nystrom", num_landmarks=64)
    for pad in (1, 5, 54, 90):
        filler = torch.full((2, 2, pad, 8), float("nan"), dtype=torch.float64)
        mask = torch.arange(10 + pad)[None, :].expand(2, -1) >= 10
        got = zoo.attention(
            q, torch.cat([k, filler], 2), torch.cat([v, filler], 2), variant="nystrom",
            num_landmarks=64, key_padding_mask=mask,
        )  # fmt: skip
        assert (got - want).abs().max() < 1e-12, pad


def test_newton_schulz_converges_to_the_pseudo_inverse():
    generator = torch.Generator().manual_seed(7)
    a = torch.softmax(torch.randn(3, 8, 8, generator=generator, dtype=torch.float64) * 2, -1)
    exact = torch.linalg.pinv(a)
    errors = [(newton_schulz_pinv(a, n) - exact).abs().max().item() for n in (2, 6, 12, 30)]
    assert errors == sorted(errors, reverse=True) and errors[-1] < 1e-9


def test_linformer_with_identity_projections_is_full_attention():
    q, k, v = random_qkv(2, 2, 32, 32, seed=8)
    mech = build("linformer", proj_len=32, max_len=32).float()
    with torch.no_grad():
        mech.key_proj.copy_(torch.eye(32))
        mech.value_proj.copy_(torch.eye(32))
    out = zoo.attention(q, k, v, variant=mech)
    exact = zoo.attention(q, k, v, variant="full", backend="reference")
    torch.testing.assert_close(out, exact, atol=1e-6, rtol=1e-5)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    exact_grads = torch.autograd.grad(exact.sum(), (q, k, v))
    for got, want in zip(grads, exact_grads, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("name", MECHANISMS)
def test_padded_keys_contribute_nothing(name):
    """Other values at padded keys change no output, and get zero gradient; a sequence with
    every key padded gets zeros (not NaN)."""
    mech = build(name).float()
    q, k, v = (t.detach() for t in random_qkv(2, 2, 24, 24, seed=9))
    mask = torch.zeros(2, 24, dtype=torch.bool)
    mask[0, 10:] = True
    mask[1] = True
    noisy_k, noisy_v = k.clone(), v.clone()
    noisy_k[:, :, 10:] = 50 * torch.randn_like(k[:, :, 10:])
    noisy_v[:, :, 10:] = float("nan")
    noisy_k, noisy_v = noisy_k.requires_grad_(), noisy_v.requires_grad_()
    out = zoo.attention(q, k, v, variant=mech, key_padding_mask=mask)
    noisy = zoo.attention(q, noisy_k, noisy_v, variant=mech, key_padding_mask=mask)
    torch.testing.assert_close(noisy, out)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    grads = torch.autograd.grad(noisy.sum(), (noisy_k, noisy_v))
    for grad in grads:
        assert torch.equal(grad[0, :, 10:], torch.zeros_like(grad[0, :, 10:]))
        assert torch.isfinite(grad).all()


@pytest.mark.parametrize("name", MECHANISMS)
def test_keys_padded_to_any_length_equal_the_call_on_the_real_keys(name):
    """37 queries against 37 real keys padded to 60, the padded keys and values holding noise or
    NaN: equal to the call on the 37 keys alone (float64). Nystrom cut its key segments over the
    padded length (a change of 0.68)."""
    mech = build(name).double()
    q, k, v = (t.detach().double() for t in random_qkv(1, 2, 37, 37, seed=4))
    want = zoo.attention(q, k, v, variant=mech)
    mask = torch.zeros(1, 60, dtype=torch.bool)
    mask[:, 37:] = True
    for fill in (50.0, float("nan")):
        k_pad, v_pad = (torch.cat((x, torch.full_like(x[:, :, :23], fill)), 2) for x in (k, v))
        got = zoo.attention(q, k_pad, v_pad, variant=mech, key_padding_mask=mask)
        torch.testing.assert_close(got, want, atol=1e-12, rtol=0)


@pytest.mark.parametrize("name", MECHANISMS)
def test_padded_positions_holding_anything_change_no_real_row_of_a_module(name):
    """Self-attention in MultiHeadAttention, one sequence padded from 30 of 50 positions holding
    noise, then NaN: its real rows and the other sequence's stay as they were. Nystrom averaged
    the padded queries into its query landmarks (a change of 7.5e-2; NaN everywhere): the module
    zeroes them (``Mechanism.summarises_queries``)."""
    torch.manual_seed(0)
    spec = zoo.get_mechanism_spec(name)
    small = {key: value for key, value in SMALL.items() if key in spec.parameters()}
    attn = zoo.create_attention(name, dim=16, num_heads=2, **small).double()
    x = torch.randn(2, 50, 16, dtype=torch.float64)
    lens = torch.tensor([50, 30])
    with torch.no_grad():
        want = attn(x, valid_lens=lens)
        for fill in (50.0, float("nan")):
            x[1, 30:] = fill
            got = attn(x, valid_lens=lens)
            torch.testing.assert_close(got[0], want[0], atol=1e-12, rtol=0)
            torch.testing.assert_close(got[1, :30], want[1, :30], atol=1e-12, rtol=0)


@pytest.mark.parametrize("name", MECHANISMS)
def test_rope_turns_q_and_k_before_the_mechanism(name):
    mech = build(name).float()
    q, k, v = (t.detach() for t in random_qkv(1, 2, 20, 20, seed=10))
    rope = zoo.build_encoding("rope", dim=32, num_heads=2)
    positions = torch.arange(20)
    q_rot, k_rot = rope.rotate(q, k, positions, positions)
    torch.testing.assert_close(
        zoo.attention(q, k, v, variant=mech, pos="rope"),
        zoo.attention(q_rot, k_rot, v, variant=mech),
    )


@pytest.mark.parametrize("name", MECHANISMS)
def test_a_module_takes_an_empty_batch(name):
    """No sequences, as the pattern variants take them: an empty output and empty gradients.
    Linformer's projection failed to reshape an empty batch."""
    params = {"max_len": 64} if name == "linformer" else {}
    module = zoo.create_attention(name, dim=32, num_heads=2, **params)
    x = torch.randn(0, 40, 32, requires_grad=True)
    out = module(x)
    assert out.shape == (0, 40, 32)
    out.sum().backward()
    assert x.grad.shape == x.shape


@pytest.mark.parametrize("name", MECHANISMS)
def test_module_trains_with_each_mechanism(name):
    """create_attention by name: forward with valid_lens, finite gradients for every parameter
    (linformer's E and F included), the mechanism's parameters in the state dict."""
    params = {"max_len": 64} if name == "linformer" else {}
    causal = zoo.get_mechanism_spec(name).mechanism_class().causal
    torch.manual_seed(0)
    module = zoo.create_attention(name, dim=32, num_heads=2, causal=causal, pos="rope", **params)
    x = torch.randn(2, 40, 32)
    out = module(x, valid_lens=torch.tensor([40, 25]))
    out.square().mean().backward()
    for pname, p in module.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), pname
    learned = {n for n, _ in module.mechanism.named_parameters()}
    assert {f"mechanism.{n}" for n in learned} <= set(module.state_dict())
    assert bool(learned) == (name == "linformer")


def test_performer_redraws_its_features_every_interval_in_training_only():
    module = zoo.create_attention("performer", dim=32, num_heads=2, redraw_interval=2)
    x = torch.randn(1, 8, 32)
    first = module.mechanism.projection.clone()
    module.eval()
    for _ in range(5):
        module(x)
    assert torch.equal(module.mechanism.projection, first)
    module.train()
    module(x), module(x)
    assert torch.equal(module.mechanism.projection, first)
    module(x)  # the third training call starts a new interval with a new draw
    assert not torch.equal(module.mechanism.projection, first)
    again = zoo.create_attention("performer", dim=32, num_heads=2, seed=0).mechanism.projection
    assert torch.equal(again, first)  # one seed, one draw


def test_performer_redraws_past_the_last_seed_from_seed_0():
    """Seeds wrap at 2**32, the seeds torch's CPU generator tells apart: the redraw after seed
    2**32 - 1 draws with seed 0."""
    module = zoo.create_attention("performer", dim=32, num_heads=2, seed=2**32 - 1)
    module.mechanism.redraw()
    zero = zoo.create_attention("performer", dim=32, num_heads=2, seed=0).mechanism.projection
    assert torch.equal(module.mechanism.projection, zero)


def test_linear_features_keep_float32_precision_far_below_zero():
    """φ(x) = elu(x) + 1 is exp(x) below 0: computed as (exp(x) - 1) + 1 in float32 it came out
    0 at x = -20 (a key that weighs nothing); its gradient stays finite at large x."""
    from zoo.mechanisms.linear import elu_features

    x = torch.tensor([-30.0, -20.0, -17.0, -1.0, 0.0, 2.0, 100.0], requires_grad=True)
    phi = elu_features(x)
    want = torch.where(x.double() > 0, x.double() + 1, torch.exp(x.double()))
    assert torch.allclose(phi.double(), want, rtol=1e-6, atol=0)
    phi.sum().backward()
    assert torch.isfinite(x.grad).all() and x.grad[-1] == 1 and x.grad[-3] == 1


def test_a_compiled_linear_module_trains_as_eager():
    """torch.compile (aot_eager, fullgraph) of a linear-attention module: forward and backward
    equal eager (its elu's compiled backward on a transposed view failed, torch 2.13)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    attn = zoo.create_attention("linear", dim=32, num_heads=4, num_kv_heads=2, chunk_size=8)
    x = torch.randn(2, 24, 32, requires_grad=True)
    want = attn(x)
    (grad,) = torch.autograd.grad(want.square().sum(), x)
    compiled = torch.compile(attn, backend="aot_eager", fullgraph=True)
    got = compiled(x)
    (compiled_grad,) = torch.autograd.grad(got.square().sum(), x)
    assert torch.allclose(got, want, atol=1e-6) and torch.allclose(compiled_grad, grad, atol=1e-5)
    torch._dynamo.reset()


def test_performer_resumed_from_a_checkpoint_redraws_on_the_same_schedule():
    """``redraw_interval``: the draws so far and the calls since the last are in the state dict
    (as a tensor); a module restored from one redraws at the same steps from the same seeds (it
    redrew at other steps, reusing seeds already drawn, from the next redraw on)."""
    torch.manual_seed(0)
    kwargs = dict(dim=32, num_heads=2, redraw_interval=2, seed=3)
    saved = zoo.create_attention("performer", **kwargs).train()
    x = torch.randn(1, 12, 32)
    for _ in range(5):
        saved(x)
    state = saved.state_dict()
    assert all(isinstance(v, torch.Tensor) for v in state.values())
    resumed = zoo.create_attention("performer", **kwargs).train()
    resumed.load_state_dict(state)
    for _ in range(6):
        assert torch.equal(saved(x), resumed(x))


def test_performer_loads_a_state_dict_saved_before_its_schedule_was_kept():
    """Strictly, as a module never redrawn (its schedule at 0)."""
    module = zoo.create_attention("performer", dim=32, num_heads=2)
    old = {k: v for k, v in module.state_dict().items() if not k.endswith("_extra_state")}
    fresh = zoo.create_attention("performer", dim=32, num_heads=2)
    fresh.load_state_dict(old)
    assert fresh.mechanism.draws == 0 and fresh.mechanism.calls == 0


def test_a_module_given_a_mechanism_instance_holds_it_once():
    """``MultiHeadAttention(variant=<Mechanism>)`` registers it as ``mechanism`` only: it was
    also the submodule ``variant``, so its parameters were saved twice and the state dict did
    not load into the same module built by name."""
    built = build("linformer", heads=2, head_dim=8).float()
    given = zoo.MultiHeadAttention(16, 2, variant=built)
    by_name = zoo.create_attention("linformer", dim=16, num_heads=2, proj_len=16, max_len=64)
    assert [k for k in given.state_dict() if "proj" in k and "_proj." not in k] == [
        "mechanism.key_proj", "mechanism.value_proj"
    ]  # fmt: skip
    assert given.variant is given.mechanism is built
    by_name.load_state_dict(given.state_dict())  # strict: the same keys
    x = torch.randn(1, 16, 16)
    torch.testing.assert_close(by_name(x), given(x), atol=0, rtol=0)
    assert "variant=LinformerAttention (the submodule mechanism)" in repr(given)
