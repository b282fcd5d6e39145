"""Name -> pattern: a variant and its parameters resolved to the call's pattern once per shape.

Parameters are checked when a shape's pattern is first built (``VariantSpec.build``), and the
pattern is specialised to the lengths there too; a per-shape builder keeps the result, outside a
compiled graph (``zoo.core.shape_cache``).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ..layout.block_layout import specialized, with_heads
from ..mechanisms.dispatch import is_mechanism, mechanism_params
from ..patterns import Pattern, made_causal
from ..registry import get_spec
from .arguments import check_bool, check_parameters, close_matches, did_you_mean, typed
from .shape_cache import concrete, per_shape

# zoo.attention's keyword options (a test holds them to its signature): a parameter of a variant
# misspelt as one of these (casual=True) gets a suggestion that names the option.
CALL_OPTIONS = (
    "variant", "backend", "causal", "key_padding_mask", "dropout_p", "scale", "score", "pos",
    "return_weights", "cache", "edge_index", "cp_group", "cp_order",
)  # fmt: skip


def resolve_pattern(
    variant: str | Pattern,
    causal: bool,
    params: dict[str, object],
    *,
    options: Iterable[str] = (),
    options_of: str = "",
) -> Pattern:
    """The variant's pattern with the caller's parameters, made causal when asked.

    ``options`` are the caller's own arguments, which ``options_of`` names (see
    ``zoo.core.arguments.check_parameters``): a misspelt one, ``casual=True``, gets its
    suggestion."""
    if isinstance(variant, Pattern):
        if params:
            hint = did_you_mean(c for key in params for c in close_matches(key, options, 0.6))
            raise TypeError(
                f"parameters {sorted(params)} apply to a variant name, not to a Pattern "
                f"object{hint}"
            )
        pattern = variant
    else:
        spec = get_spec(variant)
        check_parameters(
            f"variant {variant!r}",
            params,
            spec.parameters(),
            options=options,
            options_of=options_of,
        )
        pattern = spec.build(**params)
    check_bool("causal", causal)
    return made_causal(pattern) if causal else pattern


def resolved_params(variant: str | Pattern, params: dict[str, object]) -> dict[str, object]:
    """Every parameter of a registry variant as this call sets it (defaults and overrides)."""
    if isinstance(variant, Pattern):
        return {}
    if is_mechanism(variant):
        return mechanism_params(variant, params)
    return {**get_spec(variant).parameters(), **params}


def call_pattern(
    variant: str | Pattern,
    causal: bool,
    params: dict[str, object],
    q_len: int,
    kv_len: int,
    device: torch.device,
    heads: int = 1,
) -> Pattern:
    """The call's pattern, resolved and specialised once per shape by a per-shape builder
    (``zoo.core.shape_cache``), so that under ``torch.compile`` it is made outside the traced graph:
    a pattern made inside it could not key the per-shape structures of the backends. A pattern
    that differs per query head (``Pattern.per_head``) is drawn for ``heads`` query heads, once
    per shape and number of heads."""
    if not isinstance(variant, str | Pattern):
        get_spec(variant)  # a TypeError that names what variant takes
    check_bool("causal", causal)  # before the caches, whose keys take 1 for True
    frozen = _frozen_params(params)
    if isinstance(variant, Pattern) and variant.one_call:  # not kept by the caches
        return resolve_call_pattern(variant, causal, params).specialize(q_len, kv_len, device)
    if frozen is None:  # a value that is no parameter at all: resolve_pattern says which
        pattern = resolve_call_pattern(variant, causal, params)
        pattern = specialized(pattern, q_len, kv_len, device)
    else:
        pattern = _call_pattern(variant, causal, frozen, typed(frozen), q_len, kv_len, device)
    return with_heads(pattern, heads) if pattern.per_head else pattern


@per_shape(maxsize=256)
def _call_pattern(
    variant: str | Pattern,
    causal: bool,
    params: tuple,
    typed_params: tuple,
    q_len: int,
    kv_len: int,
    device: torch.device,
) -> Pattern:
    """``typed_params``: ``params`` with their types, in the key only (a parameter of 1 and one
    of True are equal keys; the checks refuse True)."""
    pattern = resolve_call_pattern(variant, causal, dict(params))
    return specialized(pattern, q_len, kv_len, device)


def resolve_call_pattern(
    variant: str | Pattern, causal: bool, params: dict[str, object]
) -> Pattern:
    return resolve_pattern(
        variant, causal, params, options=CALL_OPTIONS, options_of="zoo.attention"
    )


def concrete_params(params: dict[str, object]) -> dict[str, object]:
    """The parameters with symbolic values as their values: a parameter that changes between
    calls of a compiled function (dynamo makes it symbolic on the second value) recompiles for
    each value, as a length does, since patterns and layouts are built per value."""
    return {
        name: [concrete(v) for v in value]
        if isinstance(value, list)
        else tuple(concrete(v) for v in value)
        if isinstance(value, tuple)
        else concrete(value)
        for name, value in params.items()
    }


def _frozen_params(params: dict[str, object]) -> tuple | None:
    """The parameters as sorted (name, value) pairs, lists as tuples; None if some value is
    not a number, string, or list of them (hashable, so a per-shape builder can take them)."""
    items = []
    for name in sorted(params):
        value = params[name]
        if isinstance(value, list | tuple):
            value = tuple(value)
            if not all(isinstance(v, int | float | str) for v in value):
                return None
        elif value is not None and not isinstance(value, int | float | str):
            return None
        items.append((name, value))
    return tuple(items)
