"""``zoo.attention``: the functional call, (B, H, L, D) tensors like SDPA and FlexAttention."""

from __future__ import annotations

import inspect
from collections.abc import Iterable

import torch
from torch import Tensor

from .backends import Backend, explain_backend, resolve_backend
from .core.arguments import check_parameters, close_matches, did_you_mean
from .core.call import (
    AttentionCall,
    check_dropout,
    check_key_padding_mask,
    check_qkv,
    resolve_scale,
    unread_padding,
)
from .core.scores import AdditiveScore, DotProduct
from .core.shape_cache import concrete, new_call, per_shape
from .decoding.cache import KVCache, cache_signature
from .decoding.decode import cache_attention, counts_from_padding, decode_backend, explain_decode
from .layout.block_layout import allowed_pairs, specialized
from .mechanisms.dispatch import is_mechanism, mechanism_attention, mechanism_params
from .patterns import (
    Causal,
    GraphLayout,
    Intersection,
    Pattern,
    RouteInputs,
    made_causal,
    query_positions,
    reads_graph,
)
from .patterns.node_order import in_node_order
from .positional import PositionalEncoding
from .registry import get_encoding_spec, get_spec

Encoding = str | PositionalEncoding | None


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
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be True or False, got {causal!r}")
    return made_causal(pattern) if causal else pattern


def resolved_params(variant: str | Pattern, params: dict[str, object]) -> dict[str, object]:
    """Every parameter of a registry variant as this call sets it (defaults and overrides)."""
    if isinstance(variant, Pattern):
        return {}
    if is_mechanism(variant):
        return mechanism_params(variant, params)
    return {**get_spec(variant).parameters(), **params}


def build_encoding(
    name: str | PositionalEncoding,
    *,
    dim: int,
    num_heads: int,
    causal: bool = False,
    **params: object,
) -> PositionalEncoding:
    """A positional encoding from the registry (``zoo.list_encodings()``), or the instance given."""
    if isinstance(name, PositionalEncoding):
        if params:
            raise TypeError(
                f"parameters {sorted(params)} apply to an encoding name, not to an instance"
            )
        return name
    return get_encoding_spec(name).build(dim=dim, num_heads=num_heads, causal=causal, **params)


@per_shape(64)  # built outside a compiled graph, as the per-shape structures
def _shared_encoding(
    name: str, dim: int, num_heads: int, causal: bool, device: torch.device
) -> PositionalEncoding:
    spec = get_encoding_spec(name)
    encoding = spec.probe(dim=dim, num_heads=num_heads, causal=causal).to(device)
    if any(True for _ in encoding.parameters()):
        raise ValueError(
            f"pos={name!r} has learned parameters, which a functional call would draw anew each "
            f"time; build it once and pass the instance: zoo.build_encoding({name!r}, dim=..., "
            "num_heads=...)"
        )
    return encoding


def attention_encoding(
    pos: Encoding, q: Tensor, k: Tensor, causal: bool
) -> PositionalEncoding | None:
    """The encoding that acts inside attention (rotate or bias kind), checked against q and k."""
    if pos is None:
        return None
    num_heads, head_dim = q.shape[1], q.shape[-1]
    if isinstance(pos, str):
        pos = _shared_encoding(pos, num_heads * head_dim, num_heads, causal, q.device)
    if not isinstance(pos, PositionalEncoding):
        raise TypeError(
            f"pos must be an encoding name or a PositionalEncoding, got {type(pos).__name__}"
        )
    if pos.kind == "embed":
        raise ValueError(
            f"pos={pos.name!r} adds a table to a model's input (kind 'embed'), not to attention; "
            "apply it to the input (zoo.MultiHeadAttention does), or use rope, alibi or t5 here"
        )
    if pos.kind == "none":
        return None
    if pos.kind == "bias" and pos.num_heads != num_heads:
        raise ValueError(
            f"pos={pos.name!r} was built for {pos.num_heads} heads, but q has {num_heads}"
        )
    pos.check(q_len=q.shape[2], kv_len=k.shape[2], head_dim=head_dim)
    return pos


def call_pattern(
    variant: str | Pattern,
    causal: bool,
    params: dict[str, object],
    q_len: int,
    kv_len: int,
    device: torch.device,
) -> Pattern:
    """The call's pattern, resolved and specialised once per shape by a per-shape builder
    (``zoo.core.shape_cache``), so that under ``torch.compile`` it is made outside the traced graph:
    a pattern made inside it could not key the per-shape structures of the backends."""
    if not isinstance(variant, str | Pattern):
        get_spec(variant)  # a TypeError that names what variant takes
    frozen = _frozen_params(params)
    if frozen is None:  # a value that is no parameter at all: resolve_pattern says which
        return specialized(_resolve_call_pattern(variant, causal, params), q_len, kv_len, device)
    return _call_pattern(variant, causal, frozen, q_len, kv_len, device)


@per_shape(maxsize=256)
def _call_pattern(
    variant: str | Pattern,
    causal: bool,
    params: tuple,
    q_len: int,
    kv_len: int,
    device: torch.device,
) -> Pattern:
    pattern = _resolve_call_pattern(variant, causal, dict(params))
    return specialized(pattern, q_len, kv_len, device)


def _resolve_call_pattern(
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
    pos: Encoding = None,
    return_weights: bool = False,
    edge_index: object = None,
    **params: object,
) -> AttentionCall:
    """Check the arguments of ``attention`` and bind them into the call a backend receives;
    a rotary encoding turns q and k here, before any backend sees them."""
    check_qkv(q, k, v)
    new_call()
    params = concrete_params(params)
    pattern = call_pattern(variant, causal, params, q.shape[2], k.shape[2], q.device)
    encoding = attention_encoding(pos, q, k, causal)
    if encoding is not None and encoding.kind == "rotate":
        q_pos = query_positions(q.shape[2], k.shape[2], q.device)
        q, k = encoding.rotate(q, k, q_pos, torch.arange(k.shape[2], device=k.device))
    key_padding_mask = check_key_padding_mask(key_padding_mask, q.shape[0], k.shape[2], q.device)
    if key_padding_mask is not None:
        k, v = unread_padding(k, key_padding_mask), unread_padding(v, key_padding_mask)
    if edge_index is not None and not reads_graph(pattern):
        raise ValueError(
            f"edge_index is the graph of variant 'graph'; variant {variant!r} reads no graph"
        )
    if pattern.routed:  # blocks chosen by content, or a graph: bound here to this call
        pattern = pattern.bind(RouteInputs(q, k, key_padding_mask, causal, edge_index=edge_index))
    order = None
    bias = encoding is not None and encoding.kind == "bias"
    if isinstance(pattern, GraphLayout) and pattern.reorder and not bias:
        # The graph alone (not composed): run in its node order, outputs back in the caller's.
        pattern, order = in_node_order(pattern)
        q, k, v = order.gather(q), order.gather(k), order.gather(v)
        if key_padding_mask is not None:
            key_padding_mask = order.gather(key_padding_mask, dim=1)
    return AttentionCall(
        q=q,
        k=k,
        v=v,
        pattern=pattern,
        variant=variant if isinstance(variant, str) else type(variant).__name__,
        key_padding_mask=key_padding_mask,
        score=score if score is not None else DotProduct(resolve_scale(scale, q.shape[-1])),
        dropout_p=check_dropout(dropout_p),
        bias=encoding.bias if encoding is not None and encoding.kind == "bias" else None,
        learned=tuple(encoding.parameters()) if encoding is not None else (),
        return_weights=return_weights,
        causal=causal,
        variant_params=resolved_params(variant, params),
        order=order,
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
    pos: Encoding = None,
    return_weights: bool = False,
    cache: KVCache | None = None,
    edge_index: object = None,
    **params: object,
) -> Tensor | tuple[Tensor, Tensor]:
    """Attention of ``variant`` over q (B, H, Lq, D), k (B, H, Lk, D), v (B, H, Lk, Dv).

    Args:
        variant: a registry name (``zoo.list_variants()``) or a ``zoo.patterns.Pattern``; or a
            mechanism (``zoo.list_mechanisms()``: linear, performer, nystrom) by name or as an
            instance, which computes attention itself: ``zoo.mechanisms`` says what it takes.
        backend: a name from ``zoo.list_backends()``, a Backend instance, or "auto".
        causal: intersect the pattern with the causal mask. When Lq != Lk, queries align to the
            keys' end (bottom right, as FlashAttention); see ``zoo.patterns.base``.
        key_padding_mask: (B, Lk) bool, True where a key is padding and must be ignored.
        dropout_p: dropout on the attention weights (pass 0.0 in evaluation).
        scale: score scale; default 1/sqrt(D).
        score: an ``AdditiveScore`` for additive attention instead of the dot product.
        pos: a positional encoding that acts inside attention: "rope" turns q and k by their
            positions, "alibi" and "t5" add a bias to the scores (a name builds a shared
            parameter-free one; pass an instance for one with learned parameters). Positions
            follow the alignment above: query i at i + Lk - Lq, key j at j.
        return_weights: also return the (B, H, Lq, Lk) weights (the reference backend computes
            them: dense, for inspection).
        cache: a ``KVCache`` (``zoo.new_cache``) for generation: q, k, v are the new tokens
            (B, H, t, D), attending the cached ones and then kept; causal must be True, and
            key_padding_mask (B, t), if given, right padding. See ``zoo.decoding.cache``.
        edge_index: the graph of variant ``graph``: (2, E) int node pairs (query node, key
            node) shared by the batch, (B, 2, E) or a list of B (2, E_b) for one graph per
            sequence, or a sparse COO adjacency (L, L) or (B, L, L); see ``zoo.patterns.graph``.
        **params: the variant's parameters, overriding its registry defaults (e.g. window_size).

    Returns the output (B, H, Lq, Dv) in q's dtype, and the weights if asked. A query with no
    allowed key gets zeros, never NaN.

    Padded keys are never read: their k and v may hold anything (NaN, inf, uninitialised
    memory), on every backend, and reach no output or gradient; they get zero gradients. An
    unpadded key that a query may not read is masked by its score, as FlashAttention and
    FlexAttention mask: its finite values never count for that query, but a NaN or inf in its k
    or v can reach the query where a kernel computes their block (-inf added to an infinite
    score, 0 * NaN in the weighted sum of values). Non-finite data that must not be read is
    padding: pass it as such.

    Under ``torch.compile`` (``fullgraph=True`` works for every variant on sdpa, flex, blocked
    and auto) the pattern, its block layout, masks and the auto choice are built once per shape
    outside the traced graph (``zoo.core.shape_cache``). Lengths are static: a compiled model keeps
    one graph per (Lq, Lk) it has seen, also under ``dynamic=True``, and reuses it for every
    later call at that length. Pad batches to a few lengths (multiples of the block size, say),
    and raise ``torch._dynamo.config.recompile_limit`` (8) above 8 lengths. A Pattern passed as
    ``variant`` must be made outside the compiled region (a module attribute, say).
    """
    params = concrete_params(params)
    if is_mechanism(variant):  # computed differently, not masked: zoo/mechanisms
        if cache is not None:
            raise ValueError(
                f"cache: variant {variant!r} is a mechanism (zoo/mechanisms), and decoding with "
                "a KVCache runs the masked-softmax variants only"
            )
        check_qkv(q, k, v)
        return mechanism_attention(
            q,
            k,
            v,
            variant,
            encoding=attention_encoding(pos, q, k, causal),
            backend=backend,
            causal=causal,
            key_padding_mask=key_padding_mask,
            dropout_p=dropout_p,
            scale=scale,
            score=score,
            return_weights=return_weights,
            params=params,
        )
    if cache is not None:
        if edge_index is not None:
            raise ValueError("edge_index (a graph) is not available with a cache")
        if return_weights:
            raise ValueError("return_weights is not available with a cache")
        return _cached_attention(
            q, k, v, cache, variant=variant, backend=backend, causal=causal,
            key_padding_mask=key_padding_mask, dropout_p=dropout_p, scale=scale, score=score,
            pos=pos, params=params,
        )  # fmt: skip
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
        pos=pos,
        return_weights=return_weights,
        edge_index=edge_index,
        **params,
    )
    runner = resolve_backend(backend, call)
    out, weights = _empty_batch(call) if call.q.shape[0] == 0 else runner.forward(call)
    if call.order is not None:  # a graph run in its node order: back to the caller's
        out = call.order.scatter(out)
        weights = None if weights is None else call.order.scatter(call.order.scatter(weights), 3)
    return (out, weights) if return_weights else out


def _empty_batch(call: AttentionCall) -> tuple[Tensor, Tensor | None]:
    """(out, weights) of a call with no sequences, as SDPA answers one: empty, on every
    backend (the blocked one has no plan for zero sequences), and joined to q, k and v so that a
    backward gives them empty gradients."""
    q, k, v = call.q, call.k, call.v
    link = (q.sum() + k.sum() + v.sum()).to(q.dtype)  # 0, with a path back to each
    out = q.new_zeros(0, q.shape[1], q.shape[2], v.shape[3]) + link
    weights = q.new_zeros(0, q.shape[1], q.shape[2], k.shape[2]) if call.return_weights else None
    return out, weights


def _cached_attention(q, k, v, cache: KVCache, *, variant, backend, causal, key_padding_mask,
                      dropout_p, scale, score, pos, params) -> Tensor:  # fmt: skip
    """``attention`` with a cache: checked here, computed by ``zoo.decoding.decode``."""
    check_qkv(q, k, v)
    if causal is not True:
        raise ValueError(f"a call with a cache must be causal (causal=True), got {causal!r}")
    if not isinstance(cache, KVCache):
        raise TypeError(f"cache must be a zoo KVCache (zoo.new_cache), got {type(cache).__name__}")
    signature = cache_signature(variant, resolved_params(variant, params), k.shape[1])
    if signature != cache.signature:
        _resolve_call_pattern(variant, causal, params)  # a misspelt parameter: its suggestion
        cache.check_signature(signature)
    if q.shape[0] != cache.batch_size:
        raise ValueError(f"cache holds {cache.batch_size} sequences, q has {q.shape[0]}")
    counts = counts_from_padding(key_padding_mask, q.shape[0], q.shape[2]).to(q.device)
    cache.check_step(k, v, counts, None)
    new_call()
    if key_padding_mask is not None:
        padding = key_padding_mask.to(k.device)
        k, v = unread_padding(k, padding), unread_padding(v, padding)
    score = score if score is not None else DotProduct(resolve_scale(scale, q.shape[-1]))
    dropout_p = check_dropout(dropout_p)
    chosen = decode_backend(backend, score, dropout_p, cache.keys.dtype)
    return cache_attention(
        q, k, v, cache, counts=counts, encoding=attention_encoding(pos, q, k, causal),
        score=score, dropout_p=dropout_p, backend=chosen,
    )  # fmt: skip


CALL_OPTIONS = tuple(
    p.name for p in inspect.signature(attention).parameters.values() if p.kind == p.KEYWORD_ONLY
)


def dense_mask(
    variant: str | Pattern, q_len: int, kv_len: int | None = None, **params: object
) -> Tensor:
    """The [q_len, kv_len] bool mask of allowed pairs (True = may attend): tests, pictures."""
    kv_len = q_len if kv_len is None else kv_len
    for name, n in (("q_len", q_len), ("kv_len", kv_len)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"{name} must be a positive int, got {n!r}")
    causal = bool(params.pop("causal", False))
    edge_index = params.pop("edge_index", None)
    pattern = resolve_pattern(variant, causal, params)
    pattern = specialized(pattern, q_len, kv_len, torch.device("cpu"))
    if edge_index is not None or reads_graph(pattern):  # a graph: (graphs, L, L), caller's order
        q, k = torch.zeros(1, 1, q_len, 1), torch.zeros(1, 1, kv_len, 1)
        bound = pattern.bind(RouteInputs(q, k, None, causal, edge_index=edge_index))
        return bound.dense(q_len, kv_len)[:, 0].squeeze(0)
    return pattern.dense(q_len, kv_len)


def explain(q: Tensor, k: Tensor, v: Tensor, **kwargs: object) -> str:
    """Which backend ``attention(q, k, v, **kwargs)`` with ``backend="auto"`` runs, and why; and
    whether the variant is plain full (or causal) attention at these lengths, which would make
    its curves coincide with those of ``full`` (or ``causal``)."""
    backend = kwargs.pop("backend", "auto")
    cache = kwargs.pop("cache", None)
    if cache is not None:
        score = kwargs.get("score") or DotProduct(resolve_scale(kwargs.get("scale"), q.shape[-1]))
        return explain_decode(backend, score, cache)
    call = prepare_call(q, k, v, **kwargs)
    params = {key: value for key, value in kwargs.items() if key not in CALL_OPTIONS}
    pattern = resolve_pattern(kwargs.get("variant"), kwargs.get("causal", False), params)
    note = dense_at_length(pattern, call.q_len, call.kv_len)
    if note is not None:
        shown = ", ".join(f"{key}={value!r}" for key, value in call.variant_params.items())
        note = (
            f". Note: at q_len={call.q_len}, kv_len={call.kv_len}, {call.variant!r}"
            f"{f' ({shown})' if shown else ''} allows every pair {ALLOWS[note]}: it is {note} "
            f"attention at this length, the same as variant {note!r}"
        )
    return explain_backend(call) + (note or "")


ALLOWS = {"full": "of queries and keys", "causal": "that causal attention allows"}


def dense_at_length(pattern: Pattern, q_len: int, kv_len: int) -> str | None:
    """'full' or 'causal' where a sparse pattern allows exactly the pairs of full or causal
    attention at these lengths (a window wider than the sequence, say), else None."""
    if pattern.kind != "sparse" or pattern.routed:
        return None
    pairs = allowed_pairs(pattern, q_len, kv_len)
    if pairs == q_len * kv_len:
        return "full"
    causal = Causal()
    causal_pairs = allowed_pairs(causal, q_len, kv_len)
    # Equal counts, and the causal part all there: the pattern is the causal set, not just as big.
    if pairs == causal_pairs == allowed_pairs(Intersection((pattern, causal)), q_len, kv_len):
        return "causal"
    return None
