"""T5 relative position biases: a learned scalar per head and per bucket of relative position
(Raffel et al. 2020, "Exploring the Limits of Transfer Learning with a Unified Text-to-Text
Transformer"; bucketing as in its ``_relative_position_bucket``)."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ..core.arguments import check_int
from .base import PositionalEncoding


def relative_position_bucket(
    relative_position: Tensor,
    bidirectional: bool = True,
    num_buckets: int = 32,
    max_distance: int = 128,
) -> Tensor:
    """Map ``relative_position = k_pos - q_pos`` (int tensor) to a bucket in [0, num_buckets).

    T5's rule, step by step. Bidirectional: half the buckets for each direction; keys after the
    query (``relative_position > 0``) use the upper half, offset by ``num_buckets // 2``; the
    distance is ``|relative_position|``. Unidirectional (causal): the distance is
    ``max(-relative_position, 0)``, so every future key (``k_pos > q_pos``) lands in bucket 0 with
    distance 0: they have no bucket of their own, and a causal mask hides them anyway. Then, with
    ``n`` buckets per direction and ``max_exact = n // 2``: a distance below ``max_exact`` is its
    own bucket; a larger one goes to ``max_exact + floor(log(d / max_exact) / log(max_distance /
    max_exact) * (n - max_exact))`` (computed in float32, as T5), capped at ``n - 1``.

    With the defaults (32 buckets, max_distance 128); bidirectional, 16 buckets per direction and
    max_exact 8. A key after the query is at distance 1 or more, so bucket 16 is never used (as
    in T5)::

        distance        0..7   8..11  12..15  16..22  23..31  32..45  46..63  64..90  >= 91
        key at/before   0..7   8      9       10      11      12      13      14      15
        key after       17..23 24     25      26      27      28      29      30      31

    causal, max_exact 16; every key after the query: bucket 0::

        distance  0..15  16..18  19..20  21..23  24..26  27..30  31..34  35..39  40..45  46..51
        bucket    0..15  16      17      18      19      20      21      22      23      24
        distance  52..58  59..66  67..76  77..86  87..98  99..112  >= 113
        bucket    25      26      27      28      29      30       31

    Elementwise torch ops only (no ``.item()``, no branching on values), so it runs inside a
    FlexAttention ``score_mod``. Needs ``max_exact >= 1`` and ``max_distance > max_exact``.
    """
    n = num_buckets // 2 if bidirectional else num_buckets
    max_exact = n // 2
    if max_exact < 1:
        mode, least = ("bidirectional", 4) if bidirectional else ("causal", 2)
        raise ValueError(
            f"num_buckets={num_buckets} is too few for {mode} bucketing; use at least {least}"
        )
    if max_distance <= max_exact:
        raise ValueError(
            f"max_distance={max_distance} must exceed the {max_exact} exact buckets per direction "
            f"that num_buckets={num_buckets} gives; raise max_distance"
        )
    rel = relative_position.to(torch.int64)
    if bidirectional:
        offset = (rel > 0).to(torch.int64) * n
        distance = rel.abs()
    else:
        offset = torch.zeros_like(rel)
        distance = (-rel).clamp(min=0)
    # The clamp keeps log() finite; distances below max_exact take the exact branch anyway.
    ratio = distance.clamp(min=max_exact).to(torch.float32) / max_exact
    scaled = torch.log(ratio) / math.log(max_distance / max_exact) * (n - max_exact)
    large = (max_exact + scaled.to(torch.int64)).clamp(max=n - 1)
    return offset + torch.where(distance < max_exact, distance, large)


class T5RelativeBias(PositionalEncoding):
    """Adds a learned ``weight[h, bucket(k_pos - q_pos)]`` to the score of head ``h``.

    ``weight`` is an ``nn.Parameter`` of shape (num_heads, num_buckets), initialised from
    N(0, 0.02^2) so that it is not all zero; gradients reach it through ``bias``. Bucketing is
    bidirectional when ``causal=False`` and unidirectional when ``causal=True`` (future keys all
    share bucket 0), see ``relative_position_bucket``.

    Args:
        num_buckets: buckets per head (32 in T5); at least 4 bidirectional, 2 causal.
        max_distance: distances from here on share the last bucket of their direction (128 in T5).
    """

    name = "t5"
    kind = "bias"

    def __init__(
        self,
        *,
        dim: int,
        num_heads: int,
        causal: bool = False,
        num_buckets: int = 32,
        max_distance: int = 128,
    ) -> None:
        super().__init__(dim=dim, num_heads=num_heads, causal=causal)
        self.num_buckets = check_int("num_buckets", num_buckets, minimum=2 if causal else 4)
        self.max_distance = check_int("max_distance", max_distance)
        # Fail now, not at the first forward, if max_distance does not fit the buckets.
        relative_position_bucket(torch.zeros(()), not causal, num_buckets, max_distance)
        self.weight = nn.Parameter(torch.empty(num_heads, num_buckets))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The biases from N(0, 0.02^2): as built, and after a model made on the meta device is
        materialised (``to_empty``, then each module's reset)."""
        nn.init.normal_(self.weight, std=0.02)

    def bucket(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """The bucket of each (query, key) pair, in the broadcast shape of the positions."""
        return relative_position_bucket(
            k_pos - q_pos, not self.causal, self.num_buckets, self.max_distance
        )

    def bias(self, h: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """``weight[h, bucket(k_pos - q_pos)]``, in the broadcast shape of the arguments."""
        return self.weight[h, self.bucket(q_pos, k_pos)]

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, num_buckets={self.num_buckets}, "
            f"max_distance={self.max_distance}"
        )
