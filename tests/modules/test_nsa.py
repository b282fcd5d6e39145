"""NSA (``zoo.modules.nsa``): the module against a straightforward dense computation of its
definition, forward and gradients, on the backends that run its three branches."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import zoo
from zoo.modules.nsa import NativeSparseAttention
from zoo.patterns.routed import picks_mask

L, DIM, HEADS, KV_HEADS = 70, 32, 4, 2
SETTINGS = dict(block_length=8, block_stride=4, select_block=16, select_count=3, window=12)


def softmax_rows(scores, allowed):
    """Softmax over allowed keys; a row with none gives zeros."""
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, -1).nan_to_num(0.0)


def dense_nsa(m, x, padding):
    """NSA from its definition, one (sequence, head) at a time, with m's parameters; padded
    positions read as zeros (they may hold anything)."""
    x = x.masked_fill(padding[:, :, None], 0)
    B, n, _ = x.shape
    hd, group = m.head_dim, m.num_heads // m.num_kv_heads
    q = F.linear(x, m.q_proj.weight, m.q_proj.bias).view(B, n, m.num_heads, hd)
    k = F.linear(x, m.k_proj.weight, m.k_proj.bias).view(B, n, m.num_kv_heads, hd)
    v = F.linear(x, m.v_proj.weight, m.v_proj.bias).view(B, n, m.num_kv_heads, hd)
    gates = torch.sigmoid(F.linear(x, m.gate.weight, m.gate.bias)).view(B, n, 3, m.num_heads)
    l, s, lb = m.length, m.stride, m.select_block
    windows = (n - l) // s + 1
    blocks = -(-n // lb)
    t = torch.arange(n)
    key = torch.arange(n)
    out = torch.zeros(B, n, m.num_heads, hd, dtype=x.dtype)
    chosen_all = torch.zeros(B, m.num_heads, n, blocks, dtype=torch.bool)
    for b in range(B):
        kept = ~padding[b]
        probs = {}
        for h in range(m.num_heads):
            kh = h // group
            k_cmp, v_cmp, has = [], [], []
            for i in range(windows):
                span = [p for p in range(i * s, i * s + l) if kept[p]]
                has.append(bool(span))
                k_cmp.append(k[b, span, kh].mean(0) if span else torch.zeros(hd, dtype=x.dtype))
                v_cmp.append(v[b, span, kh].mean(0) if span else torch.zeros(hd, dtype=x.dtype))
            k_cmp, v_cmp = torch.stack(k_cmp), torch.stack(v_cmp)
            if m.compress_k is not None:  # the learned map, after the mean
                k_cmp = F.linear(k_cmp, m.compress_k.weight, m.compress_k.bias)
                v_cmp = F.linear(v_cmp, m.compress_v.weight, m.compress_v.bias)
            allowed = (torch.arange(windows)[None, :] * s + l - 1 <= t[:, None]) & torch.tensor(has)
            p = softmax_rows(q[b, :, h] @ k_cmp.T / hd**0.5, allowed)
            probs[h] = p
            o_cmp = p @ v_cmp
            out[b, :, h] += gates[b, :, 0, h, None] * o_cmp
        for h in range(m.num_heads):
            kh = h // group
            p_group = sum(probs[g] for g in range(kh * group, (kh + 1) * group)).detach()
            for i in range(n):
                own = i // lb
                ranked = []
                for j in range(own + 1):
                    if not kept[j * lb : (j + 1) * lb].any():
                        continue
                    forced = j == 0 or j > own - m.num_local
                    covering = [
                        w for w in range(windows) if w * s < (j + 1) * lb and w * s + l > j * lb
                    ]
                    score = float("inf") if forced else float(p_group[i, covering].sum())
                    ranked.append((-score, j))
                for _, j in sorted(ranked)[: m.select_count]:
                    chosen_all[b, h, i, j] = True
            causal = key[None, :] <= t[:, None]
            selected = chosen_all[b, h][:, key // lb] & causal & kept
            window = causal & (key[None, :] > t[:, None] - m.window) & kept
            scores = q[b, :, h] @ k[b, :, kh].T / hd**0.5
            out[b, :, h] += gates[b, :, 1, h, None] * (softmax_rows(scores, selected) @ v[b, :, kh])
            out[b, :, h] += gates[b, :, 2, h, None] * (softmax_rows(scores, window) @ v[b, :, kh])
    y = F.linear(out.reshape(B, n, -1), m.out_proj.weight, m.out_proj.bias)
    return y, chosen_all


def make(learned=False, backend="reference", dtype=torch.float64):
    torch.manual_seed(0)
    module = NativeSparseAttention(
        DIM, HEADS, num_kv_heads=KV_HEADS, learned_compression=learned, backend=backend,
        **SETTINGS,
    )  # fmt: skip
    if learned:  # away from the identity it starts at, so the map matters
        with torch.no_grad():
            module.compress_k.weight.add_(0.1 * torch.randn(module.head_dim, module.head_dim))
            module.compress_v.weight.add_(0.1 * torch.randn(module.head_dim, module.head_dim))
    return module.to(dtype)


def inputs(dtype=torch.float64):
    x = torch.randn(2, L, DIM, generator=torch.Generator().manual_seed(1), dtype=dtype)
    padding = torch.zeros(2, L, dtype=torch.bool)
    padding[1, 50:] = True
    return x.requires_grad_(), padding


@pytest.mark.parametrize("learned", [False, True], ids=["pooled", "learned"])
@pytest.mark.parametrize("backend", ["reference", "blocked", "sdpa"])
def test_module_equals_the_dense_definition(backend, learned):
    module = make(learned, backend)
    x, padding = inputs()
    got = module(x, key_padding_mask=padding)
    p_cmp = module.compressed_branch(*_qkv(module, x.masked_fill(padding[..., None], 0)), padding)[
        1
    ]
    want, chosen = dense_nsa(module, x, padding)
    picks = module.choose(p_cmp, L, padding, x.device)
    assert torch.equal(picks_mask(picks, chosen.shape[-1]).expand_as(chosen), chosen)
    assert (got - want).abs().max() < 1e-10
    grad_out = torch.randn_like(got)
    params = [x, *module.parameters()]
    for a, b in zip(
        torch.autograd.grad(got, params, grad_out),
        torch.autograd.grad(want, params, grad_out),
        strict=True,
    ):
        assert (a - b).abs().max() < 1e-9


def _qkv(module, x):
    B = x.shape[0]
    q = module.q_proj(x).view(B, L, HEADS, -1).transpose(1, 2)
    k = module.k_proj(x).view(B, L, KV_HEADS, -1).transpose(1, 2)
    v = module.v_proj(x).view(B, L, KV_HEADS, -1).transpose(1, 2)
    return q, k, v


def test_float32_on_auto_is_close_to_float64():
    module = make(dtype=torch.float32, backend="auto")
    x, padding = inputs(torch.float32)
    want, _ = dense_nsa(make(), x.detach().double(), padding)
    assert (module(x, key_padding_mask=padding).double() - want).abs().max() < 1e-4


def test_selection_keeps_first_and_local_blocks_and_never_a_future_one():
    module = make()
    x, _ = inputs()
    p_cmp = module.compressed_branch(*_qkv(module, x), None)[1]
    chosen = picks_mask(module.choose(p_cmp, L, None, x.device), -(-L // module.select_block))
    own = torch.arange(L) // module.select_block
    assert chosen[..., 0].all()
    assert chosen.gather(-1, own.view(1, 1, L, 1).expand(2, HEADS, L, 1)).all()
    assert not (chosen & (torch.arange(chosen.shape[-1]) > own[:, None])).any()
    assert (chosen.sum(-1) <= module.select_count).all()
    group = HEADS // KV_HEADS
    assert torch.equal(chosen[:, 0], chosen[:, group - 1])  # a GQA group shares its choice


def test_padding_holding_nan_changes_no_real_row():
    """Padding may hold anything: NaN in the padded inputs of one sequence (its keys and values
    through the projections) changes no real row (0 * NaN in the compressed branch's window
    means had made every row of that sequence NaN)."""
    module = make()
    x = torch.randn(2, L, DIM, dtype=torch.float64)
    padding = torch.zeros(2, L, dtype=torch.bool)
    padding[1, 30:] = True
    with torch.no_grad():
        want = module(x, key_padding_mask=padding)
        x[1, 30:] = float("nan")
        got = module(x, key_padding_mask=padding)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    torch.testing.assert_close(got[1, :30], want[1, :30], rtol=0, atol=1e-12)


def test_valid_lens_is_the_right_padding_it_stands_for():
    """As MultiHeadAttention takes it, so a model passes the same padding to every variant."""
    module = make()
    x = torch.randn(2, L, DIM, dtype=torch.float64)
    padding = torch.zeros(2, L, dtype=torch.bool)
    padding[1, 30:] = True
    with torch.no_grad():
        by_lengths = module(x, valid_lens=torch.tensor([L, 30]))
        assert torch.equal(by_lengths, module(x, key_padding_mask=padding))
    with pytest.raises(ValueError, match="give key_padding_mask or valid_lens, not both"):
        module(x, key_padding_mask=padding, valid_lens=torch.tensor([L, 30]))


def test_short_sequences_run():
    module = make()
    x = torch.randn(1, 5, DIM, dtype=torch.float64)  # shorter than one compressed window
    assert module(x).shape == (1, 5, DIM)


@pytest.mark.parametrize(
    "option,value,match",
    [
        ("select_count", 0, "select_count must be positive, got 0"),
        ("block_stride", 1.5, "block_stride must be an int, got 1.5"),
        ("causal", False, "causal self-attention"),
        ("bias", "False", "bias must be True or False, got 'False'"),
        ("learned_compression", "False", "learned_compression must be True or False"),
        ("backend", "sdp", "unknown backend 'sdp'; did you mean 'sdpa'"),
        ("backend", 3, "backend must be 'auto', a name from zoo.list_backends()"),
    ],
)
def test_bad_options_name_the_value(option, value, match):
    with pytest.raises((TypeError, ValueError), match=match):
        NativeSparseAttention(DIM, HEADS, **{option: value})


def test_nsa_is_a_registry_entry():
    module = zoo.create_attention("nsa", dim=DIM, num_heads=HEADS, **SETTINGS)
    assert isinstance(module, NativeSparseAttention)
    assert module.window == SETTINGS["window"]
    assert zoo.list_modules() == ["nsa"]
    assert zoo.get_module_spec("nsa").parameters()["select_count"] == 16  # the published n
    with pytest.raises(TypeError, match="did you mean 'select_count'"):
        zoo.create_attention("nsa", dim=DIM, num_heads=HEADS, select_cuont=3)


@pytest.mark.parametrize(
    "padding,error,match",
    [
        (torch.zeros(2, L - 1, dtype=torch.bool), ValueError, rf"\(batch, kv_len\) = \(2, {L}\)"),
        (torch.zeros(2, L), TypeError, "must be a bool tensor.*got dtype torch.float32"),
        (torch.zeros(2, L, dtype=torch.long), TypeError, "got dtype torch.int64"),
    ],
    ids=["short", "float", "long"],
)
def test_a_bad_key_padding_mask_names_what_it_must_be(padding, error, match):
    """As MultiHeadAttention refuses it; these failed inside the branches with PyTorch's messages
    (a size mismatch, '~ is only implemented on integer and Boolean-type tensors', 'expected
    condition to be a boolean tensor')."""
    x, _ = inputs()
    with pytest.raises(error, match=match):
        make()(x, key_padding_mask=padding)


def test_padding_holding_nan_leaves_every_gradient_finite():
    """The projections' weight gradients sum x over every position: NaN in a padded one made
    them NaN (0 * NaN) although no real row read it."""
    module = make()
    x = torch.randn(2, L, DIM, dtype=torch.float64)
    x[1, 30:] = float("nan")
    out = module(x, valid_lens=torch.tensor([L, 30]))
    torch.cat([out[0], out[1, :30]]).sum().backward()
    for name, parameter in module.named_parameters():
        assert parameter.grad.isfinite().all(), name
