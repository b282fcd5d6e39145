"""Rotary position embedding, RoPE (Su et al. 2021, "RoFormer: Enhanced Transformer with Rotary
Position Embedding"), in the half-split layout of GPT-NeoX and Llama."""

from __future__ import annotations

import torch
from torch import Tensor

from .base import PositionalEncoding, check_number, check_positions


class RotaryEncoding(PositionalEncoding):
    """Rotates q and k per head by angles proportional to their absolute positions.

    Layout (half-split, as GPT-NeoX and Hugging Face Llama; not RoFormer's interleaved pairs):
    of the ``D`` = head_dim features, the first ``r = round(rotary_fraction * D)`` are rotated and
    the rest pass through unchanged. Inside the rotated part, feature ``j`` pairs with feature
    ``j + r/2`` for ``j < r/2``, and the pair at position ``m`` turns by ``m * w_j`` with
    ``w_j = base ** (-2j / r)``::

        x'[j]       = x[j] * cos(m w_j) - x[j + r/2] * sin(m w_j)
        x'[j + r/2] = x[j] * sin(m w_j) + x[j + r/2] * cos(m w_j)

    Since rotations compose, ``<R(m) q, R(n) k> = <q, R(n - m) k>``: the score depends on the
    positions only through ``n - m``. Angles and the rotation are computed in float32 and the
    result is cast back to the input dtype. ``round`` is Python's (ties to even).

    Args:
        base: the wavelength scale (10000 in the paper); a number greater than 1.
        rotary_fraction: the share of each head's features to rotate, in (0, 1]; ``r`` must come
            out even and positive.
    """

    name = "rope"
    kind = "rotate"

    def __init__(
        self,
        *,
        dim: int,
        num_heads: int,
        causal: bool = False,
        base: float = 10000.0,
        rotary_fraction: float = 1.0,
    ) -> None:
        super().__init__(dim=dim, num_heads=num_heads, causal=causal)
        self.base = check_number("base", base, lambda v: v > 1, "a number greater than 1")
        self.rotary_fraction = check_number(
            "rotary_fraction", rotary_fraction, lambda v: 0 < v <= 1, "a number in (0, 1]"
        )
        self.rotary_dims(self.head_dim)

    def rotary_dims(self, head_dim: int) -> int:
        """``r = round(rotary_fraction * head_dim)``, the number of rotated features per head."""
        r = round(self.rotary_fraction * head_dim)
        if r == 0 or r % 2:
            raise ValueError(
                f"rope cannot split head_dim={head_dim} with rotary_fraction="
                f"{self.rotary_fraction}: round({self.rotary_fraction} * {head_dim}) = {r} "
                f"features to rotate, but rotation needs an even positive number of them; choose "
                f"a head_dim or rotary_fraction that gives one"
            )
        return r

    def check(self, *, q_len: int, kv_len: int, head_dim: int) -> None:
        self.rotary_dims(head_dim)

    def rotate(self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> tuple[Tensor, Tensor]:
        """Rotate q (B, H, Lq, D) by q_pos and k (B, H, Lk, D) by k_pos.

        Positions are absolute int tensors of shape (Lq,) and (Lk,); per-batch positions must
        broadcast against q's leading dims, e.g. (B, 1, Lq). An offset query block (decoding) or
        keys from another sequence (cross-attention) are handled by passing their own positions.
        """
        check_positions("q_pos", q_pos, q.shape[-2], "q")
        check_positions("k_pos", k_pos, k.shape[-2], "k")
        return self._turn(q, q_pos), self._turn(k, k_pos)

    def _turn(self, x: Tensor, pos: Tensor) -> Tensor:
        r = self.rotary_dims(x.shape[-1])
        half = r // 2
        freq = self.base ** (-torch.arange(0, r, 2, device=x.device, dtype=torch.float32) / r)
        angle = pos.to(device=x.device, dtype=torch.float32)[..., None] * freq  # (..., L, r/2)
        cos, sin = angle.cos(), angle.sin()
        x1, x2 = x[..., :half].float(), x[..., half:r].float()
        turned = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).to(x.dtype)
        return torch.cat((turned, x[..., r:]), dim=-1)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, base={self.base}, rotary_fraction={self.rotary_fraction}"
