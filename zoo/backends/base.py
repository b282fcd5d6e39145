"""What a backend declares it can do, and the checks every backend shares."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..core.call import AttentionCall

FLOATS = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Capabilities:
    devices: tuple[str, ...]  # device types that run the forward pass
    backward: tuple[str, ...]  # device types that also run the backward pass
    dtypes: tuple[torch.dtype, ...]
    patterns: str  # "any", or "dense" for full and causal only
    scores: tuple[str, ...] = ("dot",)
    score_bias: bool = False  # positional biases added to the scores (ALiBi, T5)
    dropout: bool = False
    return_weights: bool = False
    sparse: bool = False  # its cost grows with the computed blocks, not with n^2
    routed: bool = False  # runs layouts chosen by content, per sequence and head (MoBA)

    def reason_against(self, call: AttentionCall) -> str | None:
        """Why these capabilities do not cover the call, or None."""
        device = call.device.type
        if device not in self.devices:
            return f"it runs on {', '.join(self.devices)}, not {device}"
        if call.q.dtype not in self.dtypes:
            names = ", ".join(str(d).removeprefix("torch.") for d in self.dtypes)
            return f"it takes {names}, not {str(call.q.dtype).removeprefix('torch.')}"
        if call.needs_grad and device not in self.backward:
            return f"it has no backward pass on {device}"
        if self.patterns == "dense" and call.pattern.kind == "sparse":
            return f"it runs full and causal attention only, not the pattern of {call.variant!r}"
        if call.pattern.routed and not self.routed:
            return f"it cannot run blocks chosen by content ({call.variant!r})"
        if call.score.kind not in self.scores:
            return f"it computes {', '.join(self.scores)} scores, not {call.score.kind}"
        if call.bias is not None and not self.score_bias:
            return "it cannot add a positional bias to the scores"
        if call.dropout_p > 0 and not self.dropout:
            return "it has no attention dropout"
        if call.return_weights and not self.return_weights:
            return "it does not return attention weights"
        return None


class Backend:
    """A way to compute attention. Subclasses set ``name`` and ``capabilities``."""

    name: str
    capabilities: Capabilities

    def unavailable(self) -> str | None:
        """Why this backend cannot run at all in this process (a missing library), or None."""
        return None

    def reason_against(self, call: AttentionCall) -> str | None:
        """Why this backend cannot run this call, or None if it can."""
        return self.unavailable() or self.capabilities.reason_against(call)

    def forward(self, call: AttentionCall) -> tuple[Tensor, Tensor | None]:
        """(output (B, H, Lq, Dv) in q's dtype, weights (B, H, Lq, Lk) or None)."""
        raise NotImplementedError

    def scored_pairs(self, call: AttentionCall) -> int:
        """How many (query, key) scores one head of one sequence computes: Lq * Lk for a dense
        backend, the computed blocks' pairs for a sparse one."""
        return call.q_len * call.kv_len

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def key_keep(call: AttentionCall) -> Tensor | None:
    """(B, Lk) True where the key takes part, or None without a padding mask."""
    return None if call.key_padding_mask is None else ~call.key_padding_mask


def repeat_kv(x: Tensor, groups: int) -> Tensor:
    """(B, H_kv, L, D) -> (B, H_kv * groups, L, D), each key/value head repeated for its group
    of query heads: the copy that grouped-query kernels avoid, for paths that need one."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def head_index(num_heads: int, device: torch.device, trailing: int) -> Tensor:
    """Head indices shaped (H, 1, ..., 1) to broadcast against ``trailing`` more dimensions."""
    return torch.arange(num_heads, device=device).view(-1, *([1] * trailing))
