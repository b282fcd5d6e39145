"""One attention call, checked once, as every backend receives it."""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..patterns import Pattern
from .arguments import check_probability
from .scores import AdditiveScore, DotProduct, score_dtype
from .shape_cache import concrete

ScoreBias = Callable[[Tensor, Tensor, Tensor], Tensor]  # (head, q_pos, kv_pos) -> bias


@dataclass
class AttentionCall:
    """Everything a backend needs. Tensors are (batch, heads, length, head_dim), as in SDPA."""

    q: Tensor
    k: Tensor
    v: Tensor
    pattern: Pattern  # specialized for these lengths, causality included
    variant: str  # the name, for messages
    key_padding_mask: Tensor | None  # (batch, kv_len) bool, True where the key is padding
    score: DotProduct | AdditiveScore
    dropout_p: float = 0.0
    bias: ScoreBias | None = None  # a positional score bias, see zoo.positional
    return_weights: bool = False
    causal: bool = False  # whether the caller asked for causal (it is in the pattern already)
    learned: tuple[Tensor, ...] = ()  # parameters of the encoding behind ``bias`` (a T5 table)
    variant_params: dict = field(default_factory=dict)  # the variant's resolved parameters
    # A graph's node order (zoo.patterns.node_order.NodeOrder): q, k, v and the padding are in its
    # slots, and zoo.attention puts the output back in the caller's order. None: the caller's order.
    order: object = None

    @property
    def q_len(self) -> int:
        return self.q.shape[-2]

    @property
    def kv_len(self) -> int:
        return self.k.shape[-2]

    @property
    def groups(self) -> int:
        """Query heads per key/value head: 1 for multi-head, H_q for multi-query attention."""
        # concrete under torch.compile: kernels take a Python bool of it (SDPA's enable_gqa)
        return concrete(self.q.shape[1] // self.k.shape[1])

    @property
    def device(self) -> torch.device:
        return self.q.device

    @property
    def needs_grad(self) -> bool:
        tensors = [self.q, self.k, self.v, *self.learned]
        if isinstance(self.score, AdditiveScore):
            tensors += list(self.score.parameters())
        return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)

    @property
    def scale(self) -> float:
        return self.score.scale if isinstance(self.score, DotProduct) else 1.0


def _shape(t: Tensor) -> str:
    return "(" + ", ".join(str(s) for s in t.shape) + ")"


def check_qkv(q: object, k: object, v: object) -> None:
    """q (B, H, Lq, D), k (B, H_kv, Lk, D), v (B, H_kv, Lk, Dv): one dtype, device and batch;
    H_kv divides H (grouped-query attention; H_kv = 1 is multi-query, H_kv = H multi-head)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(
                f"{name} must have 4 dimensions (batch, heads, length, head_dim), "
                f"got shape {_shape(t)}"
            )
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype} and {v.dtype}")
    if not q.device == k.device == v.device:
        raise ValueError(
            f"q, k and v must be on one device, got {q.device}, {k.device} and {v.device}"
        )
    if not q.shape[0] == k.shape[0] == v.shape[0]:
        raise ValueError(
            f"q, k and v must agree in batch (dim 0), got shapes "
            f"{_shape(q)}, {_shape(k)} and {_shape(v)}"
        )
    if k.shape[1] != v.shape[1]:
        raise ValueError(
            f"k and v must have the same number of heads (dim 1), got {_shape(k)} and {_shape(v)}"
        )
    if q.shape[1] == 0 or k.shape[1] == 0:
        raise ValueError(
            f"q, k and v need at least one head (dim 1), got shapes {_shape(q)}, {_shape(k)} "
            f"and {_shape(v)}"
        )
    if q.shape[1] % k.shape[1]:
        raise ValueError(
            f"the heads of k and v must divide those of q (grouped-query attention shares each "
            f"key/value head among a group of query heads): q has {q.shape[1]} heads, k and v "
            f"have {k.shape[1]}"
        )
    if k.shape[2] != v.shape[2]:
        raise ValueError(
            f"k and v must have the same length (dim 2), got {_shape(k)} and {_shape(v)}"
        )
    if q.shape[3] != k.shape[3]:
        raise ValueError(
            f"q and k must have the same head_dim (dim 3), got {_shape(q)} and {_shape(k)}"
        )
    if q.shape[2] == 0 or k.shape[2] == 0:
        raise ValueError(f"q and k need at least one position, got {_shape(q)} and {_shape(k)}")
    if q.shape[3] == 0 or v.shape[3] == 0:
        raise ValueError(
            f"q, k and v need a head_dim (dim 3) of at least 1, got {_shape(q)}, {_shape(k)} and "
            f"{_shape(v)}: an empty head has no scores to scale (the default scale is "
            "1/sqrt(head_dim)) and no values to average"
        )


def check_key_padding_mask(
    mask: object, batch: int, kv_len: int, device: torch.device
) -> Tensor | None:
    """A (batch, kv_len) bool tensor, True where a key is padding (as nn.MultiheadAttention)."""
    if mask is None:
        return None
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
        what = f"dtype {mask.dtype}" if isinstance(mask, Tensor) else type(mask).__name__
        raise TypeError(f"key_padding_mask must be a bool tensor (True = padding), got {what}")
    if tuple(mask.shape) != (batch, kv_len):
        raise ValueError(
            f"key_padding_mask must have shape (batch, kv_len) = ({batch}, {kv_len}), "
            f"got {_shape(mask)}"
        )
    return mask.to(device)


def call_score(score: object, scale: object, q: Tensor) -> DotProduct | AdditiveScore:
    """A call's score: the scaled dot product without ``score`` (``resolve_scale``), else its
    ``AdditiveScore``, made for q's heads and head size (B, H, L, D), which weighs q and k
    itself: a ``scale`` beside it is refused, not ignored."""
    if score is None:
        return DotProduct(resolve_scale(scale, q.shape[-1], score_dtype(q)))
    if not isinstance(score, AdditiveScore):
        raise TypeError(
            f"score must be a zoo.core.scores.AdditiveScore (or None: the scaled dot product), "
            f"got {score!r} ({type(score).__name__}); a module takes score='additive'"
        )
    if scale is not None:
        raise ValueError(
            f"scale={scale!r} scales dot-product scores; an AdditiveScore weighs q and k with its "
            f"own parameters: leave scale=None"
        )
    heads, head_dim = score.w_q.shape[:2]
    if (heads, head_dim) != (q.shape[1], q.shape[-1]):
        raise ValueError(
            f"score is an AdditiveScore for {heads} heads of size {head_dim}, but q has "
            f"{q.shape[1]} heads of size {q.shape[-1]}"
        )
    return score


def resolve_scale(scale: object, head_dim: int, scores: torch.dtype | None = None) -> float:
    """The score scale: ``scale`` if given, a finite positive number, else 1/sqrt(head_dim).
    With the ``scores``' dtype (``score_dtype(q)``): finite there too, as 1e39 is not in
    float32."""
    if scale is None:
        return 1 / math.sqrt(concrete(head_dim))
    number = not isinstance(scale, bool) and isinstance(scale, int | float)
    try:
        value = float(scale) if number else math.nan
    except OverflowError:  # an int beyond the floats
        value = math.inf
    # Comparisons, not math.isfinite: under torch.compile a float argument may be symbolic
    # (dynamic=True, or a second value), which they guard on and isfinite breaks the graph at.
    largest = sys.float_info.max if scores is None else torch.finfo(scores).max
    if not (number and 0 < value <= largest):
        hint = (
            ": a finite positive number is expected (an infinite or NaN scale makes every "
            "weight NaN)" + ("" if scores is None else f", finite in the scores' {scores}")
            if number and not -largest <= value <= largest
            else ""
        )
        raise ValueError(
            f"scale must be a positive number or None (1/sqrt(head_dim)), got {scale!r}{hint}"
        )
    return value


def check_dropout(dropout_p: object) -> float:
    return check_probability("dropout_p", dropout_p)


def unread_padded_inputs(x: Tensor, padding: Tensor) -> Tensor:
    """A module's input x (B, L, width) with zeros where ``padding`` (B, L) is True, before its
    projections: their weight gradients sum x over every position, and 0 * NaN at a padded one
    would make them NaN (padding may hold anything, as ``unread_padding`` says)."""
    return x.masked_fill(padding[:, :, None], 0)


def unread_padding(x: Tensor, key_padding_mask: Tensor) -> Tensor:
    """k or v (B, H, Lk, D) with zeros at padded keys, before any backend or routed choice reads
    them: padding may hold anything (NaN, inf, uninitialised memory), and kernels that add -inf
    to a masked score (inf - inf) or weigh a masked value by 0 (0 * NaN) would spread it. The
    padded keys get zero gradients."""
    return x.masked_fill(key_padding_mask[:, None, :, None], 0)
