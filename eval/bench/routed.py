"""Benchmark figures of variants whose pairs are chosen by content (``moba``): the allowed pairs
and the cost of the choice, on a point's own inputs (neither exists before the inputs do)."""

from __future__ import annotations

import torch
from torch import Tensor

from zoo.functional import resolve_pattern
from zoo.mechanisms.dispatch import is_mechanism
from zoo.patterns import RouteInputs

from .measure import median, time_runs


def is_routed(variant: str, params: dict) -> bool:
    """Whether a variant's pairs are chosen by content (a mechanism has no pairs to choose)."""
    return not is_mechanism(variant) and resolve_pattern(variant, False, dict(params)).routed


def chosen_pairs(variant: str, params: dict, causal: bool, q: Tensor, k: Tensor) -> int:
    """Allowed (query, key) pairs per sequence and head, averaged over them, for these q, k."""
    pattern = resolve_pattern(variant, causal, dict(params)).bind(RouteInputs(q, k, None, causal))
    n, kv_len = q.shape[2], k.shape[2]
    dense = pattern.dense(n, kv_len)  # (B, H, n, kv_len)
    return round(int(dense.sum()) / (dense.shape[0] * dense.shape[1]))


def selection_ms(variant: str, params: dict, causal: bool, q: Tensor, k: Tensor) -> float:
    """Median time of the choice alone (``bind``: block means, scores, top-k), per call."""
    pattern = resolve_pattern(variant, causal, dict(params))
    inputs = RouteInputs(q.detach(), k.detach(), None, causal)
    with torch.no_grad():
        times = time_runs(lambda: pattern.bind(inputs), q.device, 1, 5, None)
    return median(times)
