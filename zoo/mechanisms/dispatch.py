"""A mechanism called through ``zoo.attention``: the checks and refusals shared by all of them.

``zoo.attention(q, k, v, variant="performer", ...)`` arrives here (the one dispatch point in
``zoo.functional``), with the positional encoding already resolved. By name, a mechanism is built
once per (parameters, heads, head_dim, device) and shared, as parameter-free encodings are; one
with learned parameters (linformer, nystrom with conv_kernel) is refused, since the call would
draw them anew each time: a module holds it (``zoo.create_attention``), or pass an instance.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..backends.base import repeat_kv
from ..core.call import check_dropout, check_key_padding_mask, resolve_scale
from ..core.scores import score_dtype
from ..core.shape_cache import per_shape
from ..patterns import query_positions
from ..positional import PositionalEncoding
from ..registry import get_mechanism_spec, is_mechanism_name
from .base import Mechanism


def is_mechanism(variant: object) -> bool:
    """Whether ``variant=`` names (or is) a mechanism rather than a pattern variant."""
    return isinstance(variant, Mechanism) or is_mechanism_name(variant)


def mechanism_params(variant: str | Mechanism, params: dict[str, object]) -> dict[str, object]:
    """Every parameter of a registry mechanism as this call sets it (defaults and overrides)."""
    if isinstance(variant, Mechanism):
        return {}
    return {**get_mechanism_spec(variant).parameters(), **params}


def shared_mechanism(
    name: str, params: dict[str, object], num_heads: int, head_dim: int, device: torch.device
) -> Mechanism:
    """The call's mechanism by name, built once per parameters and shape."""
    frozen = tuple(sorted(params.items()))
    try:
        hash(frozen)
    except TypeError:  # a value that is no parameter (a list, say): the build says which
        return _build_shared(name, frozen, num_heads, head_dim, device)
    return _shared(name, frozen, num_heads, head_dim, device)


@per_shape(64)
def _shared(name: str, params: tuple, num_heads: int, head_dim: int, device: torch.device):
    return _build_shared(name, params, num_heads, head_dim, device)


def _build_shared(name: str, params: tuple, num_heads: int, head_dim: int, device: torch.device):
    spec = get_mechanism_spec(name)
    with torch.random.fork_rng(devices=[]):  # never moves the caller's random state
        mechanism = spec.build(
            num_heads=num_heads,
            head_dim=head_dim,
            options=CALL_OPTIONS,
            options_of="zoo.attention",
            **dict(params),
        )
    if mechanism.learned:
        raise ValueError(
            f"mechanism {name!r} has learned parameters "
            f"({', '.join(n for n, _ in mechanism.named_parameters())}), which a functional call "
            f"would draw anew each time; use a module (zoo.create_attention({name!r}, dim=..., "
            "num_heads=...)) or pass a built instance as variant="
        )
    state = mechanism.call_state()
    if state is not None:
        raise ValueError(
            f"mechanism {name!r}: {state}, a state that a functional call does not keep; use a "
            f"module (zoo.create_attention({name!r}, dim=..., num_heads=...))"
        )
    return mechanism.to(device).eval()


CALL_OPTIONS = ("backend", "causal", "key_padding_mask", "dropout_p", "scale", "score", "pos")
CALL_OPTIONS += ("return_weights",)


def check_encoding(what: str, encoding: PositionalEncoding | None) -> None:
    """Rotary (and input) encodings work with a mechanism; a score bias has no scores to act on."""
    if encoding is not None and encoding.kind == "bias":
        raise ValueError(
            f"pos={encoding.name!r} adds a bias to the scores (kind 'bias'), but {what} never "
            "forms the scores; use pos='rope' (it turns q and k) or an input encoding "
            "(sinusoidal, learned) in the module"
        )


def mechanism_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    variant: str | Mechanism,
    *,
    encoding: PositionalEncoding | None,
    backend: object,
    causal: bool,
    key_padding_mask: Tensor | None,
    dropout_p: float,
    scale: float | None,
    score: object,
    return_weights: bool,
    params: dict[str, object],
) -> Tensor:
    """``zoo.attention`` for a mechanism: q, k, v checked by the caller, ``encoding`` resolved
    (a rotate or bias kind, or None). Refuses, with the reason, what no mechanism does."""
    mechanism, q, k, v, mask = _prepared(
        q, k, v, variant, encoding=encoding, backend=backend, causal=causal,
        key_padding_mask=key_padding_mask, dropout_p=dropout_p, scale=scale, score=score,
        return_weights=return_weights, params=params,
    )  # fmt: skip
    scale = resolve_scale(scale, q.shape[-1], score_dtype(q))
    return mechanism(q, k, v, causal=causal, key_padding_mask=mask, scale=scale)


def explain_mechanism(
    q: Tensor, k: Tensor, v: Tensor, variant: str | Mechanism, **options: object
) -> str:
    """``zoo.explain`` for a mechanism: what ``mechanism_attention`` computes for this call (the
    same checks and preparation, not the mechanism itself), or the reason it refuses the call."""
    name = variant.name if isinstance(variant, Mechanism) else variant
    what = f"{name!r} is a mechanism"
    if not isinstance(variant, Mechanism):
        spec = get_mechanism_spec(name)
        what += f" ({spec.description.rstrip('.')}; {spec.complexity})" if spec.complexity else ""
    try:
        mechanism, *_ = _prepared(q, k, v, variant, **options)
    except (TypeError, ValueError) as error:
        return f"{what}: this call is refused: {error}"
    shown = ", ".join(
        f"{key}={value!r}"
        for key, value in mechanism_params(variant, options.get("params", {})).items()
    )
    encoding = options.get("encoding")
    turned = f"; q and k turned by {encoding.name!r} first" if encoding is not None else ""
    return (
        f"{what}: it computes attention itself ({type(mechanism).__name__}"
        f"{f': {shown}' if shown else ''}), with no pattern, mask or backend"
        f"{'; causal' if options.get('causal') else ''}{turned}"
    )


def _prepared(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    variant: str | Mechanism,
    *,
    encoding: PositionalEncoding | None = None,
    backend: object = "auto",
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    scale: float | None = None,
    score: object = None,
    return_weights: bool = False,
    params: dict[str, object] | None = None,
) -> tuple[Mechanism, Tensor, Tensor, Tensor, Tensor | None]:
    """The mechanism a call runs, q and k turned by a rotary encoding, k and v repeated per
    query head, and the checked key padding mask; refusals raised with their reasons."""
    params = params or {}
    name = variant.name if isinstance(variant, Mechanism) else variant
    what = f"mechanism {name!r}"
    if return_weights:
        raise ValueError(
            f"{what} never forms the (Lq, Lk) weights, so it cannot return them; "
            "return_weights=True is for patterns"
        )
    if backend != "auto":
        shown = backend if isinstance(backend, str) else type(backend).__name__
        raise ValueError(
            f"{what} computes attention itself, with no backend; got backend={shown!r}, "
            "leave it 'auto'"
        )
    if score is not None:
        raise ValueError(f"{what} takes the dot product only; score=additive is for patterns")
    if check_dropout(dropout_p):
        raise ValueError(
            f"{what} forms no attention weights to drop, got dropout_p={dropout_p}; use 0.0 "
            "(dropout elsewhere in the model still works)"
        )
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be True or False, got {causal!r}")
    check_encoding(what, encoding)
    if isinstance(variant, Mechanism):
        if params:
            raise TypeError(
                f"parameters {sorted(params)} apply to a mechanism name, not to an instance"
            )
        mechanism = variant
    else:
        mechanism = shared_mechanism(name, params, q.shape[1], q.shape[-1], q.device)
    if q.shape[1] != mechanism.num_heads or q.shape[-1] != mechanism.head_dim:
        raise ValueError(
            f"{what} was built for {mechanism.num_heads} heads of width {mechanism.head_dim}, "
            f"but q has {q.shape[1]} of width {q.shape[-1]}"
        )
    q_len, kv_len = q.shape[2], k.shape[2]
    mask = check_key_padding_mask(key_padding_mask, q.shape[0], kv_len, q.device)
    mechanism.check_call(
        causal=causal, q_len=q_len, kv_len=kv_len, padded=mask is not None, scaled=scale is not None
    )
    if encoding is not None:
        q_pos = query_positions(q_len, kv_len, q.device)
        q, k = encoding.rotate(q, k, q_pos, torch.arange(kv_len, device=k.device))
    groups = q.shape[1] // k.shape[1]
    k, v = repeat_kv(k, groups), repeat_kv(v, groups)  # (B, H, Lk, ·)
    return mechanism, q, k, v, mask
