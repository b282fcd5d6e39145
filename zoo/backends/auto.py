"""``backend="auto"``: the first backend in a fallback order that can run the call.

The order, until the benchmark's measured table replaces it:

- attention weights asked for: reference (the only backend that returns them);
- full and causal attention: sdpa (FlashAttention on GPU, no mask), then the others;
- sparse patterns on GPU: flex (compiled, block-sparse), blocked, sdpa, reference;
- sparse patterns on CPU: blocked (block-sparse, with backward), sdpa, reference. Compiled flex is
  left out on CPU: it has no backward there and compiles for seconds on first use.
"""

from __future__ import annotations

from ..call import AttentionCall
from .base import Backend


def fallback_order(call: AttentionCall) -> list[str]:
    if call.return_weights:
        return ["reference"]
    if call.pattern.kind in ("full", "causal"):
        return ["sdpa", "flex", "blocked", "reference"]
    if call.device.type == "cuda":
        return ["flex", "blocked", "sdpa", "reference"]
    return ["blocked", "sdpa", "reference"]


def choose_with_reasons(
    call: AttentionCall, backends: dict[str, Backend]
) -> tuple[Backend | None, list[str]]:
    """The chosen backend (None if none can) and why each earlier one was passed over."""
    reasons = []
    for name in fallback_order(call):
        backend = backends[name]
        reason = backend.reason_against(call)
        if reason is None:
            return backend, reasons
        reasons.append(f"{name}: {reason}")
    return None, reasons


def choose(call: AttentionCall, backends: dict[str, Backend]) -> Backend:
    backend, reasons = choose_with_reasons(call, backends)
    if backend is None:
        raise ValueError("no backend can run this call (" + "; ".join(reasons) + ")")
    return backend


def explain_choice(call: AttentionCall, backends: dict[str, Backend]) -> str:
    """A sentence on which backend ``auto`` takes for this call, and why."""
    backend, reasons = choose_with_reasons(call, backends)
    order = " > ".join(fallback_order(call))
    head = f"auto -> {backend.name}" if backend else "auto -> no backend"
    skipped = f"; passed over {'; '.join(reasons)}" if reasons else ""
    where = f"{call.pattern.kind} pattern of {call.variant!r} on {call.device.type}"
    return f"{head} (fallback order for a {where}: {order}{skipped})"
