"""The 'none' encoding: attention without position information (a bag of tokens)."""

from __future__ import annotations

from torch import Tensor

from .base import PositionalEncoding


class NoPositionalEncoding(PositionalEncoding):
    """No position information: ``embed(x)`` returns ``x`` unchanged; no parameters.

    Useful as a baseline: without it, attention is permutation-equivariant, so a causal mask is
    the only source of order.
    """

    name = "none"
    kind = "none"

    def embed(self, x: Tensor, offset: int = 0) -> Tensor:
        return x
