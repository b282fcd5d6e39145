"""``zoo.attention``: the functional call, (B, H, L, D) tensors like SDPA and FlexAttention."""

from __future__ import annotations

import torch
from torch import Tensor

from .backends import Backend, explain_backend, resolve_backend
from .call import AttentionCall, check_dropout, check_key_padding_mask, check_qkv, resolve_scale
from .layout import specialized
from .patterns import Causal, Intersection, Pattern
from .registry import get_spec
from .scores import AdditiveScore, DotProduct


def resolve_pattern(variant: str | Pattern, causal: bool, params: dict[str, object]) -> Pattern:
    """The variant's pattern with the caller's parameters, made causal when asked."""
    if isinstance(variant, Pattern):
        if params:
            raise TypeError(
                f"parameters {sorted(params)} apply to a variant name, not to a Pattern object"
            )
        pattern = variant
    else:
        pattern = get_spec(variant).build(**params)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be True or False, got {causal!r}")
    return Intersection((pattern, Causal())) if causal else pattern


def prepare_call(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    variant: str | Pattern,
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    scale: float | None = None,
    score: AdditiveScore | None = None,
    return_weights: bool = False,
    **params: object,
) -> AttentionCall:
    """Check the arguments of ``attention`` and bind them into the call a backend receives."""
    check_qkv(q, k, v)
    pattern = resolve_pattern(variant, causal, params)
    return AttentionCall(
        q=q,
        k=k,
        v=v,
        pattern=specialized(pattern, q.shape[2], k.shape[2], q.device),
        variant=variant if isinstance(variant, str) else type(variant).__name__,
        key_padding_mask=check_key_padding_mask(key_padding_mask, q.shape[0], k.shape[2], q.device),
        score=score if score is not None else DotProduct(resolve_scale(scale, q.shape[-1])),
        dropout_p=check_dropout(dropout_p),
        return_weights=return_weights,
    )


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    variant: str | Pattern,
    backend: str | Backend = "auto",
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    scale: float | None = None,
    score: AdditiveScore | None = None,
    return_weights: bool = False,
    **params: object,
) -> Tensor | tuple[Tensor, Tensor]:
    """Attention of ``variant`` over q (B, H, Lq, D), k (B, H, Lk, D), v (B, H, Lk, Dv).

    Args:
        variant: a registry name (``zoo.list_variants()``) or a ``zoo.patterns.Pattern``.
        backend: a name from ``zoo.list_backends()``, a Backend instance, or "auto".
        causal: intersect the pattern with the causal mask. When Lq != Lk, queries align to the
            keys' end (bottom right, as FlashAttention); see ``zoo.patterns.base``.
        key_padding_mask: (B, Lk) bool, True where a key is padding and must be ignored.
        dropout_p: dropout on the attention weights (pass 0.0 in evaluation).
        scale: score scale; default 1/sqrt(D).
        score: an ``AdditiveScore`` for additive attention instead of the dot product.
        return_weights: also return the (B, H, Lq, Lk) weights (the reference backend computes
            them: dense, for inspection).
        **params: the variant's parameters, overriding its registry defaults (e.g. window_size).

    Returns the output (B, H, Lq, Dv) in q's dtype, and the weights if asked. A query with no
    allowed key gets zeros, never NaN.
    """
    call = prepare_call(
        q,
        k,
        v,
        variant=variant,
        causal=causal,
        key_padding_mask=key_padding_mask,
        dropout_p=dropout_p,
        scale=scale,
        score=score,
        return_weights=return_weights,
        **params,
    )
    out, weights = resolve_backend(backend, call).forward(call)
    return (out, weights) if return_weights else out


def dense_mask(
    variant: str | Pattern, q_len: int, kv_len: int | None = None, **params: object
) -> Tensor:
    """The [q_len, kv_len] bool mask of allowed pairs (True = may attend): tests, pictures."""
    kv_len = q_len if kv_len is None else kv_len
    for name, n in (("q_len", q_len), ("kv_len", kv_len)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"{name} must be a positive int, got {n!r}")
    causal = bool(params.pop("causal", False))
    pattern = resolve_pattern(variant, causal, params)
    return specialized(pattern, q_len, kv_len, torch.device("cpu")).dense(q_len, kv_len)


def explain(q: Tensor, k: Tensor, v: Tensor, **kwargs: object) -> str:
    """Which backend ``attention(q, k, v, **kwargs)`` with ``backend="auto"`` runs, and why."""
    kwargs.pop("backend", None)
    return explain_backend(prepare_call(q, k, v, **kwargs))
