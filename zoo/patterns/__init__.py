"""Which (query, key) pairs may attend: pattern families and their composition.

Importing this package registers the built-in families; ``register_pattern`` adds a user's own.
"""

from .base import EMPTY, FULL, PARTIAL, Pattern, Spans, query_positions
from .block_local import BlockLocal
from .compose import Difference, Intersection, Union
from .full import Causal, Full
from .global_tokens import Global
from .local import Local
from .moba import Moba
from .random_blocks import Random, RandomBlocks
from .registry import build_family, list_families, register_pattern, resolve_family
from .routed import ChosenBlocks, RouteInputs
from .strided import Residue, dilated, strided

__all__ = [
    "EMPTY",
    "FULL",
    "PARTIAL",
    "BlockLocal",
    "Causal",
    "ChosenBlocks",
    "Difference",
    "Full",
    "Global",
    "Intersection",
    "Local",
    "Moba",
    "Pattern",
    "Random",
    "RandomBlocks",
    "Residue",
    "RouteInputs",
    "Spans",
    "Union",
    "build_family",
    "dilated",
    "list_families",
    "query_positions",
    "register_pattern",
    "resolve_family",
    "strided",
]
