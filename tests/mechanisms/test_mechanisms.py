"""Mechanisms against straightforward implementations of their definitions (zoo/mechanisms/).

Every registry mechanism is held, forward and gradients, to an oracle written here from its
paper's formula in float64 (the quadratic form φ(q)φ(k)ᵀ normalised; Linformer's projected
softmax; Nyström's three kernels), by the tolerance convention of ``helpers``. A new entry in the
``mechanisms:`` section is picked up by the parametrisation; its family needs an oracle in
``ORACLES``. Properties from the issue: the chunked causal form equals the recurrent one,
Performer is unbiased and improves with more features, Nyström with one landmark per token and
an exact inverse is softmax attention, Linformer with identity projections is full attention.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_within_convention, outputs_and_grads, padding_mask, random_qkv

import zoo

MECHANISMS = zoo.list_mechanisms()
SMALL = {"num_landmarks": 8, "proj_len": 16, "max_len": 64, "chunk_size": 8, "num_features": 32}


def build(name: str, heads: int = 2, head_dim: int = 16, **params):
    """The registry mechanism at test sizes, its learned parameters drawn from a fixed seed."""
    spec = zoo.get_mechanism_spec(name)
    small = {key: value for key, value in SMALL.items() if key in spec.parameters()}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return spec.build(num_heads=heads, head_dim=head_dim, **{**small, **params}).double()


def visible(q_len, kv_len, causal, mask):
    """(B or 1, 1, Lq, Lk) bool: the keys each query sees (bottom-right causal, no padding)."""
    allowed = torch.ones(q_len, kv_len, dtype=torch.bool)
    if causal:
        allowed = allowed.tril(kv_len - q_len)
    allowed = allowed[None, None]
    return allowed if mask is None else allowed & ~mask[:, None, None, :]


def normalised(weights):
    """Rows divided by their sums; a row of zeros stays zeros."""
    total = weights.sum(-1, keepdim=True)
    return weights / torch.where(total > 0, total, 1)


def oracle_linear(mech, q, k, v, causal, mask, scale):
    phi_q, phi_k = F.elu(q) + 1, F.elu(k) + 1
    weights = (phi_q @ phi_k.transpose(-1, -2)) * visible(q.shape[2], k.shape[2], causal, mask)
    return normalised(weights) @ v


def oracle_performer(mech, q, k, v, causal, mask, scale):
    w = mech.projection.to(q.dtype)
    phi = [
        torch.exp(x @ w.T * scale**0.5 - (x * x).sum(-1, keepdim=True) * scale / 2) for x in (q, k)
    ]
    weights = (phi[0] @ phi[1].transpose(-1, -2)) * visible(q.shape[2], k.shape[2], causal, mask)
    return normalised(weights) @ v


def oracle_linformer(mech, q, k, v, causal, mask, scale):
    n = k.shape[2]
    keep = 1.0 if mask is None else (~mask).to(q.dtype)[:, None, :, None]
    keys = mech.key_proj[:, :n].to(q.dtype) @ (k * keep)  # (B, H, k, D)
    values = mech.value_proj[:, :n].to(q.dtype) @ (v * keep)
    out = torch.softmax(q @ keys.transpose(-1, -2) * scale, dim=-1) @ values
    return out if mask is None else out * (~mask.all(1)).to(q.dtype)[:, None, None, None]


def oracle_nystrom(mech, q, k, v, causal, mask, scale):
    """Per sequence: key segments cut over its valid keys (valid key i of L in segment
    floor(i·m / L)), query segments over all query rows; a segment with no valid key drops its
    landmark."""
    n_q, n_k = q.shape[2], k.shape[2]
    m = min(mech.num_landmarks, n_q)  # not bounded by n_k, which counts padded keys
    keep = torch.ones(k.shape[0], n_k, dtype=torch.bool) if mask is None else ~mask
    q_keep = torch.ones(q.shape[0], n_q, dtype=torch.bool)
    outs = []
    for b in range(q.shape[0]):

        def marks(x, kept):  # (H, n, D), (n,) -> (H, m, D) means, (m,) present
            rows = kept.nonzero()[:, 0]
            segment = torch.arange(len(rows)) * m // max(len(rows), 1)
            groups = [rows[segment == i] for i in range(m)]
            means = [x[:, g].mean(1) if len(g) else x.new_zeros(x.shape[0], x.shape[2])
                     for g in groups]  # fmt: skip
            return torch.stack(means, 1), torch.tensor([len(g) > 0 for g in groups])

        q_marks, q_present = marks(q[b], q_keep[b])
        k_marks, k_present = marks(k[b], keep[b])

        def softmax(scores, allowed):
            return normalised(torch.exp(scores) * allowed)

        kernel_1 = softmax(q[b] @ k_marks.transpose(-1, -2) * scale, k_present)
        both = q_present[:, None] & k_present[None, :]
        kernel_2 = softmax(q_marks @ k_marks.transpose(-1, -2) * scale, both)
        kernel_3 = softmax(q_marks @ k[b].transpose(-1, -2) * scale, q_present[:, None] & keep[b])
        z = (
            kernel_2.transpose(-1, -2)
            / (kernel_2.sum(-2).amax(-1) * kernel_2.sum(-1).amax(-1)).clamp_min(1e-30)[
                ..., None, None
            ]
        )
        eye = torch.eye(m, dtype=q.dtype)
        for _ in range(mech.pinv_iterations):
            kz = kernel_2 @ z
            z = z @ (13 * eye - kz @ (15 * eye - kz @ (7 * eye - kz))) / 4
        outs.append(kernel_1 @ z @ kernel_3 @ v[b])
    return torch.stack(outs)


ORACLES = {
    "linear": oracle_linear,
    "performer": oracle_performer,
    "linformer": oracle_linformer,
    "nystrom": oracle_nystrom,
}


def cases(name):
    causal = [False, True] if zoo.get_mechanism_spec(name).mechanism_class().causal else [False]
    return [(name, c, lens) for c in causal for lens in ((37, 37), (19, 37), (37, 19))]


@pytest.mark.parametrize(("name", "causal", "lens"), [c for n in MECHANISMS for c in cases(n)])
@pytest.mark.parametrize("padded", [False, True])
def test_matches_its_definition(name, causal, lens, padded):
    """Forward and gradients within the convention of the oracle, causal or not, padded or not,
    Lq = Lk and both ways of Lq != Lk; grouped-query k, v (2 query heads per kv head)."""
    family = zoo.get_mechanism_spec(name).mechanism
    assert family in ORACLES, f"mechanism family {family!r} needs an oracle in ORACLES"
    q_len, kv_len = lens
    mech = build(name, heads=2)
    q, k, v = random_qkv(3, 2, q_len, kv_len, kv_heads=1, seed=q_len + kv_len)
    mask = padding_mask(3, kv_len) if padded else None
    scale = 1 / 4 if mech.scale else None
    grad_out = torch.randn(3, 2, q_len, 16, generator=torch.Generator().manual_seed(1))

    def zoo_call(q, k, v):
        return zoo.attention(
            q, k, v, variant=mech.float(), causal=causal, key_padding_mask=mask, scale=scale
        )

    def oracle(dtype):
        def run(q, k, v):
            k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
            oracle_mech = mech.to(dtype)
            return ORACLES[family](oracle_mech, q, k, v, causal, mask, scale or 1.0)

        return run

    inputs = [t.detach().double().requires_grad_() for t in (q, k, v)]
    reference = outputs_and_grads(oracle(torch.float64), inputs, grad_out.double())
    baseline = outputs_and_grads(oracle(torch.float32), [q, k, v], grad_out)
    results = outputs_and_grads(zoo_call, [q, k, v], grad_out)
    assert all(torch.isfinite(r).all() for r in results)
    assert_within_convention(results, baseline, reference)
