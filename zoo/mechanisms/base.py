"""A mechanism: attention computed differently rather than masked (linear, kernel, low-rank).

A pattern says which (query, key) pairs a softmax over q·k may use, and any backend computes it.
A mechanism replaces that softmax by something else (a feature map, a projection along the
sequence, landmarks), so it computes attention itself and has no backend and no mask. It shares
the call and the module interface of the patterns, and declares what it supports:

============== ==================================================================================
``causal``     it can let query i see only keys j <= i + Lk - Lq (the bottom-right alignment
               of ``zoo.patterns.base``)
``key_padding``padded keys (``key_padding_mask``) contribute nothing to any output
``cross``      Lq != Lk (cross-attention)
``scale``      it has a score scale (``scale=``, default 1/sqrt(D)); elu+1 features have none
============== ==================================================================================

Every mechanism runs grouped-query attention (k and v heads are shared by groups of query heads,
repeated before it runs) and rotary positions (``pos="rope"`` turns q and k first). None forms
the (Lq, Lk) scores, so score biases (ALiBi, T5), dropout on the weights, ``return_weights`` and
the additive score are refused with the reason.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..core.arguments import check_int


class Mechanism(nn.Module):
    """Base class. A subclass sets ``family`` and the capability flags, takes ``num_heads`` and
    ``head_dim`` plus its own keyword parameters, and implements ``forward``."""

    family = "mechanism"  # the class's registered name (see zoo.mechanisms.MECHANISMS)
    causal = True
    key_padding = True
    cross = True
    scale = True
    # Its output mixes every query row (Nystrom's query landmarks): in self-attention with
    # padding MultiHeadAttention zeroes the padded positions' queries first.
    summarises_queries = False

    def __init__(self, *, num_heads: int, head_dim: int) -> None:
        super().__init__()
        self.num_heads = check_int("num_heads", num_heads)
        self.head_dim = check_int("head_dim", head_dim)
        self.name = self.family  # the registry entry's name, set by MechanismSpec.build

    @property
    def learned(self) -> bool:
        """Whether it has trained parameters (then only a module can hold it)."""
        return any(True for _ in self.parameters())

    def call_state(self) -> str | None:
        """What state it keeps across calls, if any (a functional call has none to keep)."""
        return None

    def check_call(
        self, *, causal: bool, q_len: int, kv_len: int, padded: bool, scaled: bool
    ) -> None:
        """Refuse what this mechanism does not support; the error names it and the way out."""
        if causal and not self.causal:
            raise ValueError(
                f"mechanism {self.name!r} is non-causal only: {self.reason('causal')}; "
                "use causal=False, or a causal mechanism (linear, performer)"
            )
        if padded and not self.key_padding:
            raise ValueError(f"mechanism {self.name!r} does not take a key_padding_mask")
        if q_len != kv_len and not self.cross:
            raise ValueError(
                f"mechanism {self.name!r} needs q_len == kv_len, got {q_len} and {kv_len}: "
                f"{self.reason('cross')}"
            )
        if scaled and not self.scale:
            raise ValueError(
                f"mechanism {self.name!r} has no score scale ({self.reason('scale')}); "
                "leave scale=None"
            )

    def reason(self, capability: str) -> str:
        """Why a capability is missing, for the error message."""
        return "not supported"

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
        """q (B, H, Lq, D), k (B, H, Lk, D), v (B, H, Lk, Dv) with H heads each (grouped heads
        already repeated) -> (B, H, Lq, Dv). ``key_padding_mask`` (B, Lk) is True at padding."""
        raise NotImplementedError

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, head_dim={self.head_dim}"


def check_optional_int(name: str, value: object, minimum: int = 1) -> int | None:
    return None if value is None else check_int(name, value, minimum=minimum)


def zero_padded(x: Tensor, key_padding_mask: Tensor) -> Tensor:
    """x (B, H, Lk, ·) with the rows of padded keys set to 0 (a NaN there cannot leak)."""
    return torch.where(key_padding_mask[:, None, :, None], 0, x)
