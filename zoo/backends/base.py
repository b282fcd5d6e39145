"""What a backend declares it can do, and the checks every backend shares."""

from __future__ import annotations

from collections.abc import Callable
from copy import copy
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from ..core import fused as fused_graphs
from ..core.call import AttentionCall
from ..core.call_plans import PlannedCall
from ..core.fused import fused

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
    per_head: bool = False  # runs fixed layouts that differ per query head (Pattern.per_head)
    decode: bool = False  # runs a step of new tokens against a KVCache (``Backend.decode_step``)
    # (device type, the smallest head size its kernel takes there): smaller q/k or v heads are
    # padded with zeros to it, the scale kept the call's, which changes neither scores nor output
    padded_heads: tuple[str, int] | None = None

    def __post_init__(self) -> None:
        # a str or a lone dtype would be read by `in` (substrings, or a TypeError at each call)
        for field in ("devices", "backward", "scores"):
            value = getattr(self, field)
            if not (isinstance(value, tuple) and all(isinstance(v, str) for v in value)):
                raise TypeError(f"Capabilities {field} must be a tuple of str, got {value!r}")
        if not (
            isinstance(self.dtypes, tuple) and all(isinstance(d, torch.dtype) for d in self.dtypes)
        ):
            raise TypeError(
                f"Capabilities dtypes must be a tuple of torch dtypes, got {self.dtypes!r}"
            )
        if self.patterns not in ("any", "dense"):  # anything else would read as "any"
            raise ValueError(
                "Capabilities patterns must be 'any' (every pattern) or 'dense' (full and causal "
                f"only), got {self.patterns!r}"
            )

    def head_padding(self, device: torch.device, qk_size: int, v_size: int) -> int | None:
        """The head size q/k or v are padded to on ``device``, or None if neither is."""
        if self.padded_heads is None or device.type != self.padded_heads[0]:
            return None
        least = self.padded_heads[1]
        return least if min(qk_size, v_size) < least else None

    def adaptations(self, call: AttentionCall) -> list[str]:
        """What the backend changes about this call to run it, in words (for ``explain``)."""
        least = self.head_padding(call.device, call.q.shape[-1], call.v.shape[-1])
        if least is None:
            return []
        sizes = {"q/k": call.q.shape[-1], "v": call.v.shape[-1]}
        small = " and ".join(f"{name} head size {n}" for name, n in sizes.items() if n < least)
        return [f"pads {small} with zeros to {least} (its {call.device.type} kernel's least)"]

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
        if call.pattern.per_head and not self.per_head:
            return f"it runs one layout for every head, not one per head ({call.variant!r})"
        if call.score.kind not in self.scores:
            return f"it computes {', '.join(self.scores)} scores, not {call.score.kind}"
        if call.bias is not None and not self.score_bias:
            return "it cannot add a positional bias to the scores"
        if call.dropout_p > 0 and not self.dropout:
            return "it has no attention dropout"
        if call.return_weights and not self.return_weights:
            return "it does not return attention weights"
        return None


@dataclass(frozen=True)
class DecodeStep:
    """New tokens' queries against a key-value cache, as ``zoo.decoding.decode`` prepares them
    for a backend's ``decode_step``: q (B, H, t, D), keys and values (B, H_kv, S, D) (the cache's
    slots, and the call's own tokens for a long call), positions q_pos (B, t) and key_pos (B, S),
    ``slots_ok`` (B, S) the slots in use (None: those holding a position, ``key_ok`` made on
    first use), valid (B, t) real queries, a positional bias or None, the score and dropout;
    ``mask``, the pairs the pattern allows, made on first use."""

    q: Tensor
    keys: Tensor
    values: Tensor
    pattern: object
    q_pos: Tensor
    key_pos: Tensor
    slots_ok: Tensor | None
    valid: Tensor
    bias: Callable | None
    score: object
    dropout_p: float
    # What the host knows of the step, read from no device value (``zoo.decoding.decode``):
    # how many of the first key slots its queries may attend (the later ones are empty or hold
    # keys none of them attends; None: not known), a bound of the keys any query may attend
    # (None: not known), and whether every query attends every slot in use (no mask needed).
    # The keys stay the whole store: a backend that compiles per shape (flex) sees one shape per
    # cache, one that does not (sdpa) cuts them.
    slots_in_use: int | None = None
    most_allowed: int | None = None
    every_allowed: bool = False

    @property
    def key_ok(self) -> Tensor:
        """(B, S) the slots in use: ``slots_ok``, else those holding a position. Made where it is
        read: a step on sdpa whose every query attends every slot in use reads none."""
        return self.key_pos >= 0 if self.slots_ok is None else self.slots_ok

    @property
    def mask(self) -> Tensor:
        """(B, 1, t, S) the pairs the queries may attend among the keys; (B, H, t, S) for a
        pattern whose pairs differ per head (chosen by content, or drawn per head). Made where
        it is read (each backend reads it once): a step whose every query attends every slot in
        use (full or causal attention at one length, a full window) runs on sdpa without it, some
        ten operations fewer, each a launch on a GPU. On a GPU one compiled graph
        (``zoo.core.fused``), where eagerly the pattern's operations were 20 to 50 launches a
        step (BigBird's tables, MoBA's chosen blocks). Not a functools.cached_property, whose
        lock (Python 3.11) dynamo cannot trace: a compiled step would break its graph there."""
        return self.mask_within(None)

    def mask_within(self, width: int | None) -> Tensor:
        """``mask`` for a backend that reads only the first ``width`` key slots (all where
        None): computed eagerly, over those slots only, not over every slot of the store (a
        cache that keeps every position has max_len of them: MoBA's step on a CPU spent most
        of its time asking the pattern about empty slots); as one compiled graph (a GPU,
        ``fused``), over the whole store, one shape per cache, and cut after (one fused pass
        over the store is cheap there; a width per step would be graphs more)."""
        key_pos, slots_ok = self.key_pos, self.slots_ok
        cut = width is not None and width < key_pos.shape[1]
        if cut and not fused_graphs.fuses(self.q_pos):  # looked up when called (tests force it)
            key_pos = key_pos[:, :width]
            slots_ok = None if slots_ok is None else slots_ok[:, :width]
        pattern = self.pattern
        heads = self.q.shape[1] if pattern.routed or pattern.per_head else 1
        mask = _step_mask(self.q_pos, key_pos, slots_ok, self.valid, pattern, heads)
        return mask[..., :width] if cut else mask


@fused
def _step_mask(
    q_pos: Tensor, key_pos: Tensor, slots_ok: Tensor | None, valid: Tensor, pattern: object,
    heads: int,
) -> Tensor:  # fmt: skip
    """``DecodeStep.mask`` of its tensors: (B, heads, t, S)."""
    b = torch.arange(q_pos.shape[0], device=q_pos.device)[:, None, None, None]
    h = torch.arange(heads, device=q_pos.device)[None, :, None, None]
    allowed = pattern.allowed_at(b, h, q_pos[:, None, :, None], key_pos[:, None, None, :])
    key_ok = key_pos >= 0 if slots_ok is None else slots_ok
    return allowed & key_ok[:, None, None, :] & valid[:, None, :, None]


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

    def call_plan(self, call: AttentionCall) -> PlannedCall:
        """The call's output as a function of new q, k, v and key padding (k and v zero where
        it is True) with everything else the call's (``zoo.core.call_plans``: ``zoo.attention``
        keeps it for later calls of the same signature). This one runs ``forward`` on the call
        with the new tensors; a backend whose forward finds per-shape structures on every call
        returns one that holds them."""
        return _ForwardPlan(self, call)

    def decode_reason_against(
        self,
        score_kind: str,
        dropout_p: float,
        dtype: torch.dtype | None,
        backward_on: str | None = None,
    ) -> str | None:
        """Why this backend cannot run a decoding step with these settings, or None;
        ``backward_on``: the device type where the step records gradients."""
        if not self.capabilities.decode:
            return "it has no decoding path"
        if score_kind not in self.capabilities.scores:
            return f"it computes {', '.join(self.capabilities.scores)} scores, not {score_kind}"
        if dtype is not None and dtype not in self.capabilities.dtypes:
            names = ", ".join(str(d).removeprefix("torch.") for d in self.capabilities.dtypes)
            return f"it decodes {names}, not {str(dtype).removeprefix('torch.')}"
        if dropout_p and not self.capabilities.dropout:
            return f"it decodes without dropout, got dropout_p={dropout_p}"
        if backward_on is not None and backward_on not in self.capabilities.backward:
            return (
                f"it has no backward on {backward_on} and the step records gradients (run it "
                f"under torch.no_grad() or torch.inference_mode())"
            )
        return None

    def decode_step(self, step: DecodeStep) -> Tensor:
        """The step's output (B, H, t, Dv), zeros at padding columns (``zoo.decoding.decode``
        makes the step: positions, the cache's slots and the mask)."""
        raise NotImplementedError(f"backend {self.name!r} has no decoding path")

    def scored_pairs(self, call: AttentionCall) -> int:
        """How many (query, key) scores one head of one sequence computes: Lq * Lk for a dense
        backend, the computed blocks' pairs for a sparse one."""
        return call.q_len * call.kv_len

    def layout_note(self, call: AttentionCall) -> str:
        """What the backend computes for this call, in words (for ``explain``)."""
        scored, every = self.scored_pairs(call), call.q_len * call.kv_len
        return f"computes {scored} scores per sequence and head, {scored / every:.3g} of Lq x Lk"

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class _ForwardPlan:
    """``Backend.call_plan``'s default: ``forward`` on a copy of the call with new q, k and v."""

    def __init__(self, backend: Backend, call: AttentionCall) -> None:
        self.forward = backend.forward
        # holds no tensors of the first call
        self.call = replace(call, q=None, k=None, v=None, key_padding_mask=None)

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, padding: Tensor | None) -> Tensor:
        call = copy(self.call)
        call.q, call.k, call.v, call.key_padding_mask = q, k, v, padding
        return self.forward(call)[0]


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


def step_bias(bias: Callable, heads: int, q_pos: Tensor, key_pos: Tensor) -> Tensor:
    """(B, H, t, S) positional score bias at absolute positions; q_pos (B, t), key_pos
    (B, 1 or H, S)."""
    return bias(
        head_index(heads, q_pos.device, 2)[None], q_pos[:, None, :, None], key_pos[:, :, None]
    )
