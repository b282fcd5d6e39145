"""How a query is scored against a key: the scaled dot product, or additive attention.

The seed notes give both. A score works in two steps so that sparse backends can gather blocks in
between: ``prepare`` maps the per-token q and k once, ``pairwise`` scores every query of a block
against every key gathered for it. Scores come back in float32 (float64 for float64 inputs), the
precision in which the softmax runs.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn


def score_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


class DotProduct:
    """``scale * q . k`` (Vaswani et al. 2017); scale defaults to 1/sqrt(head_dim)."""

    kind = "dot"

    def __init__(self, scale: float) -> None:
        self.scale = scale

    def prepare(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        """Scale q once per token rather than every score."""
        return q * self.scale, k

    def pairwise(self, q: Tensor, k: Tensor) -> Tensor:
        """q [..., Lq, D] (scaled), k [..., Lk, D] -> [..., Lq, Lk]."""
        return (q @ k.transpose(-1, -2)).to(score_dtype(q))


class AdditiveScore(nn.Module):
    """Additive attention (Bahdanau et al. 2015): ``w_v . tanh(W_q q + W_k k)`` per head.

    It keeps a [..., Lq, Lk, hidden] tensor per block, so it costs ``hidden`` times the memory of
    the dot product: use it on the backends that declare it (reference, blocked).
    """

    kind = "additive"

    def __init__(self, num_heads: int, head_dim: int, hidden: int | None = None) -> None:
        super().__init__()
        hidden = hidden or head_dim
        self.w_q = nn.Parameter(torch.empty(num_heads, head_dim, hidden))
        self.w_k = nn.Parameter(torch.empty(num_heads, head_dim, hidden))
        self.w_v = nn.Parameter(torch.empty(num_heads, hidden))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """W_q, W_k and w_v from U(-1/sqrt(head_dim), 1/sqrt(head_dim)): as built, and after a
        model made on the meta device is materialised (``to_empty``, then each module's reset)."""
        bound = 1 / math.sqrt(self.w_q.shape[1])
        with torch.no_grad():
            for weight in (self.w_q, self.w_k, self.w_v):
                weight.uniform_(-bound, bound)

    def prepare(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        """(B, H, L, D) -> (B, H, L, hidden), once per token. Grouped k (B, H_kv, L, D) is
        repeated to the H query heads first: each query head maps the keys with its own W_k."""
        dtype = score_dtype(q)
        if k.shape[1] != q.shape[1]:
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        w_q, w_k = self.w_q.to(dtype), self.w_k.to(dtype)
        return (
            torch.einsum("bhld,hde->bhle", q.to(dtype), w_q),
            torch.einsum("bhld,hde->bhle", k.to(dtype), w_k),
        )

    def pairwise(self, q: Tensor, k: Tensor) -> Tensor:
        """q [B, H, ..., Lq, e], k [B, H, ..., Lk, e] -> [B, H, ..., Lq, Lk]."""
        features = torch.tanh(q.unsqueeze(-2) + k.unsqueeze(-3))  # (B, H, ..., Lq, Lk, e)
        w_v = self.w_v.to(features.dtype).view(
            1, -1, *([1] * (features.dim() - 3)), self.w_v.shape[1]
        )
        return (features * w_v).sum(-1)
