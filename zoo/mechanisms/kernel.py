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

Features whose size spans more than a float can hold (performer's exponentials) come as
φ(k_j) = ψ_j·exp(c_j): ψ_j of at most 1 and the log-scale c_j apart (``key_log_scale``). Each
query's sums are then taken relative to the largest c_j among the keys it sees, a factor that
cancels in the normalised weights; a key more than a float's range below that largest gets
weight 0. Causally that largest is a running maximum, so a later key never changes what an
earlier query rounds away: inside a chunk each pair gets exp(c_j - largest_i); the states of
earlier chunks are summed at the largest scale before each chunk (``_scaled_exclusive_sums``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from ..core.narrowed import narrowed


def feature_attention(
    phi_q: Tensor,
    phi_k: Tensor,
    v: Tensor,
    *,
    causal: bool,
    chunk_size: int,
    key_log_scale: Tensor | None = None,
) -> Tensor:
    """φ(q) (B, H, Lq, m), φ(k) (B, H, Lk, m), v (B, H, Lk, Dv) -> (B, H, Lq, Dv).

    ``key_log_scale`` (B, H, Lk), without gradient: the keys' features are φ(k) times its exp
    (see the module docstring); -inf where φ(k) is 0. Causal with Lq != Lk aligns bottom-right:
    query i sees keys j <= i + Lk - Lq."""
    if not causal:
        if key_log_scale is not None:  # every query sees every key: one largest scale
            phi_k = phi_k * _ratio(key_log_scale, key_log_scale.amax(2, keepdim=True))[..., None]
        state = torch.einsum("bhnm,bhnd->bhmd", phi_k, v)  # (B, H, m, Dv)
        norm = phi_k.sum(dim=2)  # (B, H, m)
        return _divide(phi_q @ state, torch.einsum("bhlm,bhm->bhl", phi_q, norm))
    q_len, kv_len = phi_q.shape[2], phi_k.shape[2]
    if q_len > kv_len:  # the first Lq - Lk queries come before every key: zeros
        out = feature_attention(
            phi_q[:, :, q_len - kv_len :], phi_k, v, causal=True, chunk_size=chunk_size,
            key_log_scale=key_log_scale,
        )  # fmt: skip
        return F.pad(out, (0, 0, q_len - kv_len, 0))
    prefix = kv_len - q_len  # keys every query sees
    earlier, start = phi_k[:, :, :prefix], None
    if key_log_scale is not None:
        scale, key_log_scale = key_log_scale[:, :, :prefix], key_log_scale[:, :, prefix:]
        start = scale.amax(2) if prefix else phi_k.new_full(scale.shape[:2], -torch.inf)
        earlier = earlier * _ratio(scale, start[..., None])[..., None]
    state = torch.einsum("bhnm,bhnd->bhmd", earlier, v[:, :, :prefix])
    norm = earlier.sum(dim=2)
    tail = phi_k[:, :, prefix:], v[:, :, prefix:]
    return _chunked_causal(phi_q, *tail, state, norm, chunk_size, key_log_scale, start)


def _chunked_causal(
    phi_q: Tensor,
    phi_k: Tensor,
    v: Tensor,
    state: Tensor,
    norm: Tensor,
    chunk: int,
    key_log_scale: Tensor | None = None,
    start: Tensor | None = None,
) -> Tensor:
    """Causal with Lq == Lk, given the state (B, H, m, Dv) and norm (B, H, m) of earlier keys
    (at the log-scale ``start`` (B, H), the largest of theirs, where keys carry scales)."""
    length = phi_q.shape[2]
    pad = -length % chunk  # zero rows: padded keys add nothing, padded queries are cropped
    phi_q, phi_k, v = (F.pad(t, (0, 0, 0, pad)) for t in (phi_q, phi_k, v))
    n = (length + pad) // chunk
    pq, pk, vc = (t.unflatten(2, (n, chunk)) for t in (phi_q, phi_k, v))  # (B, H, n, C, ·)
    inside = torch.einsum("bhncm,bhnem->bhnce", pq, pk)  # (B, H, n, C, C)
    inside = inside * torch.ones(chunk, chunk, device=v.device, dtype=torch.bool).tril()
    if key_log_scale is None:
        chunk_state = torch.einsum("bhncm,bhncd->bhnmd", pk, vc)  # (B, H, n, m, Dv)
        chunk_norm = pk.sum(dim=3)  # (B, H, n, m)
        # exclusive cumulative sums: chunk c sees chunks 0 .. c-1, and the earlier keys
        before = _exclusive_cumsum(chunk_state, state)
        before_norm = _exclusive_cumsum(chunk_norm, norm)
    else:
        scale = F.pad(key_log_scale, (0, pad), value=-torch.inf)
        # each query's largest scale among the keys it sees, and each chunk's own largest
        seen = torch.cummax(torch.maximum(scale, start[..., None]), dim=2).values
        scale, seen = scale.unflatten(2, (n, chunk)), seen.unflatten(2, (n, chunk))
        top = scale.amax(dim=3)  # (B, H, n)
        own = pk * _ratio(scale, top[..., None])[..., None]  # each chunk's keys at its top
        chunk_state = torch.einsum("bhncm,bhncd->bhnmd", own, vc)
        (before, before_norm), below = _scaled_exclusive_sums(
            (chunk_state, own.sum(dim=3)), top, (state, norm), start
        )
        inside = inside * _ratio(scale[..., None, :], seen[..., None])  # exp(c_j - seen_i)
        pq = pq * _ratio(below[..., None], seen)[..., None]  # earlier chunks, to seen_i
    num = inside @ vc + torch.einsum("bhncm,bhnmd->bhncd", pq, before)
    den = inside.sum(dim=-1) + torch.einsum("bhncm,bhnm->bhnc", pq, before_norm)
    out = _divide(num, den).flatten(2, 3)  # (B, H, n·C, Dv)
    return narrowed(out, 2, 0, length)


def _ratio(scale: Tensor, largest: Tensor) -> Tensor:
    """exp(scale - largest), broadcast, at most 1 (the largest is that of a set holding the
    scale; elsewhere the caller masks it); 0 where scale is -inf, -inf - -inf included."""
    return torch.where(scale == -torch.inf, 0, torch.exp((scale - largest).clamp(max=0)))


def _scaled_exclusive_sums(
    items: tuple[Tensor, ...], top: Tensor, first: tuple[Tensor, ...], first_top: Tensor
) -> tuple[tuple[Tensor, ...], Tensor]:
    """For sums X_c along dim 2 (shapes (B, H, n, ...)), each at the log-scale top_c (B, H, n),
    and earlier sums X_0 at first_top (B, H): each c's sum of X_0 and the X_c' before it, at
    below_c = max(first_top, top_c' < c), and below. Two levels of groups of about sqrt(n):
    O(n^1.5) small sums, where one matrix of exp(top_c' - below_c) would be O(n^2)."""
    n = top.shape[2]
    size = math.isqrt(n - 1) + 1 if n > 1 else 1  # groups of size items, size >= sqrt(n)
    groups = -(-n // size)
    pad = groups * size - n
    top = F.pad(top, (0, pad), value=-torch.inf).unflatten(2, (groups, size))
    items = tuple(
        F.pad(x.flatten(3), (0, 0, 0, pad)).unflatten(2, (groups, size)) for x in items
    )  # (B, H, groups, size, F)
    group_top = top.amax(dim=3)  # (B, H, groups)
    weight = _ratio(top, group_top[..., None])[..., None]
    totals = tuple((weight * x).sum(dim=3) for x in items)  # (B, H, groups, F)
    starts, start_top = _exclusive_by_matrix(
        totals, group_top, tuple(x.flatten(2) for x in first), first_top
    )
    sums, below = _exclusive_by_matrix(items, top, starts, start_top)
    shapes = (x.shape[2:] for x in first)
    sums = tuple(
        s.flatten(2, 3)[:, :, :n].unflatten(-1, shape)
        for s, shape in zip(sums, shapes, strict=True)
    )
    return sums, below.flatten(2)[:, :, :n]


def _exclusive_by_matrix(
    items: tuple[Tensor, ...], top: Tensor, first: tuple[Tensor, ...], first_top: Tensor
) -> tuple[tuple[Tensor, ...], Tensor]:
    """``_scaled_exclusive_sums`` along the last dim of ``top`` (..., k), items (..., k, F), with
    one (k, k) matrix of exp(top_c' - below_c) for c' < c."""
    k = top.shape[-1]
    below = torch.cummax(torch.cat([first_top[..., None], top[..., :-1]], dim=-1), dim=-1).values
    earlier = torch.ones(k, k, device=top.device, dtype=torch.bool).tril(-1)
    decay = _ratio(top[..., None, :], below[..., :, None]) * earlier  # (..., k, k)
    lift = _ratio(first_top[..., None], below)[..., None]  # (..., k, 1)
    return tuple(
        decay @ x + lift * x0[..., None, :] for x, x0 in zip(items, first, strict=True)
    ), below


def _exclusive_cumsum(chunks: Tensor, start: Tensor) -> Tensor:
    """start + the sum of chunks 0 .. c-1, for each chunk c along dim 2."""
    shifted = torch.cat([start[:, :, None], chunks[:, :, :-1]], dim=2)
    return torch.cumsum(shifted, dim=2)


def _divide(num: Tensor, den: Tensor) -> Tensor:
    """num / den per query row; den = 0 only where every weight is 0 (then num = 0 too)."""
    return num / torch.where(den > 0, den, 1)[..., None]
