"""torch.autocast and the zoo: what a call casts under it, and where the zoo computes in float32
whatever autocast says."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch
from torch import Tensor


def autocast_on(device: torch.device) -> bool:
    """Whether torch.autocast is on for ``device`` (False for a device type without it: meta)."""
    try:
        return torch.is_autocast_enabled(device.type)
    except RuntimeError:
        return False


def autocast_inputs(q: object, k: object, v: object) -> tuple:
    """q, k, v in the autocast dtype where autocast is on for their device and they are float32
    (the dtype autocast lowers); as given otherwise. Without it sdpa's and flex's kernels took
    autocast's dtype and the reference's and blocked's einsums some of it, each backend another
    dtype and precision."""
    if not all(isinstance(t, Tensor) and t.dtype == torch.float32 for t in (q, k, v)):
        return q, k, v
    if not autocast_on(q.device):
        return q, k, v
    dtype = torch.get_autocast_dtype(q.device.type)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def float32_inside(device: torch.device) -> AbstractContextManager:
    """Autocast off on ``device``: for what the zoo defines in float32 (the reference's scores,
    MoBA's choice of blocks), which autocast's matmuls would otherwise lower."""
    if device.type in ("cpu", "cuda"):
        return torch.autocast(device.type, enabled=False)
    return nullcontext()
