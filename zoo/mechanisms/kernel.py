"""Attention through a positive feature map: the shared core of ``linear`` and ``performer``.

With features φ(q_i), φ(k_j) >= 0 (m of them), the weight of key j for query i is
φ(q_i)·φ(k_j) normalised over the keys it sees::

    out_i = Σ_j φ(q_i)·φ(k_j) v_j / Σ_j φ(q_i)·φ(k_j)

Non-causal, associativity gives O(n·m·Dv): S = Σ_j φ(k_j) v_jᵀ (m, Dv) and z = Σ_j φ(k_j) (m)
once, then out_i = φ(q_i)ᵀS / φ(q_i)ᵀz. Causal, the recurrent form keeps running S_i, z_i over
j <= i. The chunked form here computes the same sums in chunks of C positions: the quadratic
form inside a chunk (C x C, lower triangle) plus the state of all earlier chunks (an exclusive
cumulative sum over chunks), which is exact and parallel::

    chunk c:  [ state S_<c ]  +  [ φ(q) φ(k)ᵀ ⊙ tril ] v      (positions c·C .. c·C + C - 1)

Padded keys have φ(k_j) = 0 (the caller zeroes them), so they add nothing to S, z or any
chunk. A query that sees no key (all padded, or before the first key when Lq > Lk causally)
has Σ = 0 and outputs zeros.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..core.narrowed import narrowed


def feature_attention(
    phi_q: Tensor, phi_k: Tensor, v: Tensor, *, causal: bool, chunk_size: int
) -> Tensor:
    """φ(q) (B, H, Lq, m), φ(k) (B, H, Lk, m), v (B, H, Lk, Dv) -> (B, H, Lq, Dv).

    Causal with Lq != Lk aligns bottom-right: query i sees keys j <= i + Lk - Lq."""
    if not causal:
        state = torch.einsum("bhnm,bhnd->bhmd", phi_k, v)  # (B, H, m, Dv)
        norm = phi_k.sum(dim=2)  # (B, H, m)
        return _divide(phi_q @ state, torch.einsum("bhlm,bhm->bhl", phi_q, norm))
    q_len, kv_len = phi_q.shape[2], phi_k.shape[2]
    if q_len > kv_len:  # the first Lq - Lk queries come before every key: zeros
        out = feature_attention(
            phi_q[:, :, q_len - kv_len :], phi_k, v, causal=True, chunk_size=chunk_size
        )
        return F.pad(out, (0, 0, q_len - kv_len, 0))
    prefix = kv_len - q_len  # keys every query sees
    state = torch.einsum("bhnm,bhnd->bhmd", phi_k[:, :, :prefix], v[:, :, :prefix])
    norm = phi_k[:, :, :prefix].sum(dim=2)
    return _chunked_causal(phi_q, phi_k[:, :, prefix:], v[:, :, prefix:], state, norm, chunk_size)


def _chunked_causal(
    phi_q: Tensor, phi_k: Tensor, v: Tensor, state: Tensor, norm: Tensor, chunk: int
) -> Tensor:
    """Causal with Lq == Lk, given the state (B, H, m, Dv) and norm (B, H, m) of earlier keys."""
    length = phi_q.shape[2]
    pad = -length % chunk  # zero rows: padded keys add nothing, padded queries are cropped
    phi_q, phi_k, v = (F.pad(t, (0, 0, 0, pad)) for t in (phi_q, phi_k, v))
    n = (length + pad) // chunk
    pq, pk, vc = (t.unflatten(2, (n, chunk)) for t in (phi_q, phi_k, v))  # (B, H, n, C, ·)
    chunk_state = torch.einsum("bhncm,bhncd->bhnmd", pk, vc)  # (B, H, n, m, Dv)
    chunk_norm = pk.sum(dim=3)  # (B, H, n, m)
    # exclusive cumulative sums: chunk c sees chunks 0 .. c-1, and the earlier keys
    before = _exclusive_cumsum(chunk_state, state)
    before_norm = _exclusive_cumsum(chunk_norm, norm)
    inside = torch.einsum("bhncm,bhnem->bhnce", pq, pk)  # (B, H, n, C, C)
    inside = inside * torch.ones(chunk, chunk, device=v.device, dtype=torch.bool).tril()
    num = inside @ vc + torch.einsum("bhncm,bhnmd->bhncd", pq, before)
    den = inside.sum(dim=-1) + torch.einsum("bhncm,bhnm->bhnc", pq, before_norm)
    out = _divide(num, den).flatten(2, 3)  # (B, H, n·C, Dv)
    return narrowed(out, 2, 0, length)


def _exclusive_cumsum(chunks: Tensor, start: Tensor) -> Tensor:
    """start + the sum of chunks 0 .. c-1, for each chunk c along dim 2."""
    shifted = torch.cat([start[:, :, None], chunks[:, :, :-1]], dim=2)
    return torch.cumsum(shifted, dim=2)


def _divide(num: Tensor, den: Tensor) -> Tensor:
    """num / den per query row; den = 0 only where every weight is 0 (then num = 0 too)."""
    return num / torch.where(den > 0, den, 1)[..., None]
