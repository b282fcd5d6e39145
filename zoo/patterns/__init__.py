"""Which (query, key) pairs may attend: pattern families and their composition.

Importing this package registers the built-in families; ``register_pattern`` adds a user's own.
"""

from .axial import Axial2D, axial_2d
from .base import EMPTY, FULL, PARTIAL, Pattern, Spans, query_positions
from .block_local import BlockLocal
from .block_local_2d import BlockLocal2D, block_local_2d
from .compose import Difference, Intersection, Union
from .families import build_family, list_families, register_pattern, resolve_family
from .full import Causal, Full, made_causal
from .global_blocks import GlobalBlocks
from .global_tokens import Global
from .graph import Graph, GraphLayout, graph, reads_graph
from .grid import Tiles
from .local import Local
from .moba import Moba
from .neighborhood import Neighborhood2D, neighborhood_2d
from .random_blocks import Random, RandomBlocks
from .routed import ChosenBlocks, RouteInputs
from .strided import Residue, dilated, strided

__all__ = [
    "EMPTY",
    "FULL",
    "PARTIAL",
    "Axial2D",
    "BlockLocal",
    "BlockLocal2D",
    "Causal",
    "ChosenBlocks",
    "Difference",
    "Full",
    "Global",
    "GlobalBlocks",
    "Graph",
    "GraphLayout",
    "Intersection",
    "Local",
    "Moba",
    "Neighborhood2D",
    "Pattern",
    "Random",
    "RandomBlocks",
    "Residue",
    "RouteInputs",
    "Spans",
    "Tiles",
    "Union",
    "axial_2d",
    "block_local_2d",
    "build_family",
    "dilated",
    "graph",
    "list_families",
    "made_causal",
    "neighborhood_2d",
    "query_positions",
    "reads_graph",
    "register_pattern",
    "resolve_family",
    "strided",
]
