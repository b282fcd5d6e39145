"""The measured table behind ``backend="auto"``: which backend was fastest where the benchmark ran.

``auto_table.json`` (shipped with the package) holds one entry per measured point: device type,
dtype, variant and every one of its parameters as measured, causal, pass ("fwd" for inference,
"fwd+bwd" for training), the length n, the fastest zoo backend there and its time, and the
runner-up. An entry applies only to calls with the same parameters: a window of 256 says nothing
about a window of 4096. ``python -m eval auto-table BENCH.json``
writes it from benchmark results. A call looks up the entries of its device, dtype, variant,
causality and pass, and takes the one at the nearest measured length (in log scale); below half
the smallest measured length there is no entry, since fixed costs dominate there; above the
largest it takes the largest, as the sparse advantage only grows with n. Without an entry, auto
falls back to its documented order (``zoo.backends.auto``).
"""

from __future__ import annotations

import json
import math
from functools import lru_cache
from pathlib import Path
from typing import Any

from ..call import AttentionCall

TABLE = Path(__file__).with_name("auto_table.json")


def comparable(params: dict[str, Any]) -> dict[str, Any]:
    """Parameters as JSON keeps them (tuples become lists), to compare a call with an entry."""
    return json.loads(json.dumps(params))


@lru_cache(maxsize=4)
def load_table(path: str | None = None) -> tuple[dict[str, Any], ...]:
    file = Path(path) if path is not None else TABLE
    if not file.exists():
        return ()
    return tuple(json.loads(file.read_text())["entries"])


def lookup(
    call: AttentionCall, entries: tuple[dict[str, Any], ...] | None = None
) -> dict[str, Any] | None:
    """The measured entry that applies to this call, or None."""
    entries = load_table() if entries is None else entries
    key = {
        "device": call.device.type,
        "dtype": str(call.q.dtype).removeprefix("torch."),
        "variant": call.variant,
        "params": comparable(call.variant_params),
        "causal": call.causal,
        "pass": "fwd+bwd" if call.needs_grad else "fwd",
    }
    points = [e for e in entries if all(e[k] == v for k, v in key.items())]
    if not points or call.kv_len < min(e["n"] for e in points) / 2:
        return None
    return min(points, key=lambda e: abs(math.log(e["n"] / call.kv_len)))
