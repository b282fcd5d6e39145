"""``linear``: the Linear Transformer's attention, φ(x) = elu(x) + 1 (Katharopoulos et al., 2020).

The softmax kernel exp(q·k) is replaced by φ(q)·φ(k) with φ(x) = elu(x) + 1 > 0, applied
elementwise to each head's D features, so the weights are::

    a_ij = φ(q_i)·φ(k_j) / Σ_j' φ(q_i)·φ(k_j')

Non-causal by associativity (φ(q) (φ(k)ᵀ v)), O(n·D·Dv); causal by the chunked form of
``zoo.mechanisms.kernel``, equal to the paper's recurrent form (a running sum of φ(k_j) v_jᵀ).
There is no temperature: ``scale`` is refused. Published setting: φ = elu + 1, no parameters
(LRA Table 1: ListOps 16.13, average 50.55).

Parameters: ``chunk_size`` (64), the causal chunk length C: it changes the cost (C² per chunk
against D·Dv per chunk's state), never the result.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..core.arguments import check_int
from .base import Mechanism, zero_padded
from .kernel import feature_attention


def elu_features(x: Tensor) -> Tensor:
    """φ(x) = elu(x) + 1, elementwise: positive, and x + 1 for x >= 0. Written as exp(x) for
    x < 0: elu(x) + 1 = (exp(x) - 1) + 1 cancels in float32 (φ(-20) came out 0, a key that
    weighs nothing), and torch.compile's backward of elu on a transposed view failed (torch
    2.13). The exp branch reads x clamped to 0 or below, so its unused values stay finite and
    its gradient at large x is 0, not inf * 0."""
    return torch.where(x > 0, x + 1, torch.exp(x.clamp(max=0)))


class LinearAttention(Mechanism):
    family = "linear"
    scale = False

    def __init__(self, *, num_heads: int, head_dim: int, chunk_size: int = 64) -> None:
        super().__init__(num_heads=num_heads, head_dim=head_dim)
        self.chunk_size = check_int("chunk_size", chunk_size)

    def reason(self, capability: str) -> str:
        return "φ(q)·φ(k) with φ = elu + 1 has no temperature"

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        causal: bool,
        key_padding_mask: Tensor | None,
        scale: float,
    ) -> Tensor:
        dtype = torch.float64 if q.dtype == torch.float64 else torch.float32  # sums in fp32
        phi_q, phi_k, v = elu_features(q.to(dtype)), elu_features(k.to(dtype)), v.to(dtype)
        if key_padding_mask is not None:
            phi_k, v = zero_padded(phi_k, key_padding_mask), zero_padded(v, key_padding_mask)
        out = feature_attention(phi_q, phi_k, v, causal=causal, chunk_size=self.chunk_size)
        return out.to(q.dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, chunk_size={self.chunk_size}"
