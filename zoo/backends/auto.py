"""``backend="auto"``: the backend the benchmark measured fastest for this kind of call, else the
first backend in a fallback order that can run the call.

The measured table (``auto_table``) comes first: where it has an entry for the call's device,
dtype, variant, causality, pass and length, that backend leads the order. The fallback order:

- attention weights asked for: reference (the only backend that returns them);
- full and causal attention: sdpa (FlashAttention on GPU, no mask), then the others;
- sparse patterns on GPU: flex (compiled, block-sparse), blocked, sdpa, reference. Measured on
  an H100 (eval/results/bench-gpu-h100, bfloat16, forward+backward, 16K and 64K tokens): flex was
  the fastest zoo backend at every point, xformers 1.43-3.84x and blocked 2.36-18.3x slower; those
  points are the table's CUDA rows. xformers is in none of these orders: a measured entry where
  it was fastest puts it first, and otherwise it comes after them (below);
- sparse patterns on CPU: blocked where it scores few enough pairs to win, else sdpa with a dense
  mask; then reference. Per scored pair the blocked backend costs more than a dense SDPA pair
  (more so forward and backward), plus a fixed cost that dominates below ~1K tokens; so it goes
  first from 1024 keys when it scores under 40% of the pairs. A layout the same for every
  sequence and head that runs key block by key block (one graph for the batch: runs shared by
  all, ``by_key``) costs nearer a dense pair; it goes first under 70%. (Measured on a 2-core
  CPU: eval/results/design-notes-cpu.md#auto-cpu-thresholds.) Compiled flex is not in this
  order on CPU: it has no backward there and compiles for seconds on first use.

After these, every other registered backend (flex on CPU, xformers, a user's
``register_backend``), in the order they were registered: where none of the above can run a
call (a device or dtype only a user's backend declares), auto runs it on one that can rather
than refusing it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..core.call import AttentionCall
from .auto_table import lookup
from .base import Backend

if TYPE_CHECKING:
    from .blocked import BlockedBackend

CPU_SPARSE_MIN_KEYS = 1024
CPU_SPARSE_MAX_DENSITY = 0.4
CPU_SHARED_RUNS_MAX_DENSITY = 0.7


def blocked_wins_on_cpu(call: AttentionCall, blocked: BlockedBackend) -> bool:
    if call.kv_len < CPU_SPARSE_MIN_KEYS or blocked.reason_against(call) is not None:
        return False
    scored, shared = blocked.scored_and_shared(call)
    limit = CPU_SHARED_RUNS_MAX_DENSITY if shared else CPU_SPARSE_MAX_DENSITY
    return scored <= limit * call.q_len * call.kv_len


def fallback_order(call: AttentionCall, backends: dict[str, Backend]) -> list[str]:
    order = _documented_order(call, backends)
    entry = None if call.return_weights else lookup(call)
    if entry is not None and entry["backend"] in backends:
        order = [entry["backend"], *(name for name in order if name != entry["backend"])]
    return order + [name for name in backends if name not in order]


def _documented_order(call: AttentionCall, backends: dict[str, Backend]) -> list[str]:
    if call.return_weights:
        return ["reference"]
    if call.pattern.kind in ("full", "causal"):
        return ["sdpa", "flex", "blocked", "reference"]
    if call.device.type == "cuda":
        return ["flex", "blocked", "sdpa", "reference"]
    if blocked_wins_on_cpu(call, backends["blocked"]):
        return ["blocked", "sdpa", "reference"]
    return ["sdpa", "blocked", "reference"]


def choose_with_reasons(
    call: AttentionCall, backends: dict[str, Backend]
) -> tuple[Backend | None, list[str]]:
    """The chosen backend (None if none can) and why each earlier one was passed over."""
    reasons = []
    for name in fallback_order(call, backends):
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
    order = " > ".join(fallback_order(call, backends))
    head = f"auto -> {backend.name}" if backend else "auto -> no backend"
    skipped = f"; passed over {'; '.join(reasons)}" if reasons else ""
    entry = None if call.return_weights else lookup(call)
    if entry is None:
        source = "no measured entry"
    elif entry["runner_up"] == "-":  # one backend timed at that point: nothing it beat
        source = (
            f"measured at n={entry['n']}: {entry['backend']} {entry['time_ms']:.3g} ms, the only "
            f"backend timed there ({entry['source']})"
        )
    else:
        source = (
            f"measured fastest at n={entry['n']}: {entry['backend']} {entry['time_ms']:.3g} ms"
            f" vs {entry['runner_up']} {entry['runner_up_ms']:.3g} ms ({entry['source']})"
        )
    where = f"{call.pattern.kind} pattern of {call.variant!r} on {call.device.type}"
    notes = [*backend.capabilities.adaptations(call), backend.layout_note(call)] if backend else []
    adapted = "".join(f"; {backend.name} {note}" for note in notes)
    return f"{head} ({source}; order for a {where}: {order}{skipped}{adapted})"
