"""Attention of new tokens against a ``KVCache``: the decoding path of ``zoo.attention``.

A call's queries sit at their rows' absolute positions (``zoo.decoding.cache``). Keys are the
cache's slots, plus the call's own keys: one token is written first and attends the slots alone; a
longer call (a prefill) attends the slots and its own keys, then is written, in chunks of at most
``CHUNK`` queries so that the score matrix stays small. The mask is the pattern's ``allowed`` on the
absolute positions of queries and slots, so a cache that holds only a window, or a window and pinned
global tokens, gives the pattern's output exactly.

Backends for one query against a cache (``decode_backend``):

- ``sdpa``: ``scaled_dot_product_attention`` over the slots. With one query per row and fewer than
  half of the slots allowed (a BigBird or strided pattern, whose cache keeps keys that this query
  does not read), the allowed keys are gathered first, so the kernel sees only them; for a
  pattern chosen by content (MoBA), each query head's own chosen keys, where those copies are
  fewer than half of what the kernel would read in place. A window cache, all of it allowed,
  goes in as it is, and full or causal attention with every slot in use runs without a mask.
  MoBA scores its blocks from sums the cache keeps (``KVCache.key_block_sums``), so a step
  reads the chosen keys and one mean per block, not every key.
- ``flex``: FlexAttention with a block mask over the step's query rows and the cache's slots, its
  mask_mod reading the slots' absolute positions (``zoo.decoding.decode_flex``). Named by
  ``backend="flex"`` or a ``FlexBackend`` (its block size and ``compile`` apply; ``compile=False``
  runs flex's eager path, for tests on CPU). Dot scores, no dropout.
- ``reference``: dense float32 scores and an explicit softmax; additive scores, and the oracle.

``auto`` takes sdpa on every device. For one query the work is reading the kept keys, which the
gather does without a compiled kernel; on CPU compiled flex pads the query row to a whole block
and compiles for seconds per shape. On CUDA flex would be the choice where the decode benchmark
(``eval/configs/bench_decode.yaml``, impl ``zoo:VARIANT:flex`` beside the sdpa gather) measures it
faster: long caches whose allowed keys are sparse in whole blocks (strided, bigbird, moba). That
measurement has not run yet, so auto stays on sdpa there too; the blocked and xformers backends
have no decoding path (a cached call named for them runs on auto's choice, and ``explain`` says so).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..backends.base import FLOATS, head_index, repeat_kv
from ..backends.blocked.index_rows import index_rows
from ..backends.flex import FlexBackend
from ..backends.reference import safe_softmax
from ..core.scores import AdditiveScore, DotProduct
from ..patterns import Pattern, RouteInputs
from ..positional import PositionalEncoding
from .cache import KVCache
from .decode_flex import flex_decode

CHUNK = 256  # queries per chunk of a long call
DECODE_BACKENDS = ("sdpa", "flex", "reference")


def decode_backend(
    backend: object,
    score: DotProduct | AdditiveScore,
    dropout_p: float,
    dtype: torch.dtype | None = None,
) -> str | FlexBackend:
    """The backend that runs a cached call in ``dtype``: "sdpa", "reference", or the
    ``FlexBackend`` whose settings flex decoding uses (see the module docstring)."""
    name = backend if isinstance(backend, str) else getattr(backend, "name", None)
    if name in ("sdpa", "flex") and score.kind != "dot":
        raise ValueError(
            f"backend {name!r} computes dot scores, not {score.kind}; decode with "
            "backend='reference' or 'auto'"
        )
    if name == "flex":
        if dtype is not None and dtype not in FLOATS:
            raise ValueError(
                f"backend 'flex' decodes {', '.join(str(t)[6:] for t in FLOATS)}, not "
                f"{str(dtype)[6:]}; decode with backend='sdpa' or 'reference'"
            )
        if dropout_p:
            raise ValueError(
                f"backend 'flex' decodes without dropout, got dropout_p={dropout_p}; decode in "
                "eval mode, or with backend='sdpa' or 'reference'"
            )
        return backend if isinstance(backend, FlexBackend) else FlexBackend()
    if name in DECODE_BACKENDS:
        return name
    return "sdpa" if score.kind == "dot" else "reference"


def explain_decode(backend: object, score: DotProduct | AdditiveScore, cache: KVCache) -> str:
    """What ``explain`` says for a call with a cache."""
    chosen = decode_backend(backend, score, 0.0, cache.keys.dtype)
    chosen = chosen if isinstance(chosen, str) else f"flex ({chosen!r})"
    plan = cache.plan
    asked = backend if isinstance(backend, str) else getattr(backend, "name", "?")
    note = (
        ""
        if asked in (*DECODE_BACKENDS, "auto")
        else f" (backend {asked!r} has no decoding path; a cached call runs on {chosen})"
    )
    return (
        f"decoding with a cache on {chosen}{note}: {plan.slots} slots "
        f"({plan.pinned.numel()} pinned, a ring of {plan.ring} for a window of {plan.window}) "
        f"of max_len={cache.max_len}; one query attends the slots its pattern allows"
        + (", gathered when fewer than half of them" if chosen == "sdpa" else "")
        + (", a block mask on their absolute positions" if chosen.startswith("flex") else "")
        + (", blocks chosen by content from every kept key" if cache.pattern.routed else "")
    )


def counts_from_padding(key_padding_mask: Tensor | None, batch: int, length: int) -> Tensor:
    """(B,) real tokens per row from a (B, t) right-padding mask of a call's new tokens."""
    if key_padding_mask is None:
        return torch.full((batch,), length, dtype=torch.long)
    mask = key_padding_mask
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool or mask.shape != (batch, length):
        shown = tuple(mask.shape) if isinstance(mask, Tensor) else type(mask).__name__
        raise ValueError(
            f"with a cache, key_padding_mask must be a ({batch}, {length}) bool tensor over the "
            f"call's new tokens, got {shown}"
        )
    counts = (~mask).sum(1)
    if not torch.equal(mask, torch.arange(length, device=mask.device) >= counts[:, None]):
        raise ValueError(
            "with a cache, key_padding_mask must be right padding (each row: real tokens, then "
            "padding), since a row's tokens take consecutive positions"
        )
    return counts


def cache_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cache: KVCache,
    *,
    counts: Tensor,
    encoding: PositionalEncoding | None,
    score: DotProduct | AdditiveScore,
    dropout_p: float,
    backend: str | FlexBackend,
) -> Tensor:
    """q (B, H, t, D), k and v (B, H_kv, t, D) of the new tokens, ``counts`` (B,) of them real in
    each row -> output (B, H, t, Dv), zeros at padding columns; the cache takes the new keys."""
    t = q.shape[2]
    if t > 1 and t > CHUNK:
        outs = []
        for start in range(0, t, CHUNK):
            part = slice(start, start + CHUNK)
            sub = (counts - start).clamp(0, min(CHUNK, t - start))
            outs.append(
                cache_attention(
                    q[:, :, part],
                    k[:, :, part],
                    v[:, :, part],
                    cache,
                    counts=sub,
                    encoding=encoding,
                    score=score,
                    dropout_p=dropout_p,
                    backend=backend,
                )
            )
        return torch.cat(outs, dim=2)
    steps = torch.arange(t, device=q.device)
    positions = cache.lengths[:, None] + steps  # (B, t) absolute positions
    valid = steps < counts[:, None]
    if encoding is not None and encoding.kind == "rotate":
        q, k = encoding.rotate(q, k, positions[:, None], positions[:, None])
    # Written first when that overwrites nothing a query of this call reads: one token (the ring
    # has a slot for it), or a cache without a ring. A longer call into a ring attends the slots
    # and its own keys, and is written after.
    write_first = t == 1 or cache.plan.ring == 0
    if write_first:
        cache.write(k, v, positions, valid)
        keys, values, key_pos = cache.keys, cache.values, cache.slot_pos
        key_ok = key_pos >= 0
    else:
        keys, values = torch.cat((cache.keys, k), dim=2), torch.cat((cache.values, v), dim=2)
        key_pos = torch.cat((cache.slot_pos, positions), dim=1)
        key_ok = torch.cat((cache.slot_pos >= 0, valid), dim=1)
    pattern = cache.pattern
    if pattern.routed:  # chosen here from the cache's keys, slot j at position j (retention)
        pattern = pattern.bind(  # a cache with a ring has no block sums (key_block_sums)
            RouteInputs(q, keys, ~key_ok, causal=True, q_pos=positions,
                        block_sums=cache.key_block_sums)
        )  # fmt: skip
    mask = step_mask(pattern, positions, key_pos, key_ok, valid, q.shape[1])
    bias = encoding.bias if encoding is not None and encoding.kind == "bias" else None
    if isinstance(backend, FlexBackend):
        out = flex_decode(q, keys, values, pattern, positions, key_pos, key_ok, valid, mask,
                          bias, score.scale, backend)  # fmt: skip
    elif backend == "sdpa":
        out = _sdpa(q, keys, values, key_pos, positions, mask, bias, score.scale, dropout_p)
    else:
        out = _reference(q, keys, values, key_pos, positions, mask, bias, score, dropout_p)
    if not write_first:
        cache.write(k, v, positions, valid)
    cache.lengths += counts
    return out * valid[:, None, :, None]


def step_mask(
    pattern: Pattern, q_pos: Tensor, key_pos: Tensor, key_ok: Tensor, valid: Tensor, heads: int
) -> Tensor:
    """(B, 1, t, S) the pairs a call's queries at q_pos (B, t) may attend among keys at key_pos
    (B, S); (B, H, t, S) for a pattern chosen by content, whose pairs differ per head."""
    b = torch.arange(q_pos.shape[0], device=q_pos.device)[:, None, None, None]
    h = torch.arange(heads if pattern.routed else 1, device=q_pos.device)[None, :, None, None]
    allowed = pattern.allowed_at(b, h, q_pos[:, None, :, None], key_pos[:, None, None, :])
    return allowed & key_ok[:, None, None, :] & valid[:, None, :, None]


def _bias(bias, heads: int, q_pos: Tensor, key_pos: Tensor, device: torch.device) -> Tensor:
    """(B, H, t, S) positional score bias at absolute positions; key_pos (B, 1 or H, S)."""
    return bias(head_index(heads, device, 2)[None], q_pos[:, None, :, None], key_pos[:, :, None])


def _gather_allowed(
    mask: Tensor, keys: Tensor, values: Tensor, key_pos: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor] | None:
    """For one query per row: each row's allowed slots, in slot order, packed to the front and
    cut to the widest row's count; per head where the mask is (a pattern chosen by content).
    ``mask`` (B, L, S) with L = 1 or H query heads; keys and values (B, H_kv, S, D); key_pos
    (B, 1, S). Returns the packed mask (B, L, K), keys and values (B, H_kv, K, D) where L = 1,
    else (B, H, K, D) per query head, and key_pos (B, L, K); or None where the copies would be
    at least half of what the kernel reads in place (a per-head mask copies keys per query head,
    so it pays only where few are chosen).

    One pass over the mask (nonzero), the rest O(K): with a cumulative sum and a count over the
    slots instead, their int64 copies of the (B, H, S) mask dominated a MoBA step over a long
    cache (measured: eval/results/design-notes-cpu.md#decode-gather-allowed)."""
    B, L, S = mask.shape
    row, slot = mask.flatten(0, 1).nonzero(as_tuple=True)  # row-major: by row, then slot
    counts = torch.bincount(row, minlength=B * L)  # (B * L,)
    width = max(int(counts.max()), 1)
    kv_heads = keys.shape[1]
    if 2 * width * (kv_heads if L == 1 else L) >= S * kv_heads:
        return None
    starts = counts.cumsum(0) - counts
    index = torch.zeros(B * L, width, dtype=torch.long, device=mask.device)
    index[row, torch.arange(row.numel(), device=mask.device) - starts[row]] = slot
    index = index.view(B, L, width)
    packed = (torch.arange(width, device=mask.device) < counts[:, None]).view(B, L, width)
    if L == 1:
        by_kv_head = index.expand(B, kv_heads, width)
    else:  # query head h reads key/value head h // groups: its groups' rows side by side
        by_kv_head = index.unflatten(1, (kv_heads, -1)).flatten(2, 3)  # (B, H_kv, G * K)
    # Whole rows of D (``index_rows``): a gather along S with the index expanded over D, or
    # advanced indexing, copies element by element, far slower on CPU than whole rows
    # (measured: eval/results/design-notes-cpu.md#decode-whole-rows).

    def take(t: Tensor) -> Tensor:
        return index_rows(t, 2, by_kv_head).view(B, -1, width, t.shape[-1])

    return packed, take(keys), take(values), key_pos.expand(B, L, S).gather(2, index)


def _used_prefix(mask: Tensor, *tensors: Tensor) -> tuple[Tensor, ...]:
    """The slots up to the last one any query may read (views, no copy): a cache that fills
    its slots in order (full, causal) is read only as far as it is filled."""
    used = mask.flatten(0, -2).any(0)  # (S,)
    width = int(used.nonzero().max()) + 1 if bool(used.any()) else 1
    if width == mask.shape[-1]:
        return (mask, *tensors)
    return (
        mask[..., :width],
        *(t[..., :width] if t.dim() == 2 else t[:, :, :width] for t in tensors),
    )


def _sdpa(q, keys, values, key_pos, q_pos, mask, bias, scale, dropout_p) -> Tensor:
    gathered = None
    if q.shape[2] == 1:
        gathered = _gather_allowed(mask[:, :, 0], keys, values, key_pos[:, None])
    if gathered is not None:
        mask, keys, values, key_pos = gathered
        mask = mask[:, :, None]
    else:
        mask, keys, values, key_pos = _used_prefix(mask, keys, values, key_pos)
        key_pos = key_pos[:, None]  # (B, 1, S)
    groups = q.shape[1] // keys.shape[1]
    if bias is None and bool(mask.all()):  # every slot in use: no mask at all
        attn_mask = None
        has_key = None
    else:
        has_key = mask.any(-1, keepdim=True)  # (B, 1 or H, t, 1)
        attn_mask = mask | ~has_key  # SDPA gives NaN on a row of no keys
        if bias is not None:
            attn_mask = (
                _bias(bias, q.shape[1], q_pos, key_pos, q.device)
                .to(q.dtype)
                .masked_fill(~attn_mask, float("-inf"))
            )
    out = torch.nn.functional.scaled_dot_product_attention(
        q,
        keys,
        values,
        attn_mask=attn_mask,
        dropout_p=dropout_p,
        scale=scale,
        enable_gqa=groups > 1,
    )
    return out if has_key is None else out * has_key


def _reference(q, keys, values, key_pos, q_pos, mask, bias, score, dropout_p) -> Tensor:
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    groups = q.shape[1] // keys.shape[1]
    k, v = (repeat_kv(t.to(dtype), groups) for t in (keys, values))
    qs, k = score.prepare(q.to(dtype), k)
    scores = score.pairwise(qs, k)  # (B, H, t, S)
    if bias is not None:
        key_pos = key_pos[:, None]
        scores = scores + _bias(bias, q.shape[1], q_pos, key_pos, q.device).to(scores.dtype)
    weights = safe_softmax(scores.masked_fill(~mask, float("-inf")))
    if dropout_p:
        weights = torch.nn.functional.dropout(weights, dropout_p)
    return (weights @ v).to(q.dtype)
