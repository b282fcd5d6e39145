"""A named attention module from the registry's ``modules:`` section: a mechanism with its own
parameters (NSA's gates and compression), not a pattern of pairs.

::

    modules:
      nsa:
        module: zoo.modules.nsa:NativeSparseAttention  # package.module:Class, (B, L, dim)
        params: {block_length: 32, window: 512}  # defaults; callers may override any keyword
        description: One line.
        paper: Authors, title, year, link.
        complexity: O(n·(n/s+k·l'+w)·d)

The class takes ``dim`` and ``num_heads`` and keyword options; ``zoo.create_attention(name,
dim=..., num_heads=..., **overrides)`` builds it as it builds a variant's MultiHeadAttention.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch
from torch import nn

from ..core.arguments import check_parameters, import_object

SHARED = ("dim", "num_heads")  # what create_attention supplies to every module


@dataclass(frozen=True)
class ModuleSpec:
    name: str
    module: str  # package.module:Class
    params: dict = field(default_factory=dict)
    description: str = ""
    paper: str = ""
    complexity: str = ""
    source: str = ""

    def module_class(self) -> type[nn.Module]:
        cls = import_object(self.module, "module")
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise ValueError(f"module {self.module!r} is not a torch.nn.Module class")
        return cls

    def parameters(self) -> dict[str, object]:
        """The keyword options a caller may set, with their defaults (the entry's first)."""
        signature = inspect.signature(self.module_class().__init__).parameters.values()
        own = {p.name: p.default for p in signature if p.kind == p.KEYWORD_ONLY}
        return {**own, **self.params}

    def build(self, *, dim: int, num_heads: int, **overrides: object) -> nn.Module:
        check_parameters(f"module {self.name!r}", overrides, self.parameters())
        return self.module_class()(dim, num_heads, **{**self.params, **overrides})

    def __hash__(self) -> int:
        return hash((self.name, self.source))

    def validate(self) -> None:
        """Build it once at a small size (from a forked generator), so that a bad parameter
        fails when the file loads and loading never moves the global random state."""
        check_parameters(f"module {self.name!r}", self.params, self.parameters())
        with torch.random.fork_rng(devices=[]):
            self.build(dim=64, num_heads=4)
