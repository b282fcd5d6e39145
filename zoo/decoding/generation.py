"""Generation: caches for a variant (``zoo.new_cache``) and the module's cached forward.

``MultiHeadAttention.new_cache`` and ``forward(x, cache=...)`` come here; the functional form is
``zoo.new_cache`` with ``zoo.attention(q, k, v, cache=...)``. See ``zoo.decoding.cache`` for what a
cache holds and ``zoo.decoding.decode`` for how a call attends it.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from ..core.arguments import check_bool, check_int
from ..core.call import unread_padded_inputs
from ..core.device_build import can_read_values, refuse_where
from ..core.heads import join_heads, split_heads
from ..core.scores import DotProduct
from ..functional import resolve_pattern, resolved_params
from ..layout.block_layout import specialized, with_heads
from ..patterns import Pattern, reads_graph
from ..patterns.grid import GridPattern
from ..patterns.retention import keep_all
from .cache import KVCache, cache_plan, cache_signature
from .decode import cache_attention, decode_backend, recording_device


def new_cache(
    variant: str | Pattern,
    *,
    batch_size: int,
    max_len: int,
    num_kv_heads: int,
    head_dim: int,
    num_heads: int | None = None,
    value_dim: int | None = None,
    causal: bool = True,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
    static: bool = False,
    rollback: int = 0,
    **params: object,
) -> KVCache:
    """A cache for ``zoo.attention(q, k, v, variant=variant, causal=True, cache=cache, ...)``
    with k and v of ``num_kv_heads`` heads, for sequences of up to ``max_len`` tokens.

    Generation is causal: a non-causal pattern lets early queries read later keys, which a
    generator does not have yet, so ``causal`` must be True (it is here to be said explicitly).
    A pattern chosen by content (moba) keeps every key and chooses its blocks at each call from
    the cache's keys (``zoo.patterns.retention``, ``zoo.decoding.decode``).

    ``static``: every step has the same shapes (see ``zoo.decoding.cache``: steps read all the
    cache's slots, masked, and the host keeps no bound that changes), so that a compiled step
    runs as one CUDA graph (``torch.compile(step, mode="reduce-overhead")``) without recording
    again at each length.

    ``rollback``: how many tokens a row may be set back (``cache.lengths = cache.lengths - n``,
    as speculative decoding does when it rejects drafted tokens) beyond the one any cache allows.
    A cache that keeps a window in a ring overwrites the oldest key at each step; ``rollback``
    extra ring slots keep that many more. A cache without a ring (full, causal, MoBA) rolls back
    any number of tokens whatever this says.

    ``num_heads``: the query heads (``MultiHeadAttention.new_cache`` passes its own). A pattern
    that differs per query head (``bigbird``'s random blocks drawn per head) keeps the union of
    the keys its heads read, and refuses a call with another number of query heads; without
    ``num_heads`` it keeps every key (any head may read any of them) and takes any number.
    """
    check_int("batch_size", batch_size)
    check_int("max_len", max_len)
    check_int("num_kv_heads", num_kv_heads)
    check_int("head_dim", head_dim)
    if causal is not True:
        raise ValueError(
            f"a cache serves causal attention only (generation has no later keys), got "
            f"causal={causal!r}; build the model with causal=True"
        )
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(
            f"dtype must be a floating-point torch.dtype (the keys' and values' own, float32, "
            f"bfloat16 or float16, say), got {dtype!r}"
        )
    device = torch.device("cpu") if device is None else torch.device(device)
    resolved = resolve_pattern(variant, True, dict(params))
    if reads_graph(resolved):
        raise ValueError(
            f"a cache cannot serve {variant!r}: its pairs are a graph given with each call "
            f"(edge_index), which a cached call does not take; run it without a cache, on the "
            f"whole sequence"
        )
    if _grid_unset(resolved):
        raise ValueError(
            f"a cache of the 2-D pattern {variant!r} needs its grid: pass grid=(H, W) (the cache "
            f"decodes the grid's H * W cells in row-major order, max_len = H * W); without one "
            f"a call infers the grid from its own length, so a cache of max_len={max_len} and a "
            f"call over fewer tokens would place the tokens on different grids"
        )
    cpu = specialized(resolved, max_len, max_len, torch.device("cpu"))  # the same random draw
    pattern = specialized(resolved, max_len, max_len, device)
    if num_heads is not None:
        check_int("num_heads", num_heads)
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}"
            )
        if cpu.per_head:  # each head's own blocks: the cache keeps the union of what they read
            cpu, pattern = with_heads(cpu, num_heads), with_heads(pattern, num_heads)
    # A pattern drawn per head whose heads are unknown: any head may read any key.
    plan = keep_all(max_len) if cpu.per_head and num_heads is None else cache_plan(cpu, max_len)
    plan = plan.with_spare(check_int("rollback", rollback, minimum=0))
    return KVCache(
        pattern=pattern,
        host_pattern=cpu,
        plan=plan,
        signature=cache_signature(variant, resolved_params(variant, params), num_kv_heads),
        batch_size=batch_size,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        value_dim=head_dim if value_dim is None else check_int("value_dim", value_dim),
        max_len=max_len,
        dtype=dtype,
        device=device,
        static=check_bool("static", static),
    )


def step_counts(valid_lens: Tensor | None, batch: int, length: int, device) -> Tensor:
    """(B,) tokens each row adds: ``valid_lens``, or the whole call. Their range is read on the
    CPU, asserted on the device elsewhere (no synchronisation); pass them on the cache's device."""
    if valid_lens is None:
        return torch.full((batch,), length, dtype=torch.long, device=device)
    if not isinstance(valid_lens, Tensor) or tuple(valid_lens.shape) != (batch,):
        shown = tuple(valid_lens.shape) if isinstance(valid_lens, Tensor) else valid_lens
        raise ValueError(f"valid_lens must be a ({batch},) int tensor, got {shown}")
    message = f"valid_lens must hold ints in [0, {length}] (this call's length)"
    if valid_lens.is_floating_point():
        raise ValueError(f"{message}, got {valid_lens.tolist()}")
    counts = valid_lens.to(device=device, dtype=torch.long)
    refuse_where(
        (counts < 0) | (counts > length), message, lambda _: f", got {valid_lens.tolist()}"
    )
    return counts


def _grid_unset(pattern: object) -> bool:
    """Whether the pattern or any pattern it is made of is a 2-D pattern without a grid."""
    if isinstance(pattern, GridPattern):
        return pattern.grid is None
    if not dataclasses.is_dataclass(pattern):
        return False
    for field in dataclasses.fields(pattern):
        value = getattr(pattern, field.name)
        members = value if isinstance(value, tuple | list) else (value,)
        if any(isinstance(m, Pattern) and _grid_unset(m) for m in members):
            return True
    return False


def embed_at(encoding, x: Tensor, cache: KVCache, counts: Tensor, full: bool) -> Tensor:
    """An absolute ("embed") encoding added to each row's ``counts`` real tokens at their
    positions, the row's length in ``cache`` onwards; padding columns take a position within
    the table, as what they get is never read (a finished row's, past a learned table's end).
    Rows of one length, every token real (``full``; the host knows when), take
    ``encoding.embed`` at that offset; others each their own positions' rows of the table (in
    eval mode: the encoding's ``table_at`` its rows at those positions, or the encoding of
    zeros), without reading a length on the host; in training mode (dropout), or with a real
    token past a learned table's end on a CPU (refused there by the encoding), one row at a time.
    A static cache's rows are never known to be of one length (its host keeps no bound)."""
    longest, even = cache.host_lengths()
    if even and full:
        return encoding.embed(x, longest)
    t = x.shape[1]
    positions = cache.next_positions(t)
    starts = positions[:, 0]
    span = longest + t
    table_len = getattr(encoding, "max_len", None)  # a learned table holds so many positions
    short = table_len is not None and span > table_len
    on_host = can_read_values(counts) and counts.device.type == "cpu"
    if encoding.training or (short and on_host and bool((starts + counts > table_len).any())):
        rows = [  # dropout drawn per row, as embed draws it; padding columns as they are
            torch.cat([encoding.embed(x[b : b + 1, :c], s), x[b : b + 1, c:]], 1)
            for b, (s, c) in enumerate(zip(starts.tolist(), counts.tolist(), strict=True))
        ]
        return torch.cat(rows)
    if short and not on_host:  # on the device: no synchronisation
        refuse_where(starts + counts > table_len, f"a token past the table's {table_len} positions")
    span = min(span, table_len) if short else span
    positions = positions.clamp(max=span - 1)
    if hasattr(encoding, "table_at"):  # each row at its own positions: no table to the longest
        return x + encoding.table_at(positions).to(x.dtype)
    table = encoding.embed(x.new_zeros(1, span, x.shape[2]), 0)[0]  # (span, dim)
    return x + table[positions]


def module_step(
    module, x: Tensor, cache: KVCache, valid_lens: Tensor | None, positions: Tensor | None
) -> Tensor:
    """``MultiHeadAttention.forward(x, cache=cache)``: x (B, t, dim) -> (B, t, dim)."""
    if not isinstance(cache, KVCache):
        raise TypeError(f"cache must be a zoo KVCache (module.new_cache), got {type(cache)}")
    cache.check_signature(
        cache_signature(
            module.variant, resolved_params(module.variant, module.params), module.num_kv_heads
        )
    )
    batch, t = x.shape[:2]
    if t == 0:  # as an uncached call refuses it: a step adds at least one token
        raise ValueError(f"x needs at least one position (dim 1), got {tuple(x.shape)}")
    if batch != cache.batch_size:
        raise ValueError(f"cache holds {cache.batch_size} sequences, x has {batch}")
    if valid_lens is None:  # every row adds the whole call: the cache's own constant
        counts = cache.whole_counts(t)
    else:
        counts = step_counts(valid_lens, batch, t, cache.keys.device)
    padding = None
    if valid_lens is not None:
        padding = cache.steps(t).to(x.device) >= counts[:, None].to(x.device)  # (B, t)
    if module.pos.kind == "embed":
        x = embed_at(module.pos, x, cache, counts, valid_lens is None)
    if padding is not None:
        x = unread_padded_inputs(x, padding)
    q = split_heads(module.q_proj(x), module.num_heads)
    k = split_heads(module.k_proj(x), module.num_kv_heads)
    v = split_heads(module.v_proj(x), module.num_kv_heads)
    cache.check_step(k, v, counts, positions)
    score = module.score if module.score is not None else DotProduct(module.head_dim**-0.5)
    dropout = module.dropout if module.training else 0.0
    grad_on = recording_device(cache, q, k, v)
    out = cache_attention(
        q,
        k,
        v,
        cache,
        counts=counts,
        encoding=module.pos if module.pos.kind in ("rotate", "bias") else None,
        score=score,
        dropout_p=dropout,
        backend=decode_backend(module.backend, score, dropout, cache, grad_on),
        full=valid_lens is None,
    )
    out = module.out_proj(join_heads(out))  # (B, t, dim)
    if padding is None:  # no padding column
        return out
    return out.masked_fill(padding[:, :, None], 0.0)  # padding columns: zeros
