"""Plans of plain calls: what ``zoo.attention`` decided for a call signature, kept for the next
call with the same signature.

A call's own work around its kernel (checking q, k and v, resolving the variant and its
parameters, specialising the pattern, choosing the backend, looking up the per-shape
structures) depends only on its signature: the variant, the backend's name, causal, the scale,
the parameters, and q, k and v's shapes, dtypes and devices, and whether the call records
gradients. On a GPU that work is host time, which at a few thousand tokens is longer than a
sparse kernel. A plan (``Backend.call_plan``) is the call's computation with everything but q, k
and v fixed; the first call of a signature makes it, later ones run it directly.

Only plain calls have a signature: no dropout, additive score, weights, graph, sharding or
``torch.compile`` tracing (a traced call is made once per graph anyway), a backend given by name,
and q, k and v plain tensors that hold data (fake and meta tensors take the checked path, which
builds on the device under the caller's mode). Key padding is data: its shape, dtype and device are
in the signature, and a plan takes the mask with q, k and v (checked and applied as the checked
path does; the backend reads it per call). A positional encoding is part of the signature (a name,
or an instance by identity): a rotary one turns q and k in the plan (at positions found once), a
bias is in the backend's plan; one with learned parameters (a T5 table) has no plan. A pattern
chosen by content (MoBA) binds to each call's data and has no plan either
(``zoo.core.prepare.plan_of`` makes the plans).

A one-token decoding step (a call with a ``KVCache``, ``zoo.decoding``; plain as above, and no key
padding) has a plan too: its checks (the cache built for this variant, its parameters, heads and
batch; the backend that decodes, for where the step records gradients; the score and the encoding)
depend on its signature, what the cache was built for, its batch and whether its stores record
gradients (``step_signature``). Its plan (``zoo.functional``'s ``_cached_step``) runs the rest,
which reads and writes the cache at each step: the bound check (which also refuses new keys of
another dtype or device than the cache's, so the plan's choice of backend holds), the step itself
(MoBA's choice and a T5 table's bias included, made per step as unplanned) and the new lengths.
One plan serves every cache built alike (a model's layers), and holds none of them; it holds the
registered decoding backend it chose, not a copy.

The plans are least recently used first out (``MAX_PLANS``: a plan per layer where each layer
has an encoding instance of its own, for a few lengths). A plan holds its structures (a flex
block mask, say) whether or not the per-shape caches still do, and its encoding instance or
pattern (the key holds them) until it is dropped: ``zoo.backends.clear_caches()`` forgets the
plans too, and so does a name given a new meaning (a backend, pattern family or variant
registered again with ``replace=True``), which also clears every per-shape cache. A plan is kept
only if no clear happened while its first call ran (``generation``): a call that resolved the old
meaning of a name keeps nothing. A plan copies what it needs of its backend (flex's block size,
``compile``, ``static_lengths``, kernel options): a registered backend changed in place is seen
by new signatures only; register it again with ``replace=True`` (or call
``zoo.backends.clear_caches()``) after a change.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from .arguments import typed

# (q, k, v, key_padding_mask or None) -> the output
PlannedCall = Callable[[Tensor, Tensor, Tensor, Tensor | None], Tensor]
# (q, k, v, the KVCache) -> the output
StepPlan = Callable[[Tensor, Tensor, Tensor, Any], Tensor]

MAX_PLANS = 256

_PLANS: OrderedDict[tuple, PlannedCall | StepPlan] = OrderedDict()
_LOCK = threading.Lock()
_GENERATION = [0]  # how many times the plans were cleared


def signature(
    q: Any, k: Any, v: Any, variant: Any, backend: Any, causal: Any, scale: Any, pos: Any,
    padding: Any, params: dict,
) -> tuple | None:  # fmt: skip
    """The call's signature, or None where the call has none (see the module docstring). The
    caller has checked the options that are off in a plain call."""
    if type(q) is not Tensor or type(k) is not Tensor or type(v) is not Tensor:
        return None  # tensor subclasses (fake tensors, DTensor) and non-tensors: checked path
    if not isinstance(backend, str) or q.device.type == "meta" or torch.compiler.is_compiling():
        return None
    padded = None
    if padding is not None:  # its form is in the key, its values are data
        if type(padding) is not Tensor:
            return None
        padded = (padding.shape, padding.dtype, padding.device)
    grads = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    options = tuple((name, typed(value)) for name, value in params.items())
    key = (
        variant, backend, typed(causal), typed(scale), pos, padded, options, q.shape, k.shape,
        v.shape, q.dtype, k.dtype, v.dtype, q.device, k.device, v.device, grads,
    )  # fmt: skip
    try:
        hash(key)
    except TypeError:  # a parameter given as a list, say: no signature
        return None
    return key


def step_signature(
    q: Any, k: Any, v: Any, cache: Any, variant: Any, backend: Any, causal: Any, scale: Any,
    pos: Any, params: dict,
) -> tuple | None:  # fmt: skip
    """A one-token decoding step's signature (a call with a cache and no padding mask; the
    caller has checked the other options off): the call's own, what the cache was built for
    (``KVCache.signature_key``) and its batch, and whether the cache's stores record gradients.
    None where the call has no signature, is longer than a token (a prefill), or the cache has
    no key: the call is then checked."""
    cache_key = getattr(cache, "signature_key", None)
    if cache_key is None:
        return None
    call = signature(q, k, v, variant, backend, causal, scale, pos, None, params)
    if call is None or q.shape[2] != 1:  # a prefill's length seldom comes again
        return None
    tracked = torch.is_grad_enabled() and (cache.keys.requires_grad or cache.values.requires_grad)
    return ("step", call, cache_key, cache.batch_size, tracked)


def find(key: tuple) -> PlannedCall | StepPlan | None:
    """The plan of this signature, or None."""
    plan = _PLANS.get(key)
    if plan is not None:
        with _LOCK:
            if key in _PLANS:
                _PLANS.move_to_end(key)
    return plan


def generation() -> int:
    """Read before a call resolves its names; ``keep`` takes it back."""
    return _GENERATION[0]


def keep(key: tuple, plan: PlannedCall | StepPlan, made_in: int) -> None:
    """Keep the plan of a signature, unless the plans were cleared since ``made_in``
    (``generation()`` before the call resolved its names)."""
    with _LOCK:
        if made_in != _GENERATION[0]:
            return
        _PLANS[key] = plan
        _PLANS.move_to_end(key)
        while len(_PLANS) > MAX_PLANS:
            _PLANS.popitem(last=False)


def clear() -> None:
    """Forget every plan (what a name means changed, or the caches were cleared)."""
    with _LOCK:
        _PLANS.clear()
        _GENERATION[0] += 1
