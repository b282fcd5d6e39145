"""The PositionalEncoding protocol: how position enters attention, through one of three hooks.

Every encoding has a ``kind`` that names its hook:

- ``"none"``: no position information; ``embed(x)`` returns ``x``.
- ``"embed"``: an absolute table P added to the model input, ``embed(x) = dropout(x + P)``.
- ``"rotate"``: q and k turned by their positions, ``rotate(q, k, q_pos, k_pos)``.
- ``"bias"``: a term added to the scaled dot-product score, ``bias(h, q_pos, k_pos)``.

A backend calls only the hook of the encoding's kind; the others raise NotImplementedError with a
sentence that says which hook to use. Positions are absolute int64 positions, so a query block that
starts at an offset (decoding with a cache, cross-attention) gets the right relative distances.

Every encoding takes the same three keyword arguments, ``dim`` (model width), ``num_heads`` and
``causal``, plus its own parameters; ``head_dim = dim // num_heads``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import ClassVar

from torch import Tensor, nn

from ..core.arguments import check_int

_HOOK = {
    "none": "it adds no position information (kind 'none'), so there is nothing to call",
    "embed": "it adds a table to the model input (kind 'embed'); call embed(x)",
    "rotate": "it rotates q and k (kind 'rotate'); call rotate(q, k, q_pos, k_pos)",
    "bias": "it adds a bias to the attention scores (kind 'bias'); call bias(h, q_pos, k_pos)",
}


def check_number(name: str, value: object, ok: Callable[[float], bool], expected: str) -> float:
    """Return ``value`` as a float if it is a finite real number (not a bool) satisfying ``ok``."""
    real = isinstance(value, int | float) and not isinstance(value, bool)
    if not real or not math.isfinite(value) or not ok(value):
        raise ValueError(f"{name} must be {expected}, got {value!r}")
    return float(value)


class PositionalEncoding(nn.Module):
    """Base class: validates the shared arguments and raises a clear error for absent hooks.

    Args:
        dim: the model width (the size of the vectors that ``embed`` sees); a positive multiple of
            ``num_heads``.
        num_heads: the number of attention heads; ``head_dim = dim // num_heads``.
        causal: whether the attention is causal (t5 uses it to pick its bucketing).
    """

    name: ClassVar[str]
    kind: ClassVar[str]

    def __init__(self, *, dim: int, num_heads: int, causal: bool = False) -> None:
        super().__init__()
        self.dim = check_int("dim", dim)
        self.num_heads = check_int("num_heads", num_heads)
        if dim % num_heads:
            raise ValueError(
                f"dim={dim} is not a multiple of num_heads={num_heads}; choose a dim that "
                f"num_heads divides"
            )
        if not isinstance(causal, bool):
            raise ValueError(f"causal must be True or False, got {causal!r}")
        self.causal = causal
        self.head_dim = dim // num_heads

    def _absent(self, method: str) -> NotImplementedError:
        return NotImplementedError(
            f"the {self.name!r} encoding has no {method}(); {_HOOK[self.kind]}"
        )

    def embed(self, x: Tensor, offset: int = 0) -> Tensor:
        """``x`` (B, L, dim) -> ``dropout(x + P[offset : offset + L])``; for kind 'embed'."""
        raise self._absent("embed")

    def rotate(self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> tuple[Tensor, Tensor]:
        """q (B, H, Lq, D), k (B, H, Lk, D), q_pos (Lq,), k_pos (Lk,) -> rotated (q, k)."""
        raise self._absent("rotate")

    def bias(self, h: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """Broadcasting int tensors (head, query position, key position) -> the float score bias.

        Elementwise and free of data-dependent control flow, so it can serve as a FlexAttention
        ``score_mod``: ``score + enc.bias(h, q_idx, kv_idx)``.
        """
        raise self._absent("bias")

    def check(self, *, q_len: int, kv_len: int, head_dim: int) -> None:
        """Raise ValueError if this encoding cannot serve these sizes; the default accepts all."""

    def extra_repr(self) -> str:
        return f"dim={self.dim}, num_heads={self.num_heads}, causal={self.causal}"


def check_positions(name: str, pos: Tensor, length: int, tensor: str) -> None:
    """Raise ValueError unless ``pos`` has one position per row of ``tensor`` (its dim -2)."""
    if pos.dim() == 0 or pos.shape[-1] != length:
        raise ValueError(
            f"{name} must hold one position per row of {tensor} ({length}), got shape "
            f"{tuple(pos.shape)}; pass torch.arange(offset, offset + {length})"
        )
