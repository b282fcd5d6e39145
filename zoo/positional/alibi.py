"""ALiBi, attention with linear biases (Press et al. 2022, "Train Short, Test Long: Attention with
Linear Biases Enables Input Length Extrapolation")."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..core.arguments import check_int
from .base import PositionalEncoding


def alibi_slopes(num_heads: int) -> list[float]:
    """The paper's head slopes (its reference code, ``get_slopes``).

    For ``n`` a power of two: the geometric sequence that starts at ``2 ** (-8 / n)`` with that
    ratio, ``slope_h = 2 ** (-8 (h + 1) / n)``; for 8 heads 1/2, 1/4, ..., 1/256. For other ``n``:
    the slopes for ``p = 2 ** floor(log2 n)`` heads, then every other slope of the sequence for
    ``2p`` heads (its 1st, 3rd, 5th, ...) until there are ``n``. For 12 heads: 1/2 .. 1/256, then
    2 ** -0.5, 2 ** -1.5, 2 ** -2.5, 2 ** -3.5.
    """
    check_int("num_heads", num_heads)
    p = 2 ** math.floor(math.log2(num_heads))
    slopes = [2 ** (-8 * (h + 1) / p) for h in range(p)]
    if p < num_heads:
        slopes += alibi_slopes(2 * p)[0::2][: num_heads - p]
    return slopes


class AlibiEncoding(PositionalEncoding):
    """Adds ``-slope_h * |q_pos - k_pos|`` to the score of head ``h``; nothing is learned.

    The symmetric ``|i - j|`` form is the one for bidirectional attention. Under a causal mask only
    pairs with ``j <= i`` are kept, where it equals the paper's causal form ``-slope_h * (i - j)``,
    so one formula serves both and ``causal`` changes nothing here. The slopes (see
    ``alibi_slopes``) are a buffer, ``slopes``, of shape (num_heads,): float32, in a bfloat16 or
    float16 model too (float64 in a float64 one); backends whose kernels take ALiBi natively
    (flash-attention's ``alibi_slopes``) can pass it on. No parameters.
    """

    name = "alibi"
    kind = "bias"

    def __init__(self, *, dim: int, num_heads: int, causal: bool = False) -> None:
        super().__init__(dim=dim, num_heads=num_heads, causal=causal)
        self.slopes: Tensor
        self.register_buffer("slopes", torch.tensor(alibi_slopes(num_heads)), persistent=False)

    def _apply(self, fn, recurse: bool = True):
        """Moves as any module, then sets the slopes' values again, in float32: a function of the
        heads alone, and not in the state dict (checkpoints without it load strictly), so a
        model built on the meta device and materialised with ``to_empty`` would otherwise hold
        uninitialised memory there. A cast to a narrower float (``model.to(torch.bfloat16)``)
        leaves them float32: in bfloat16 the biases of distances 256 and 257 would be equal;
        ``model.double()`` makes them float64."""
        out = super()._apply(fn, recurse)
        slopes = self.slopes
        if slopes.device.type != "meta":
            values = torch.tensor(alibi_slopes(self.num_heads), device=slopes.device)
            if slopes.dtype not in (torch.float32, torch.float64):
                self.slopes = values
                return out
            # an inference tensor (built under inference_mode) is written in that mode
            with torch.no_grad(), torch.inference_mode(torch.is_inference(slopes)):
                slopes.copy_(values.to(slopes.dtype))
        return out

    def bias(self, h: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """``-slopes[h] * |q_pos - k_pos|`` in float32, in the broadcast shape of the arguments."""
        slopes = self.slopes
        if slopes.device.type == "meta" and q_pos.device.type != "meta":
            # left on meta by load_state_dict(assign=True), which does not hold them
            slopes = torch.tensor(alibi_slopes(self.num_heads), device=q_pos.device)
        return -slopes[h] * (q_pos - k_pos).abs().to(slopes.dtype)
