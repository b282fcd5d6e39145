"""Learned absolute positions: a trainable table, one vector per position (as in BERT and GPT-2)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..core.arguments import check_int, check_probability
from .base import PositionalEncoding


class LearnedEncoding(PositionalEncoding):
    """Adds a trainable table to the input: ``embed(x) = dropout(x + W[offset : offset + L])``.

    ``W`` is an ``nn.Parameter`` of shape (max_len, dim), initialised from N(0, 0.02^2) as in GPT-2.
    Positions at or beyond ``max_len`` have no row: asking for them raises ValueError (see
    ``check``) rather than failing inside indexing.

    Args:
        max_len: the number of positions the table holds, a positive int.
        dropout: the dropout probability applied after the addition, in [0, 1).
    """

    name = "learned"
    kind = "embed"

    def __init__(
        self,
        *,
        dim: int,
        num_heads: int,
        causal: bool = False,
        max_len: int = 2048,
        dropout: float = 0.0,
    ) -> None:
        super().__init__(dim=dim, num_heads=num_heads, causal=causal)
        self.max_len = check_int("max_len", max_len)
        self.dropout = nn.Dropout(check_probability("dropout", dropout))
        self.weight = nn.Parameter(torch.empty(max_len, dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """W from N(0, 0.02^2): as built, and after a model made on the meta device is
        materialised (``to_empty``, then each module's reset)."""
        nn.init.normal_(self.weight, std=0.02)

    def _check_span(self, length: int, offset: int) -> None:
        check_int("length", length, minimum=0)
        check_int("offset", offset, minimum=0)
        if offset + length > self.max_len:
            raise ValueError(
                f"the 'learned' encoding holds max_len={self.max_len} positions but was asked for "
                f"positions up to {offset + length} (offset {offset} + length {length}); raise "
                f"max_len or use shorter inputs"
            )

    def table(self, length: int, offset: int = 0) -> Tensor:
        """Rows ``offset .. offset + length - 1`` of the table: (length, dim), with gradient."""
        self._check_span(length, offset)
        return self.weight[offset : offset + length]

    def table_at(self, positions: Tensor) -> Tensor:
        """The rows at ``positions`` (any shape of ints below max_len): (..., dim), with
        gradient; a position past the table is the caller's to refuse."""
        return self.weight[positions]

    def embed(self, x: Tensor, offset: int = 0) -> Tensor:
        if x.dim() != 3 or x.shape[-1] != self.dim:
            raise ValueError(
                f"embed expects x of shape (batch, length, dim={self.dim}), got {tuple(x.shape)}"
            )
        return self.dropout(x + self.table(x.shape[1], offset).to(x.dtype))

    def check(self, *, q_len: int, kv_len: int, head_dim: int) -> None:
        self._check_span(max(q_len, kv_len), 0)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, max_len={self.max_len}, dropout={self.dropout.p}"
