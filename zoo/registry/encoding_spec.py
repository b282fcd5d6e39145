"""A named positional encoding from the registry's ``positional:`` section.

::

    positional:
      rope_long:
        encoding: rope                 # a registered class name, or package.module:Class
        params: {base: 500000}         # defaults; callers may override any of the class's params
        description: Rotary positions with a long wavelength.
        paper: Su et al., RoFormer, 2021.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch

from ..core.arguments import check_parameters
from ..positional import resolve_encoding
from ..positional.base import PositionalEncoding

SHARED = ("dim", "num_heads", "causal")  # what the attention module supplies to every encoding


@dataclass(frozen=True)
class EncodingSpec:
    name: str
    encoding: str  # a class name in ENCODINGS, or package.module:Class
    params: dict = field(default_factory=dict)
    description: str = ""
    paper: str = ""
    source: str = ""

    def encoding_class(self) -> type[PositionalEncoding]:
        return resolve_encoding(self.encoding)

    @property
    def kind(self) -> str:
        return self.encoding_class().kind

    def class_parameters(self) -> dict[str, object]:
        """The keyword parameters of the class, with its defaults."""
        signature = inspect.signature(self.encoding_class().__init__).parameters.values()
        return {
            p.name: p.default
            for p in signature
            if p.kind == p.KEYWORD_ONLY and p.name not in SHARED
        }

    def parameters(self) -> dict[str, object]:
        """The parameters a caller may set, with their defaults."""
        return {**self.class_parameters(), **self.params}

    def build(
        self, *, dim: int, num_heads: int, causal: bool = False, **overrides: object
    ) -> PositionalEncoding:
        check_parameters(f"encoding {self.name!r}", overrides, self.parameters())
        cls = self.encoding_class()
        return cls(dim=dim, num_heads=num_heads, causal=causal, **{**self.params, **overrides})

    def probe(
        self, *, dim: int = 64, num_heads: int = 4, causal: bool = False, **overrides: object
    ) -> PositionalEncoding:
        """An instance the zoo builds for itself, not for a user's model: to check parameters or
        to serve a functional call. Its weights come from a forked generator, so a probe never
        moves torch's global random state (only a user's own module creation may draw from it)."""
        with torch.random.fork_rng(devices=[]):
            return self.build(dim=dim, num_heads=num_heads, causal=causal, **overrides)

    def validate(self) -> None:
        """Build it once at a typical size, so that a bad parameter fails when the file loads."""
        # the entry's own params are the defaults that parameters() checks callers against, so
        # they are checked against the class (else the class's own TypeError, with no list)
        check_parameters(f"encoding class {self.encoding!r}", self.params, self.class_parameters())
        self.probe()
