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
falls back to its documented order (``zoo.backends.auto``). The file is read once, at import;
the entry of a call is looked up once per shape (``zoo.core.shape_cache``), outside a compiled
graph.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from ..core.call import AttentionCall
from ..core.shape_cache import per_shape

TABLE = Path(__file__).with_name("auto_table.json")


def comparable(params: dict[str, Any]) -> dict[str, Any]:
    """Parameters as JSON keeps them (tuples become lists), to compare a call with an entry. A
    value JSON has no form for (a user's object) is kept as its repr, which no entry holds; a
    NumPy scalar as its number."""
    return json.loads(json.dumps(params, default=_plain))


def _plain(value: object) -> object:
    item = getattr(value, "item", None)  # NumPy and torch scalars
    return item() if callable(item) and getattr(value, "ndim", None) == 0 else repr(value)


def load_table(path: str | None = None) -> tuple[dict[str, Any], ...]:
    file = Path(path) if path is not None else TABLE
    if not file.exists():
        return ()
    return tuple(json.loads(file.read_text())["entries"])


# Read once, at import: a call never touches the file (a compiled graph could not).
SHIPPED = load_table()


def _frozen(value: object) -> object:
    """Lists as tuples, dicts as sorted item tuples: hashable, and the same once made JSON."""
    if isinstance(value, dict):
        return tuple(sorted((k, _frozen(v)) for k, v in value.items()))
    if isinstance(value, list | tuple):
        return tuple(_frozen(v) for v in value)
    return value


def lookup(
    call: AttentionCall, entries: tuple[dict[str, Any], ...] | None = None
) -> dict[str, Any] | None:
    """The measured entry that applies to this call, or None."""
    key = (
        call.device.type,
        call.q.dtype,
        call.variant,
        _frozen(call.variant_params),
        call.causal,
        "fwd+bwd" if call.needs_grad else "fwd",
        call.kv_len,
    )
    return _shipped(*key) if entries is None else _nearest(entries, *key)


@per_shape(maxsize=1024)
def _shipped(*key: object) -> dict[str, Any] | None:
    """``_nearest`` in the shipped table, once per shape."""
    return _nearest(SHIPPED, *key)


def _nearest(
    entries: tuple[dict[str, Any], ...],
    device: str,
    dtype: torch.dtype,
    variant: str,
    params: tuple,
    causal: bool,
    pass_: str,
    kv_len: int,
) -> dict[str, Any] | None:
    """The entry of the call so described, at the nearest measured length."""
    key = {
        "device": device,
        "dtype": str(dtype).removeprefix("torch."),
        "variant": variant,
        "params": comparable(dict(params)),
        "causal": causal,
        "pass": pass_,
    }
    points = [e for e in entries if all(e[k] == v for k, v in key.items())]
    if not points or kv_len < min(e["n"] for e in points) / 2:
        return None
    return min(points, key=lambda e: abs(math.log(e["n"] / kv_len)))
