"""Fixed sinusoidal absolute positions (Vaswani et al. 2017, "Attention Is All You Need")."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..core.arguments import check_int, check_probability
from .base import PositionalEncoding, check_number


class SinusoidalEncoding(PositionalEncoding):
    """Adds the fixed table P to the input: ``embed(x) = dropout(x + P[offset : offset + L])``.

    With ``d = dim`` and ``w_j = 1 / base ** (2j / d)`` for ``j = 0, 1, ..., ceil(d / 2) - 1``::

        P[i, 2j]     = sin(i * w_j)
        P[i, 2j + 1] = cos(i * w_j)

    the seed's formula. For an odd ``dim`` the last column is ``sin(i * w_j)`` alone, with
    ``j = (d - 1) / 2``, and no cosine partner. Each (sin, cos) column pair turns by a fixed angle
    per step, so ``P[i + k]`` is a rotation of ``P[i]`` that depends on ``k`` only.

    P is computed from the positions on each call (in float64 where the device has it, then cast
    to float32), so any length works and long positions keep full float32 accuracy; there is no
    table to run out.

    Args:
        base: the wavelength scale (10000 in the paper); a number greater than 1.
        dropout: the dropout probability applied after the addition, in [0, 1).
    """

    name = "sinusoidal"
    kind = "embed"

    def __init__(
        self,
        *,
        dim: int,
        num_heads: int,
        causal: bool = False,
        base: float = 10000.0,
        dropout: float = 0.0,
    ) -> None:
        super().__init__(dim=dim, num_heads=num_heads, causal=causal)
        self.base = check_number("base", base, lambda v: v > 1, "a number greater than 1")
        self.dropout = nn.Dropout(check_probability("dropout", dropout))

    def table(
        self, length: int, offset: int = 0, *, device: torch.device | str | None = None
    ) -> Tensor:
        """P for positions ``offset .. offset + length - 1``: a float32 (length, dim) tensor."""
        check_int("length", length, minimum=0)
        check_int("offset", offset, minimum=0)
        device = torch.device("cpu") if device is None else torch.device(device)
        return self.table_at(torch.arange(offset, offset + length, device=device))

    def table_at(self, positions: Tensor) -> Tensor:
        """P at each of ``positions`` (any shape of ints): float32 (..., dim), on their device.
        Each row from its own position, so rows of different lengths (a decoding step) need no
        table up to the longest."""
        device = positions.device
        # float64 keeps i * w_j exact enough at long positions; MPS has no float64.
        wide = torch.float32 if device.type == "mps" else torch.float64
        freq = self.base ** (-torch.arange(0, self.dim, 2, device=device, dtype=wide) / self.dim)
        angle = positions.to(wide)[..., None] * freq  # (..., ceil(dim / 2))
        pairs = torch.stack((angle.sin(), angle.cos()), dim=-1)  # (..., ceil(dim / 2), 2)
        return pairs.flatten(-2)[..., : self.dim].to(torch.float32)

    def embed(self, x: Tensor, offset: int = 0) -> Tensor:
        if x.dim() != 3 or x.shape[-1] != self.dim:
            raise ValueError(
                f"embed expects x of shape (batch, length, dim={self.dim}), got {tuple(x.shape)}"
            )
        p = self.table(x.shape[1], offset, device=x.device)
        return self.dropout(x + p.to(x.dtype))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, base={self.base}, dropout={self.dropout.p}"
