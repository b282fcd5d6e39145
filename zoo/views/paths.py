"""How far information travels through stacked layers of one pattern (self-attention, n x n mask).

A layer moves information from key position j to query position i when the mask allows (i, j).
With residual connections a token keeps what it had, so self-edges are free. Position i *reaches*
j within L layers when there is a chain i = t0, t1, ..., tm = j with m <= L and every step
(t_k, t_k+1) allowed. As matrices: reach within L layers is the boolean power (mask | I)^L, row i
holding the keys that query i has heard from.

The *maximum path length* is the largest, over the pairs (i, j) that must be connected, of the
shortest chain from i to j. A pattern whose mask is causal (no key after its query) must connect
every j <= i; any other pattern must connect every pair. A pair at distance 0 (i == j) needs no
layer, so a one-token sequence has path length 0. Where a required pair is never reached the
answer is None ("never"). Example, local with window 1 on 4 tokens (x: allowed)::

    mask      reach, 2 layers   reach, 3 layers
    x x . .   x x x .           x x x x      query 0 hears key 3 only at layer 3:
    x x x .   x x x x           x x x x      0 <- 1 <- 2 <- 3, so the path length is 3
    . x x x   x x x x           x x x x      = ceil((n - 1) / w)
    . . x x   . x x x           x x x x

The ``global`` pattern gives 2 (i <- 0 <- j through the global token) and ``block_local`` with
more than one block and no neighbours gives None: its blocks never talk to each other.

Cost: a few boolean matrix products done as float32 matmuls (exact: entries stay below 2^24),
O(log n) of them: repeated squaring gives reach within 1, 2, 4, ... layers, and binary lifting
over those powers finds the exact depth. Memory is one float n x n product at a time plus log2(n)
bool matrices (about 11 MB at n = 1024).
"""

from __future__ import annotations

import torch
from torch import Tensor


def _check_square(mask: Tensor) -> int:
    if not isinstance(mask, Tensor) or mask.dim() != 2 or mask.shape[0] != mask.shape[1]:
        shape = tuple(mask.shape) if isinstance(mask, Tensor) else type(mask).__name__
        raise ValueError(
            f"mask must be a square [n, n] tensor (self-attention), got {shape}; "
            "build it with zoo.dense_mask(name, n)"
        )
    if mask.shape[0] < 1:
        raise ValueError("mask must have at least one position, got an empty [0, 0] tensor")
    return mask.shape[0]


def _with_self(mask: Tensor) -> Tensor:
    """The one-layer reach: the mask plus the free residual self-edges, as bool on the CPU."""
    n = mask.shape[0]
    return mask.detach().to("cpu", torch.bool) | torch.eye(n, dtype=torch.bool)


def _compose(a: Tensor, b: Tensor) -> Tensor:
    """Reach through a, then b: the boolean product, as a float matmul (BLAS is far faster)."""
    return (a.float() @ b.float()) > 0


def is_causal(mask: Tensor) -> bool:
    """True when no query may attend a key after it (the mask is lower-triangular)."""
    return not bool(torch.triu(mask.to(torch.bool), diagonal=1).any())


def required_pairs(mask: Tensor) -> Tensor:
    """The pairs that must be connected: j <= i for a causal mask, every pair otherwise."""
    n = _check_square(mask)
    ones = torch.ones(n, n, dtype=torch.bool)
    return ones.tril() if is_causal(mask) else ones


def max_path_length(mask: Tensor) -> int | None:
    """The fewest stacked layers after which every required pair (i, j) is connected.

    That is the maximum, over required pairs, of the shortest chain length from query i to key j
    (see the module docstring: all pairs, or j <= i for a causal mask; self-edges are free).
    Returns None where some required pair is unreachable at any depth. Examples: full -> 1,
    causal -> 1, local or sliding window with window w at length n -> ceil((n - 1) / w),
    global -> 2, block_local with several blocks and no neighbours -> None.
    """
    n = _check_square(mask)
    need = ~required_pairs(mask)  # True where a pair need not be reached

    def covers(reach: Tensor) -> bool:
        return bool((reach | need).all())

    if covers(torch.eye(n, dtype=torch.bool)):
        return 0
    # powers[k] = reach within 2^k layers; square until it covers, or stops growing (never).
    powers = [_with_self(mask)]
    while not covers(powers[-1]):
        nxt = _compose(powers[-1], powers[-1])
        if torch.equal(nxt, powers[-1]):
            return None
        powers.append(nxt)
    # Binary lifting: the longest depth that does NOT cover, built from the powers below the top;
    # the answer is one more. Reach grows with depth (self-edges), so the search is monotone.
    reach, depth = None, 0
    for k in range(len(powers) - 2, -1, -1):
        candidate = powers[k] if reach is None else _compose(reach, powers[k])
        if not covers(candidate):
            reach, depth = candidate, depth + (1 << k)
    return depth + 1


def reach_within(mask: Tensor, layers: int) -> Tensor:
    """The bool [n, n] matrix of keys each query reaches within ``layers`` layers (0: itself)."""
    n = _check_square(mask)
    if isinstance(layers, bool) or not isinstance(layers, int) or layers < 0:
        raise ValueError(f"layers must be an int >= 0, got {layers!r}; pass a number of layers")
    # A shortest chain never repeats a position, so n - 1 layers reach everything reachable.
    remaining = min(layers, n - 1)
    result = torch.eye(n, dtype=torch.bool)
    power = _with_self(mask)
    while remaining:  # binary exponentiation of (mask | I)
        if remaining & 1:
            result = _compose(result, power)
        remaining >>= 1
        if remaining:
            power = _compose(power, power)
    return result


def receptive_field(mask: Tensor, layers: int) -> Tensor:
    """Per query, the number of key positions it reaches within ``layers`` layers (int64 [n])."""
    return reach_within(mask, layers).sum(dim=1)


def min_receptive_fraction(mask: Tensor, layers: int) -> float:
    """The smallest share, over queries, of the keys a query must reach (all keys, or j <= i for
    a causal mask) that it does reach within ``layers`` layers; 1.0 means everyone hears all."""
    need = required_pairs(mask)
    reached = (reach_within(mask, layers) & need).sum(dim=1)
    return float((reached / need.sum(dim=1)).min())
