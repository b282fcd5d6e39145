"""``linformer``: keys and values projected along the sequence (Wang et al., 2020).

Learned E, F (proj_len, max_len) project the n keys and values to proj_len rows, and softmax
attention runs over those::

    out = softmax(s · Q (E_n K)ᵀ) (F_n V),   E_n, F_n = the first n columns of E, F

    K (n, D) --E_n (k, n)--> (k, D)          scores (Lq, k) instead of (Lq, n): O(n·k·D)

One E and one F per layer, shared by its heads (the paper's headwise sharing), initialised
uniform in ±1/sqrt(proj_len). Every projected row mixes all positions, so there is no causal
form: non-causal only (refused). Cross-attention works (the projection acts on the keys only);
keys longer than max_len are refused. Padded keys are zeroed before the projection, so they add
nothing. E and F are learned: only a module holds them (``create_attention("linformer", ...)``);
the functional call refuses the name.

Parameters (published defaults): proj_len k = 256, max_len = 4096 (the zoo's; the paper fixes
it to the training length). LRA Table 1: ListOps 35.70, average 51.36.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from torch.nn.functional import scaled_dot_product_attention

from ..core.arguments import check_int
from .base import Mechanism, zero_padded


def _project(e: Tensor, x: Tensor) -> Tensor:
    """E (k, n) applied along the sequence of x (B, H, n, D) -> (B, H, k, D), as one matrix
    product over all batches and heads."""
    batch, heads, n, width = x.shape
    flat = x.permute(2, 0, 1, 3).reshape(n, batch * heads * width)  # (n, B·H·D)
    return (e @ flat).reshape(e.shape[0], batch, heads, width).permute(1, 2, 0, 3)


class LinformerAttention(Mechanism):
    family = "linformer"
    causal = False

    def __init__(
        self, *, num_heads: int, head_dim: int, proj_len: int = 256, max_len: int = 4096
    ) -> None:
        super().__init__(num_heads=num_heads, head_dim=head_dim)
        self.proj_len = check_int("proj_len", proj_len)
        self.max_len = check_int("max_len", max_len)
        self.key_proj = nn.Parameter(torch.empty(proj_len, max_len))
        self.value_proj = nn.Parameter(torch.empty(proj_len, max_len))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """E and F from U(-1/sqrt(proj_len), 1/sqrt(proj_len)): as built, and after a model made
        on the meta device is materialised (``to_empty``, then each module's reset)."""
        bound = 1 / math.sqrt(self.proj_len)
        with torch.no_grad():
            self.key_proj.uniform_(-bound, bound)
            self.value_proj.uniform_(-bound, bound)

    def reason(self, capability: str) -> str:
        return "each projected key mixes every position, later ones included"

    def check_call(
        self, *, causal: bool, q_len: int, kv_len: int, padded: bool, scaled: bool
    ) -> None:
        super().check_call(causal=causal, q_len=q_len, kv_len=kv_len, padded=padded, scaled=scaled)
        if kv_len > self.max_len:
            raise ValueError(
                f"mechanism {self.name!r} was built for at most max_len={self.max_len} keys, got "
                f"kv_len={kv_len}; build it with max_len >= {kv_len}"
            )

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
        n = k.shape[2]
        if key_padding_mask is not None:
            k, v = zero_padded(k, key_padding_mask), zero_padded(v, key_padding_mask)
        dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        k_proj = _project(self.key_proj[:, :n].to(dtype), k.to(dtype))  # (B, H, k, D)
        v_proj = _project(self.value_proj[:, :n].to(dtype), v.to(dtype))  # (B, H, k, Dv)
        # softmax(s · Q K_pᵀ) V_p is attention over proj_len keys, none masked: the fused kernel
        # tiles the queries, so the (Lq, k) scores never exist whole. Materialised, they outgrew
        # the CPU's cache past 4K tokens and the time grew as n^1.3 (bench-mechanisms-cpu).
        out = scaled_dot_product_attention(q.to(dtype), k_proj, v_proj, scale=scale)
        if key_padding_mask is not None:  # every key padded: no key to attend, zeros
            out = torch.where(key_padding_mask.all(dim=1)[:, None, None, None], 0, out)
        return out.to(q.dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, proj_len={self.proj_len}, max_len={self.max_len}"
