"""A named mechanism from the registry's ``mechanisms:`` section.

::

    mechanisms:
      performer:
        mechanism: performer           # a registered class name, or package.module:Class
        params: {num_features: null, seed: 0, redraw_interval: null, chunk_size: 64}
        description: One line.
        paper: Authors, title, year, link.
        complexity: O(n·m·d)
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch

from ..core.arguments import check_parameters
from ..mechanisms import resolve_mechanism
from ..mechanisms.base import Mechanism

SHARED = ("num_heads", "head_dim")  # what the attention module supplies to every mechanism


@dataclass(frozen=True)
class MechanismSpec:
    name: str
    mechanism: str  # a class name in MECHANISMS, or package.module:Class
    params: dict = field(default_factory=dict)
    description: str = ""
    paper: str = ""
    complexity: str = ""
    source: str = ""

    def mechanism_class(self) -> type[Mechanism]:
        return resolve_mechanism(self.mechanism)

    def class_parameters(self) -> dict[str, object]:
        """The keyword parameters of the class, with its defaults."""
        signature = inspect.signature(self.mechanism_class().__init__).parameters.values()
        return {
            p.name: p.default
            for p in signature
            if p.kind == p.KEYWORD_ONLY and p.name not in SHARED
        }

    def parameters(self) -> dict[str, object]:
        """The parameters a caller may set, with the entry's defaults."""
        return {**self.class_parameters(), **self.params}

    def build(
        self,
        *,
        num_heads: int,
        head_dim: int,
        options: tuple[str, ...] = (),
        options_of: str = "",
        **overrides: object,
    ) -> Mechanism:
        """The mechanism with the entry's defaults and the caller's overrides."""
        check_parameters(
            f"mechanism {self.name!r}",
            overrides,
            self.parameters(),
            options=options,
            options_of=options_of,
        )
        cls = self.mechanism_class()
        mechanism = cls(num_heads=num_heads, head_dim=head_dim, **{**self.params, **overrides})
        mechanism.name = self.name
        return mechanism

    def validate(self) -> None:
        """Build it once at a typical size, without moving torch's global random state, so that
        a bad parameter fails when the file loads."""
        check_parameters(
            f"mechanism class {self.mechanism!r}", self.params, self.class_parameters()
        )
        with torch.random.fork_rng(devices=[]):
            self.build(num_heads=4, head_dim=16)
