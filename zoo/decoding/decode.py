"""Attention of new tokens against a ``KVCache``: the decoding path of ``zoo.attention``.

A call's queries sit at their rows' absolute positions (``zoo.decoding.cache``). Keys are the
cache's slots, plus the call's own keys: one token is written first and attends the slots alone; a
longer call (a prefill) attends the slots and its own keys, then is written, in chunks of at most
``CHUNK`` queries so that the score matrix stays small. The mask is the pattern's ``allowed`` on the
absolute positions of queries and slots, so a cache that holds only a window, or a window and pinned
global tokens, gives the pattern's output exactly.

This module makes each step (positions, the cache's slots, the mask: a ``DecodeStep``) and hands
it to a backend that declares decoding (``Capabilities.decode``, ``Backend.decode_step``;
``decode_backend`` picks it). A step of one token per row reads no device value on the host (no
``.item()``, ``nonzero``, boolean indexing: each a synchronisation on a GPU, and an error on fake
tensors): its widths are Python ints the cache keeps (``KVCache.host_lengths``) and tables computed
once per pattern and length on the CPU (``zoo.decoding.bounds``). The step carries them
(``DecodeStep.slots_in_use``, ``most_allowed``, ``every_allowed``): the slots the rows' tokens
may occupy (a cache that fills its slots in order, full or causal, is read only as far as it is
filled), the most keys a query may attend, and whether it attends every slot in use.

- ``sdpa`` (``zoo.backends.sdpa.sdpa_decode``): ``scaled_dot_product_attention`` over the slots.
  With one query per row and fewer than half of the slots allowed (a BigBird or strided pattern,
  whose cache keeps keys that this query does not read), the allowed keys are gathered first, so the
  kernel sees only them; for a pattern chosen by content (MoBA), each query head's own chosen keys,
  where those copies are fewer than half of what the kernel would read in place. A window cache, all
  of it allowed, goes in as it is, and a step whose query attends every slot in use (full or causal
  attention, a full window) runs without a mask, as does a block-local step over its block's
  slots, which the ring holds first (``KVCache.reads_first_slots``). MoBA scores its blocks from
  sums the cache keeps (``KVCache.key_block_sums``), so a step reads the chosen keys and one mean
  per block, not every key.
- ``flex``: FlexAttention with a block mask over the step's query rows and the cache's slots, its
  mask_mod reading the slots' absolute positions (``zoo.backends.flex_decode``). Named by
  ``backend="flex"`` or a ``FlexBackend`` (its block size and ``compile`` apply; ``compile=False``
  runs flex's eager path, for tests on CPU). Dot scores, no dropout.
- ``reference`` (``zoo.backends.reference.reference_decode``): dense float32 scores and an
  explicit softmax; additive scores, and the oracle.

``auto`` takes sdpa. For one query the work is reading the kept keys, which the gather does
without a compiled kernel; on CPU compiled flex pads the query row to a whole block and compiles
for seconds per shape. A static cache's step reads every slot, masked, and CUDA's memory-efficient
kernel (SDPA's one kernel that takes a mask) gives each row and key/value head one thread block
over all of them (on an H200 a compiled causal step was slower than the eager step over the
filled slots: eval/results/gpu-campaign-h200-2026-11-28-c): so sdpa splits many masked slots
into runs side by side, merged by log-sum-exp (``zoo.backends.split_keys``, not yet timed on a
GPU). Flex's decoding kernel splits the keys too, and skips empty blocks. auto does not take
flex for it: on an H200 with torch 2.11 a step compiled whole on flex failed in Inductor's code
for the mask (``XBLOCK is not defined``), for causal, sliding-window and Longformer caches
alike.
Its cause (``KVCache.next_positions``) is removed, checked by lowering the step for a stand-in
sm90 device on a CPU; until a GPU run shows the compiled steps right and faster, flex there is a
backend one names, not a default (and Inductor runs its decoding kernel only for a power of two
of query heads per key/value head, with one block mask where they share one; else its main
kernel, which does not split the keys either). Elsewhere on CUDA flex would be the choice where
the decode benchmark (``eval/configs/bench_decode.yaml``, impl ``zoo:VARIANT:flex`` beside the
sdpa gather) measures it faster: long caches whose allowed keys are sparse in whole blocks
(strided, bigbird, moba). That measurement has not run yet, so auto stays on sdpa there; the
blocked and xformers backends have no decoding path (a cached call named for them runs on auto's
choice, and ``explain`` says so).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..backends import Backend, backend_named, get_backend, list_backends
from ..backends.base import DecodeStep
from ..core.device_build import can_read_values, refuse_where
from ..core.scores import AdditiveScore, DotProduct
from ..layout.block_layout import with_heads
from ..patterns import Pattern, RouteInputs
from ..positional import PositionalEncoding
from .bounds import routed_most
from .cache import KVCache

CHUNK = 256  # queries per chunk of a long call


def decode_backend(
    backend: object,
    score: DotProduct | AdditiveScore,
    dropout_p: float,
    cache: KVCache,
    backward_on: str | None = None,
) -> Backend:
    """The backend that runs a cached call's steps (``Backend.decode_step``): the one named, where
    it declares decoding (``Capabilities.decode``); under ``auto`` or a backend without a decoding
    path (``explain`` says so) the reference for additive scores, else sdpa (see above for flex).
    A backend that decodes but not these settings (``backward_on``: the device type where the
    call records gradients, ``recording_device``) raises, naming the reason and the backends that
    can: before the call writes anything into the cache."""
    chosen = backend_named(backend)
    settings = (score.kind, dropout_p, cache.keys.dtype, backward_on)
    if chosen is not None and chosen.capabilities.decode:
        reason = chosen.decode_reason_against(*settings)
        if reason is not None:
            able = [n for n in decoders() if get_backend(n).decode_reason_against(
                *settings) is None]  # fmt: skip
            raise ValueError(
                f"backend {chosen.name!r} cannot decode this call: {reason}; backends that can: "
                f"{', '.join(able) or 'none'}"
            )
        return chosen
    if score.kind != "dot":
        return get_backend("reference")
    return get_backend("sdpa")


def recording_device(cache: KVCache, *tensors: Tensor) -> str | None:
    """The device type where a cached call records gradients (autograd on, and a tensor of the
    call or the cache's stores requires them), or None."""
    tracked = (*tensors, cache.keys, cache.values)
    if torch.is_grad_enabled() and any(t.requires_grad for t in tracked):
        return cache.keys.device.type
    return None


def decoders() -> list[str]:
    """The registered backends that declare a decoding path."""
    return [n for n in list_backends() if get_backend(n).capabilities.decode]


def explain_decode(
    backend: object,
    score: DotProduct | AdditiveScore,
    cache: KVCache,
    dropout_p: float = 0.0,
    backward_on: str | None = None,
) -> str:
    """What ``explain`` says for a call with a cache (``backward_on``: ``recording_device``)."""
    try:
        chosen = decode_backend(backend, score, dropout_p, cache, backward_on)
    except ValueError as refused:  # what the call would raise, said
        return str(refused)
    shown = f"flex ({chosen!r})" if chosen.name == "flex" else chosen.name
    plan = cache.plan
    asked = backend if isinstance(backend, str) else getattr(backend, "name", "?")
    note = (
        ""
        if asked in (*decoders(), "auto") or chosen is backend
        else f" (backend {asked!r} has no decoding path; a cached call runs on {chosen.name})"
    )
    return (
        f"decoding with a cache on {shown}{note}: {plan.slots} slots "
        f"({plan.pinned.numel()} pinned, a ring of {plan.ring} for a window of {plan.window}) "
        f"of max_len={cache.max_len}; one query attends the slots its pattern allows"
        + (", gathered when fewer than half of them" if chosen.name == "sdpa" else "")
        + (
            ", many masked slots on CUDA in runs side by side merged by log-sum-exp"
            if chosen.name == "sdpa" and chosen.split_keys
            else ""
        )
        + (", a block mask on their absolute positions" if chosen.name == "flex" else "")
        + (", blocks chosen by content from every kept key" if cache.pattern.routed else "")
    )


def counts_from_padding(
    key_padding_mask: Tensor | None, batch: int, length: int, device: torch.device | None = None
) -> Tensor:
    """(B,) real tokens per row from a (B, t) right-padding mask of a call's new tokens, on the
    mask's device (or ``device`` without one: made there, no copy). Whether the mask is right
    padding is read from its values on the CPU, asserted on the device elsewhere (no
    synchronisation); a mask of one column always is."""
    if key_padding_mask is None:
        return torch.full((batch,), length, dtype=torch.long, device=device)
    mask = key_padding_mask
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool or mask.shape != (batch, length):
        shown = type(mask).__name__
        if isinstance(mask, Tensor):
            shown = f"a {tuple(mask.shape)} {str(mask.dtype).removeprefix('torch.')} tensor"
        raise ValueError(
            f"with a cache, key_padding_mask must be a ({batch}, {length}) bool tensor over the "
            f"call's new tokens, got {shown}"
        )
    counts = (~mask).sum(1)
    if length == 1:
        return counts
    right = torch.arange(length, device=mask.device) >= counts[:, None]
    message = (
        "with a cache, key_padding_mask must be right padding (each row: real tokens, then "
        "padding), since a row's tokens take consecutive positions"
    )
    refuse_where(mask != right, message)
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
    backend: Backend,
    full: bool | None = None,
) -> Tensor:
    """q (B, H, t, D), k and v (B, H_kv, t, D) of the new tokens, ``counts`` (B,) of them real in
    each row -> output (B, H, t, Dv), zeros at padding columns; the cache takes the new keys.
    ``full``: the host knows that every row adds all t tokens (no valid_lens, no padding); None
    reads it from ``counts`` where that waits for no device (on the CPU), else takes it as not
    known (the rows' lengths are then bounded, not known, on the host)."""
    t = q.shape[2]
    if full is None:
        full = can_read_values(counts) and counts.device.type == "cpu" and bool((counts == t).all())
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
                    full=full,
                )
            )
        return torch.cat(outs, dim=2)
    pattern = cache.pattern
    if pattern.per_head:  # drawn for this call's query heads (refused if the cache's differ)
        pattern = with_heads(pattern, q.shape[1])
    if cache.static:  # its steps' bound, found here on an eager call (a prefill) for them
        cache.static_most(q.shape[1], cache.plan.slots)
    longest, even = cache.host_lengths()  # before this call: the host's bound of the rows
    after = min(longest + t, cache.max_len)
    positions = cache.next_positions(t)  # (B, t) absolute positions
    valid = cache.all_valid(t) if full else cache.steps(t) < counts[:, None]
    padding = None if full else ~valid[:, None, :, None]
    if padding is not None:  # padding may hold anything (NaN, inf): never read, never kept,
        # and no NaN query row reaches the real keys' gradients
        q, k, v = (x.masked_fill(padding, 0) for x in (q, k, v))
    if encoding is not None and encoding.kind == "rotate":
        q, k = encoding.rotate(q, k, positions[:, None], positions[:, None])
    # Written first when that overwrites nothing a query of this call reads: one token (the ring
    # has a slot for it), or a cache without a ring. A longer call into a ring attends the slots
    # and its own keys, and is written after.
    write_first = t == 1 or cache.plan.ring == 0
    every_kept = full and cache.plan.keeps_below(after)  # known here: no token to leave out
    # every row's one token at a position the host knows: written at a slot found on the host
    position = longest if t == 1 and even and full else None
    if write_first:
        cache.write(k, v, positions, valid, every_kept, position)
        keys, values, key_pos = cache.keys, cache.values, cache.slot_pos
        key_ok = None  # those holding a position (``DecodeStep.key_ok``, made where read)
        width = cache.plan.slots if cache.static else cache.slots_used(after)
    else:
        keys, values = torch.cat((cache.keys, k), dim=2), torch.cat((cache.values, v), dim=2)
        key_pos = torch.cat((cache.slot_pos, positions), dim=1)
        key_ok = torch.cat((cache.slot_pos >= 0, valid), dim=1)
        width = None  # the call's own keys come after the slots
    most, every = None, False
    if t == 1:  # what the host knows of this step's one query per row
        most, every, width = _host_bounds(cache, pattern, q.shape[1], after, width, even and full)
    if pattern.routed:  # chosen here from the cache's keys, slot j at position j (retention)
        pattern = pattern.bind(  # a cache with a ring has no block sums (key_block_sums)
            RouteInputs(q, keys, key_pos < 0 if key_ok is None else ~key_ok, causal=True,
                        q_pos=positions, block_sums=cache.key_block_sums)
        )  # fmt: skip
    bias = encoding.bias if encoding is not None and encoding.kind == "bias" else None
    step = DecodeStep(
        q, keys, values, pattern, positions, key_pos, key_ok, valid, bias, score, dropout_p,
        slots_in_use=width, most_allowed=most, every_allowed=every,
    )  # fmt: skip
    out = backend.decode_step(step)
    if not write_first:
        cache.write(k, v, positions, valid, every_kept)
    cache.advance(counts, t, full)
    return out if padding is None else out.masked_fill(padding, 0)


def _host_bounds(
    cache: KVCache, pattern: Pattern, heads: int, after: int, width: int, even: bool
) -> tuple[int | None, bool, int]:
    """(the most keys a query of a one-token step may attend, whether each attends every slot in
    use, the slots in use), for rows of at most ``after`` tokens once the step is written, in the
    first ``width`` slots; ``even``: every row holds exactly ``after`` (its query at position
    after - 1). Where the query attends exactly the cache's first slots (a block-local ring at a
    block's start: ``KVCache.reads_first_slots``), those are the slots in use, every one
    attended."""
    if pattern.routed:
        most = routed_most(cache.pattern, after - 1 if even else None)
        return (None if most is None else min(most, width)), False, width
    if cache.static:  # one bound for every step (its shapes never change)
        return cache.static_most(heads, width), False, width
    bounds = cache.query_bounds(heads)
    if bounds is None or after == 0:
        return None, False, width
    most, least = bounds
    count = least[after - 1]
    if even and 0 < count < width and cache.reads_first_slots(after - 1, count):
        return count, True, count
    every = even and count == width  # that many allowed keys fill the slots
    return min(most[after - 1], width), every, width
