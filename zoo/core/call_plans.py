"""Plans of plain calls: what ``zoo.attention`` decided for a call signature, kept for the next
call with the same signature.

A call's own work around its kernel (checking q, k and v, resolving the variant and its
parameters, specialising the pattern, choosing the backend, looking up the per-shape
structures) depends only on its signature: the variant, the backend's name, causal, the scale,
the parameters, and q, k and v's shapes, dtypes and devices, and whether the call records
gradients. On a GPU that work is host time, which at a few thousand tokens is longer than a
sparse kernel. A plan (``Backend.plan``) is the call's computation with everything but q, k
and v fixed; the first call of a signature makes it, later ones run it directly.

Only plain calls have a signature: no key padding, dropout, additive score, weights, cache,
graph, sharding or ``torch.compile`` tracing (a traced call is made once per graph anyway), a
backend given by name, and q, k and v plain tensors that hold data (fake and meta tensors take
the checked path, which builds on the device under the caller's mode). A positional encoding
is part of the signature (a name, or an instance by identity): a rotary one turns q and k in
the plan (at positions found once), a bias is in the backend's plan; one with learned
parameters (a T5 table) has no plan. A pattern chosen by content (MoBA) binds to each call's
data and has no plan either (``zoo.core.prepare.plan_of`` makes the plans).

The plans are few and least recently used first out (``MAX_PLANS``). A plan holds its
structures (a flex block mask, say) whether or not the per-shape caches still do, so
``zoo.clear_caches()`` forgets the plans too, and so does a name given a new meaning (a
backend, pattern family or variant registered again with ``replace=True``), which also clears
every per-shape cache. A new name needs nothing: no plan can use it yet.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

Plan = Callable[[Tensor, Tensor, Tensor], Tensor]

MAX_PLANS = 32

_PLANS: OrderedDict[tuple, Plan] = OrderedDict()
_LOCK = threading.Lock()


def signature(
    q: Any, k: Any, v: Any, variant: Any, backend: Any, causal: Any, scale: Any, pos: Any,
    params: dict,
) -> tuple | None:  # fmt: skip
    """The call's signature, or None where the call has none (see the module docstring). The
    caller has checked the options that are off in a plain call."""
    if type(q) is not Tensor or type(k) is not Tensor or type(v) is not Tensor:
        return None  # tensor subclasses (fake tensors, DTensor) and non-tensors: checked path
    if not isinstance(backend, str) or q.device.type == "meta" or torch.compiler.is_compiling():
        return None
    grads = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    return (
        variant, backend, causal, scale, pos, tuple(params.items()), q.shape, k.shape, v.shape,
        q.dtype, k.dtype, v.dtype, q.device, k.device, v.device, grads,
    )  # fmt: skip


def find(key: tuple) -> Plan | None:
    """The plan of this signature, or None (none yet, or a signature that cannot be a key)."""
    try:
        plan = _PLANS.get(key)
    except TypeError:  # unhashable: a parameter given as a list, say
        return None
    if plan is not None:
        with _LOCK:
            if key in _PLANS:
                _PLANS.move_to_end(key)
    return plan


def keep(key: tuple, plan: Plan) -> None:
    try:
        hash(key)
    except TypeError:
        return
    with _LOCK:
        _PLANS[key] = plan
        _PLANS.move_to_end(key)
        while len(_PLANS) > MAX_PLANS:
            _PLANS.popitem(last=False)


def clear() -> None:
    """Forget every plan (what a name means changed, or the caches were cleared)."""
    with _LOCK:
        _PLANS.clear()
