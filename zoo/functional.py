"""``zoo.attention``: the functional call, (B, H, L, D) tensors like SDPA and FlexAttention."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from .backends import Backend, explain_backend, resolve_backend
from .core import call_plans
from .core.arguments import check_bool
from .core.autocast import autocast_inputs
from .core.call import AttentionCall, call_score, check_dropout, check_qkv
from .core.device_build import has_no_data
from .core.prepare import (
    Encoding,
    attention_encoding,
    build_encoding,
    check_graph_wanted,
    plan_of,
    prepare_call,
)
from .core.resolve import (
    CALL_OPTIONS,
    call_pattern,
    concrete_params,
    resolve_call_pattern,
    resolve_pattern,
    resolved_params,
)
from .core.scores import AdditiveScore
from .core.shape_cache import new_call
from .decoding.cache import KVCache, cache_signature
from .decoding.decode import (
    cache_attention,
    counts_from_padding,
    decode_backend,
    explain_decode,
    recording_device,
)
from .layout.block_layout import (
    allowed_pairs,
    allowed_pairs_bounds,
    head_layout,
    specialized,
    with_heads,
)
from .mechanisms.dispatch import explain_mechanism, is_mechanism, mechanism_attention
from .parallel import context_parallel_attention, shard_stats
from .parallel.shards import check_order_name
from .patterns import Causal, Intersection, Pattern, RouteInputs, reads_graph
from .patterns.graph_edges import graph_count

# Re-exported: code written against zoo.functional finds them here.
__all__ = [
    "attention", "build_encoding", "dense_mask", "explain", "prepare_call", "resolve_pattern",
    "resolved_params",
]  # fmt: skip


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
    cp_group: object = None,
    cp_order: str = "contiguous",
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
        cp_group: a ``torch.distributed`` process group for context parallelism: q, k, v (and
            key_padding_mask, (B, shard)) are then this rank's equal shard of one sequence, and
            the result is this rank's shard of the whole sequence's attention, forward and
            backward, exchanging only the key/value blocks the pattern reads (``zoo.parallel``).
        cp_order: how the sequence is sharded with cp_group: "contiguous" (rank r holds
            [r * s, (r + 1) * s)) or "head_tail" (chunks r and 2 * world - 1 - r of s / 2:
            causal load balance); ``zoo.parallel.shard`` cuts a whole sequence so.
        **params: the variant's parameters, overriding its registry defaults (e.g. window_size).

    Returns the output (B, H, Lq, Dv) in q's dtype, and the weights if asked. A query with no
    allowed key gets zeros, never NaN. Under ``torch.autocast``, float32 q, k and v are cast to
    its dtype first, as torch's own attention is, so every backend returns that dtype.

    Padded keys are never read: their k and v may hold anything (NaN, inf, uninitialised
    memory), on every backend, and reach no output or gradient; they get zero gradients. An
    unpadded key that a query may not read is masked by its score, as FlashAttention and
    FlexAttention mask: its finite values never count for that query, but a NaN or inf in its k
    or v can reach the query where a kernel computes their block (-inf added to an infinite
    score, 0 * NaN in the weighted sum of values). Non-finite data that must not be read is
    padding: pass it as such.

    A call without dropout, an additive score, weights, a cache, a graph, a pattern chosen by
    content or an encoding with learned parameters, on plain tensors that hold data, with the
    backend given by name, is checked and resolved once per signature (variant, options, the
    shapes, dtypes and devices of q, k, v and the padding mask, whether it records gradients):
    later calls of that signature run the plan the first one kept (``zoo.core.call_plans``), with
    little host work around the kernel. A one-token step with a cache (no padding mask, dropout or
    additive score; plain tensors, the backend by name, not traced) is checked once per
    signature and cache built alike (variant, parameters, heads, batch): later steps check only
    what the cache holds (a pattern chosen by content and a learned encoding included, made per
    step as before).

    Under ``torch.compile`` (``fullgraph=True`` works for every variant on sdpa, flex, blocked
    and auto) the pattern, its block layout, masks and the auto choice are built once per shape
    outside the traced graph (``zoo.core.shape_cache``). Lengths are static: a compiled model keeps
    one graph per (Lq, Lk) it has seen, also under ``dynamic=True``, and reuses it for every
    later call at that length. Pad batches to a few lengths (multiples of the block size, say),
    and raise ``torch._dynamo.config.recompile_limit`` (8) above 8 lengths. A Pattern passed as
    ``variant`` must be made outside the compiled region (a module attribute, say).
    """
    # a float32 cache keeps float32 keys (a cache of another type is refused below, by name)
    if not isinstance(cache, KVCache) or cache.keys.dtype != torch.float32:
        q, k, v = autocast_inputs(q, k, v)
    if cp_order != "contiguous":  # also without cp_group: a misspelt order is named at once
        check_order_name(cp_order)
    plain = (
        cp_group is None and score is None and edge_index is None and return_weights is False
        and not isinstance(dropout_p, bool) and isinstance(dropout_p, int | float)
        and dropout_p == 0
    )  # fmt: skip
    key, made_in = None, 0
    if plain and cache is None:  # a later call of a signature runs the first one's plan
        key = call_plans.signature(  # (``zoo.core.call_plans``)
            q, k, v, variant, backend, causal, scale, pos, key_padding_mask, params
        )
        plan = None if key is None else call_plans.find(key)
        if plan is not None:
            new_call()
            return plan(q, k, v, key_padding_mask)
        made_in = call_plans.generation()
    elif plain and key_padding_mask is None:  # a decoding step: likewise, on a cache built alike
        key = call_plans.step_signature(
            q, k, v, cache, variant, backend, causal, scale, pos, params
        )
        step = None if key is None else call_plans.find(key)
        if step is not None:
            return step(q, k, v, cache)
        made_in = call_plans.generation()
    if cp_group is not None:  # one sequence sharded over the group's ranks
        _check_shardable_options(cache, return_weights, edge_index)
        return context_parallel_attention(
            q, k, v, group=cp_group, variant=variant, backend=backend, causal=causal,
            key_padding_mask=key_padding_mask, dropout_p=dropout_p, scale=scale, score=score,
            pos=pos, order=cp_order, **params,
        )  # fmt: skip
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
            params=concrete_params(params),
        )
    if cache is not None:
        if edge_index is not None:
            raise ValueError("edge_index (a graph) is not available with a cache")
        if return_weights:
            raise ValueError("return_weights is not available with a cache")
        out, step = _cached_step(
            q, k, v, cache, key_padding_mask, variant=variant, backend=backend, causal=causal,
            dropout_p=dropout_p, scale=scale, score=score, pos=pos, params=concrete_params(params),
        )  # fmt: skip
        if key is not None:  # once it has run
            call_plans.keep(key, step, made_in)
        return out
    options = dict(variant=variant, causal=causal, key_padding_mask=key_padding_mask,
                   dropout_p=dropout_p, scale=scale, score=score, pos=pos,
                   return_weights=return_weights, edge_index=edge_index, **params)  # fmt: skip
    if key is not None and _planned(variant, causal, params, q, k, pos):
        # The first call of a signature runs its plan on q, k and v as given, as every later
        # call does, and its preparation records no gradients: else the first run saved more
        # tensors for backward than a later one, and activation checkpointing, whose
        # recomputation finds the plan made, failed on every new length of a padded batch.
        with torch.no_grad():
            call = prepare_call(q, k, v, **options)  # makes the parameters concrete itself
        plan = plan_of(call, resolve_backend(backend, call), attention_encoding(pos, q, k, causal))
        if plan is not None:
            out = plan(q, k, v, key_padding_mask)
            call_plans.keep(key, plan, made_in)  # once it has run
            return out
    call = prepare_call(q, k, v, **options)
    runner = resolve_backend(backend, call)
    out, weights = _empty_batch(call) if call.q.shape[0] == 0 else runner.forward(call)
    if call.order is not None:  # a graph run in its node order: back to the caller's
        out = call.order.scatter(out)
        weights = None if weights is None else call.order.scatter(call.order.scatter(weights), 3)
    return (out, weights) if return_weights else out


def _planned(variant: object, causal: object, params: dict, q: Tensor, k: Tensor, pos) -> bool:
    """Whether ``plan_of`` will give the call a plan, told before it is prepared: not for no
    sequences, an encoding with learned parameters or a pattern chosen by content (``plan_of``'s
    cases; such a call, prepared for nothing, would be prepared twice at every call), nor for a
    pattern that cannot be resolved (``prepare_call`` then raises, naming what is wrong)."""
    if not q.shape[0] or (isinstance(pos, nn.Module) and next(pos.parameters(), None) is not None):
        return False
    try:
        pattern = call_pattern(
            variant, causal, concrete_params(params), q.shape[2], k.shape[2], q.device
        )
    except Exception:
        return False
    return not pattern.routed


def _check_shardable_options(cache: object, return_weights: bool, edge_index: object) -> None:
    """Options a sharded call refuses, raised alike on every rank before any collective."""
    for name, given, why in (
        ("cache", cache is not None, "decoding with a cache runs on one process"),
        ("return_weights", return_weights, "each rank holds only its rows of the weights"),
        ("edge_index", edge_index is not None, "a graph's pairs are not sharded"),
    ):
        if given:
            raise ValueError(f"{name} is not available with cp_group: {why}; drop {name}")


def _empty_batch(call: AttentionCall) -> tuple[Tensor, Tensor | None]:
    """(out, weights) of a call with no sequences, as SDPA answers one: empty, on every
    backend (the blocked one has no plan for zero sequences), and joined to q, k and v so that a
    backward gives them empty gradients."""
    q, k, v = call.q, call.k, call.v
    link = (q.sum() + k.sum() + v.sum()).to(q.dtype)  # 0, with a path back to each
    out = q.new_zeros(0, q.shape[1], q.shape[2], v.shape[3]) + link
    weights = q.new_zeros(0, q.shape[1], q.shape[2], k.shape[2]) if call.return_weights else None
    return out, weights


def _check_cached_call(q, k, v, cache: object, variant, causal, params: dict) -> None:
    """What a call with a cache must be (``attention`` and ``explain`` alike): causal, on a
    KVCache built for this variant, its parameters and heads, and this batch."""
    check_qkv(q, k, v)
    if variant is None:
        raise TypeError("a call with a cache needs its variant= (the one the cache was built for)")
    if causal is not True:
        raise ValueError(f"a call with a cache must be causal (causal=True), got {causal!r}")
    if not isinstance(cache, KVCache):
        raise TypeError(f"cache must be a zoo KVCache (zoo.new_cache), got {type(cache).__name__}")
    signature = cache_signature(variant, resolved_params(variant, params), k.shape[1])
    if signature != cache.signature:
        resolve_call_pattern(variant, causal, params)  # a misspelt parameter: its suggestion
        cache.check_signature(signature)
    if q.shape[0] != cache.batch_size:
        raise ValueError(f"cache holds {cache.batch_size} sequences, q has {q.shape[0]}")


def _cached_step(
    q, k, v, cache: KVCache, key_padding_mask, *, variant, backend, causal, dropout_p, scale,
    score, pos, params,
) -> tuple[Tensor, Callable[..., Tensor]]:  # fmt: skip
    """``attention`` with a cache: checked here, computed by ``zoo.decoding.decode``. Returns the
    output and the plan of a later one-token step of this signature (``zoo.core.call_plans``):
    ``step(q, k, v, cache)``, which checks only what the cache holds."""
    _check_cached_call(q, k, v, cache, variant, causal, params)
    if key_padding_mask is None:  # every row adds the whole call: the cache's own constant
        counts = cache.whole_counts(q.shape[2])
    else:
        counts = counts_from_padding(key_padding_mask, q.shape[0], q.shape[2], q.device).to(
            q.device
        )
    cache.check_step(k, v, counts, None)
    new_call()
    score = call_score(score, scale, q)
    dropout_p = check_dropout(dropout_p)
    chosen = decode_backend(backend, score, dropout_p, cache, recording_device(cache, q, k, v))
    encoding = attention_encoding(pos, q, k, causal)

    def step(q: Tensor, k: Tensor, v: Tensor, cache: KVCache) -> Tensor:
        counts = cache.whole_counts(q.shape[2])
        cache.check_step(k, v, counts, None)
        new_call()
        return cache_attention(
            q, k, v, cache, counts=counts, encoding=encoding, score=score, dropout_p=dropout_p,
            backend=chosen, full=True,
        )  # fmt: skip

    out = cache_attention(
        q, k, v, cache, counts=counts, encoding=encoding, score=score, dropout_p=dropout_p,
        backend=chosen, full=key_padding_mask is None,
    )  # fmt: skip
    return out, step


def dense_mask(
    variant: str | Pattern,
    q_len: int,
    kv_len: int | None = None,
    *,
    heads: int | None = None,
    **params: object,
) -> Tensor:
    """The [q_len, kv_len] bool mask of allowed pairs (True = may attend): tests, pictures.

    A pattern drawn per query head (``bigbird``'s random blocks) shows head 0 by default;
    ``heads=H`` gives the [H, q_len, kv_len] masks of the H heads that ``attention`` runs with H
    query heads (any pattern: a pattern the same for every head repeats its mask). A graph's
    masks lead with its sequences: (graphs, [H,] q_len, kv_len) for a graph per sequence."""
    kv_len = q_len if kv_len is None else kv_len
    for name, n in (("q_len", q_len), ("kv_len", kv_len)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"{name} must be a positive int, got {n!r}")
    if heads is not None and (isinstance(heads, bool) or not isinstance(heads, int) or heads < 1):
        raise ValueError(f"heads must be a positive int or None, got {heads!r}")
    causal = check_bool("causal", params.pop("causal", False))
    edge_index = params.pop("edge_index", None)
    pattern = resolve_pattern(variant, causal, params)
    pattern = specialized(pattern, q_len, kv_len, torch.device("cpu"))
    check_graph_wanted(edge_index, pattern, variant)
    if reads_graph(pattern):  # a graph: (graphs, L, L), caller's order
        graphs = graph_count(edge_index)  # a sequence of each
        q, k = torch.zeros(graphs, 1, q_len, 1), torch.zeros(graphs, 1, kv_len, 1)
        bound = pattern.bind(RouteInputs(q, k, None, causal, edge_index=edge_index))
        masks = bound.dense(q_len, kv_len)[:, 0]
        if heads is not None:
            masks = masks[:, None].expand(-1, heads, -1, -1)
        return masks.squeeze(0)
    if heads is None:
        return pattern.dense(q_len, kv_len)
    if not pattern.per_head:
        return pattern.dense(q_len, kv_len).expand(heads, -1, -1)
    drawn = pattern.for_heads(heads)
    return torch.stack([drawn.head(h).dense(q_len, kv_len) for h in range(heads)])


def explain(q: Tensor, k: Tensor, v: Tensor, **kwargs: object) -> str:
    """Which backend ``attention(q, k, v, **kwargs)`` runs (``auto``'s choice, and why; or the
    named backend, or why it cannot), and what it computes; and whether the variant is plain full
    (or causal) attention at these lengths, which would make its curves coincide with those of
    ``full`` (or ``causal``). For a mechanism: what it computes for this call, with its
    parameters, or the reason ``attention`` refuses the call."""
    backend = kwargs.pop("backend", "auto")
    cp_group = kwargs.pop("cp_group", None)
    if cp_group is not None:
        return _explain_sharded(q, k, v, cp_group, **kwargs)
    check_order_name(kwargs.pop("cp_order", "contiguous"))  # as attention takes it
    cache = kwargs.pop("cache", None)
    if cache is not None:
        params = {key: value for key, value in kwargs.items() if key not in CALL_OPTIONS}
        _check_cached_call(q, k, v, cache, kwargs.get("variant"), kwargs.get("causal", False),
                           params)  # fmt: skip
        score = call_score(kwargs.get("score"), kwargs.get("scale"), q)
        dropout_p = check_dropout(kwargs.get("dropout_p", 0.0))
        return explain_decode(backend, score, cache, dropout_p, recording_device(cache, q, k, v))
    if is_mechanism(kwargs.get("variant")):
        return _explain_mechanism(q, k, v, backend, **kwargs)
    call = prepare_call(q, k, v, **kwargs)
    params = {key: value for key, value in kwargs.items() if key not in CALL_OPTIONS}
    pattern = resolve_pattern(kwargs.get("variant"), kwargs.get("causal", False), params)
    note = dense_at_length(pattern, call.q_len, call.kv_len, call.q.shape[1])
    if note is not None:
        shown = ", ".join(f"{key}={value!r}" for key, value in call.variant_params.items())
        note = (
            f". Note: at q_len={call.q_len}, kv_len={call.kv_len}, {call.variant!r}"
            f"{f' ({shown})' if shown else ''} allows every pair {ALLOWS[note]}: it is {note} "
            f"attention at this length, the same as variant {note!r}"
        )
    if note is None:
        note = f"; {allowed_note(pattern, call)}"
    return explain_backend(call, backend) + note


def _explain_mechanism(q: Tensor, k: Tensor, v: Tensor, backend: object, **kwargs: object) -> str:
    """``explain`` for a mechanism: what it computes for this call, or why it refuses it."""
    check_qkv(q, k, v)
    taken = ("causal", "key_padding_mask", "dropout_p", "scale", "score", "return_weights")
    options = {key: kwargs[key] for key in taken if key in kwargs}
    params = {key: value for key, value in kwargs.items() if key not in CALL_OPTIONS}
    try:
        encoding = attention_encoding(kwargs.get("pos"), q, k, kwargs.get("causal", False))
    except (TypeError, ValueError) as error:  # as explain_mechanism tells a refusal
        return f"{kwargs['variant']!r} is a mechanism: this call is refused: {error}"
    return explain_mechanism(
        q, k, v, kwargs["variant"], **options, backend=backend, encoding=encoding,
        params=concrete_params(params),
    )  # fmt: skip


def _explain_sharded(q: Tensor, k: Tensor, v: Tensor, group: object, **kwargs: object) -> str:
    """``explain`` with a cp_group: what this rank receives and computes (no collective)."""
    order = kwargs.pop("cp_order", "contiguous")
    # refused as attention refuses them, not described as a call that would run
    _check_shardable_options(kwargs.pop("cache", None), kwargs.pop("return_weights", False),
                             kwargs.get("edge_index"))  # fmt: skip
    for option in ("scale", "score"):  # no effect on the plan
        kwargs.pop(option, None)
    stats = shard_stats(q, k, v, group=group, order=order, **kwargs)
    if stats.routed:
        return (
            f"context parallel rank {stats.rank} of {stats.world} ({order}): its queries choose "
            "their key blocks by content, so what it receives is known in the call only: the "
            "blocks they choose, from the block sums that the ranks add up, at most "
            f"{stats.received_bytes} bytes ({stats.received_rows} key/value rows per sequence "
            "and key/value head, every other shard)"
        )
    sources = ", ".join(str(r) for r in stats.sources) or "none"
    shipped = ""
    if stats.ship_to:
        shipped = (
            f"; ships {stats.wide_rows} wide query rows to ranks "
            f"{', '.join(map(str, stats.ship_to))}, which return their partials"
        )
    return (
        f"context parallel rank {stats.rank} of {stats.world} ({order}): receives "
        f"{stats.received_bytes} bytes ({stats.received_rows} key/value rows per sequence and "
        f"key/value head, from ranks: {sources}; and any wide query rows and partials){shipped}; "
        f"with overlap, computes {stats.interior_rows} of its {q.shape[2]} query rows while the "
        f"exchange is in flight; its queries attend {stats.pairs:g} pairs per sequence and head"
    )


ALLOWS = {"full": "of queries and keys", "causal": "that causal attention allows"}


def allowed_note(pattern: Pattern, call: AttentionCall) -> str:
    """The pairs the pattern allows at the call's lengths, in words (for ``explain``): what a
    backend's computed scores are set against. Per sequence and head; a range where heads (a
    pattern drawn per head) or sequences (a graph per sequence) differ. A pattern chosen by
    content chooses at each call; a graph's edges are counted from the call's own list (not from
    fake tensors, nor where the graph is composed with other patterns)."""
    q_len, kv_len = call.q_len, call.kv_len
    batch = call.q.shape[0]
    listed = None if has_no_data(call.q) else call.pattern.listed_pairs(batch)
    if listed is not None:  # a graph's edges
        counts = torch.bincount(listed[0], minlength=batch).tolist()
    elif reads_graph(pattern):  # fake tensors, or a graph composed with other patterns
        return "the pattern's pairs follow the call's graph (not counted here)"
    elif pattern.routed:
        return "the pattern chooses its pairs by content, per sequence and head, at each call"
    elif pattern.per_head:
        heads = call.q.shape[1]
        drawn = with_heads(specialized(pattern, q_len, kv_len, torch.device("cpu")), heads)
        counts = [allowed_pairs(head_layout(drawn, h), q_len, kv_len) for h in range(heads)]
    else:
        counts = [allowed_pairs(pattern, q_len, kv_len)]
    low, high, every = min(counts), max(counts), q_len * kv_len
    # the pattern's pairs: a padded key takes some away from its sequence, which this leaves
    aside = " (padding aside)" if call.key_padding_mask is not None else ""
    if low == high:
        return (
            f"the pattern allows {low} pairs per sequence and head{aside}, {low / every:.3g} "
            f"of Lq x Lk"
        )
    which = "head" if pattern.per_head else "sequence"
    return (
        f"the pattern allows {low} to {high} pairs per sequence and head (by {which}){aside}, "
        f"{low / every:.3g} to {high / every:.3g} of Lq x Lk"
    )


def dense_at_length(pattern: Pattern, q_len: int, kv_len: int, heads: int = 1) -> str | None:
    """'full' or 'causal' where a sparse pattern allows exactly the pairs of full or causal
    attention at these lengths (a window wider than the sequence, say), else None; a pattern
    drawn per head (``per_head``) in each of its ``heads`` query heads (a pattern's own views
    are head 0's)."""
    if pattern.kind != "sparse" or pattern.routed:
        return None
    if pattern.per_head:
        drawn = with_heads(specialized(pattern, q_len, kv_len, torch.device("cpu")), heads)
        found = set()
        for h in range(heads):  # the first head that is not dense, or differs, decides
            found.add(dense_at_length(head_layout(drawn, h), q_len, kv_len))
            if None in found or len(found) > 1:
                return None
        return found.pop()
    causal = Causal()
    causal_pairs = allowed_pairs(causal, q_len, kv_len)
    # The block states bound the count first: a sparse pattern at a long length (BigBird at
    # 128K tokens, mostly partial blocks) is told apart without evaluating its pairs.
    low, high = allowed_pairs_bounds(pattern, q_len, kv_len, 128)
    if not (low <= q_len * kv_len <= high or low <= causal_pairs <= high):
        return None
    pairs = allowed_pairs(pattern, q_len, kv_len)
    if pairs == q_len * kv_len:
        return "full"
    # Equal counts, and the causal part all there: the pattern is the causal set, not just as big.
    if pairs == causal_pairs == allowed_pairs(Intersection((pattern, causal)), q_len, kv_len):
        return "causal"
    return None
