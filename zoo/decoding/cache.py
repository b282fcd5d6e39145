"""``KVCache``: the keys and values a causal attention layer keeps between generation steps.

Made by ``MultiHeadAttention.new_cache(batch_size, max_len)`` (or ``zoo.new_cache`` for the
functional call) and passed as ``forward(x, cache=cache)``. Each call appends its tokens; the first
is the prefill, of any length, the later ones steps of one or more tokens. Every row of the batch
has its own length: a call's tokens are right-padded, and ``valid_lens`` (B,) says how many of them
each row adds (all, by default)::

    prefill, valid_lens=[3, 1]        step of one token          lengths
    row 0:  a b c                      row 0:  d                   3 -> 4
    row 1:  a . .   (. = padding)      row 1:  b                   1 -> 2

Row b's tokens sit at absolute positions lengths[b], lengths[b] + 1, ...: absolute encodings,
rotary angles and score biases use them, so prefill + steps give, at every real token, the output of
one causal forward over the row's whole sequence. Padding columns give zeros and are not kept.

Memory follows the pattern (``zoo.patterns.retention``): pinned slots for keys that every later
query may read (global tokens; every key of full, strided and random patterns, and of patterns
chosen by content), and a ring buffer of ``window + 1`` slots for the keys that fall out of reach,
so a sliding window of w keeps w + 1 keys at any length. ``nbytes`` counts the stores. Keys are
kept as the kernel sees them (rotated by rope); ``slot_pos`` (B, slots) holds each slot's
position, -1 where empty.

A refused call (wrong shape, dtype, device or variant, a step past ``max_len``, positions that do
not continue the row) raises before anything in the cache changes. (On a GPU, checks that read
values are device-side assertions, which fire after the call has queued its work.)

Setting ``lengths`` back rolls rows back (speculative decoding): their later tokens are forgotten,
and a ring that has overwritten keys the next query reads refuses (``new_cache(rollback=k)``
keeps k more ring slots). ``select_rows`` takes rows of the cache into others (beam search),
``clone`` forks it.

A *static* cache (``new_cache(..., static=True)``) gives every step the same shapes: it reads
all its slots, empty ones masked, and its host keeps no bound that changes from step to step (a
step past ``max_len`` is then asserted on the device, on a GPU or in a compiled step; its stores
are static addresses for torch.compile, written in place). A step compiled whole with
static shapes is one graph for every step, which CUDA graphs need
(``torch.compile(step, mode="reduce-overhead")``); an eager step reads more slots than it would
(a causal cache its max_len, not its length) in exchange.

A step reads no device value on the host (no ``.item()``, ``nonzero`` or boolean indexing: on a GPU
each is a synchronisation). What the host needs it keeps itself: ``longest``, an upper bound of the
rows' lengths that each call raises by its length (exact, with ``even``, while every call adds all
its tokens to every row), from which the slots in use and the keys a query may attend follow
(``zoo.decoding.bounds``). A write puts each new key in its slot: a step of rows of one length at
the slot the host finds from that bound and the pins it keeps (``host_slot``), by slice copies;
any other call at slots ``plan.slot`` computes on the device. The checks that read values (a step
past ``max_len``, ``positions``) read them where that costs no device synchronisation: tensors on
the CPU, or a step that the host bound cannot clear;
``positions`` on a GPU are checked by a device-side assertion (``torch._assert_async``).
"""

from __future__ import annotations

import copy
import dataclasses
from array import array
from bisect import bisect_left
from collections.abc import Callable

import torch
from torch import Tensor

from ..core.arguments import check_int, is_integer_dtype, typed
from ..core.autocast import autocast_on
from ..core.device_build import can_read_values, has_no_data, refuse_where
from ..core.shape_cache import per_shape
from ..layout.block_layout import with_heads
from ..patterns import Pattern
from ..patterns.retention import Retention, retention
from .block_sums import RunningBlockSums
from .bounds import host_bools, host_ints, latest_runs, query_bounds


def cache_signature(variant: object, params: dict, num_kv_heads: int) -> dict[str, object]:
    """What a cache is built for (a variant with its resolved parameters, and the key/value
    heads): a call for anything else is refused."""
    return {"variant": variant, "params": dict(params), "num_kv_heads": num_kv_heads}


def _hashable(signature: dict[str, object]) -> tuple | None:
    """A cache's signature as a key (``zoo.core.call_plans``' step plans: a call planned on one
    cache runs its plan only on a cache built for the same), its values typed (``typed``; a
    list's items too: registry defaults come as lists); None where a parameter is no key."""
    params = tuple(sorted((name, _typed(value)) for name, value in signature["params"].items()))
    key = (_typed(signature["variant"]), params, signature["num_kv_heads"])
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _typed(value: object) -> object:
    if isinstance(value, list):
        return tuple(_typed(item) for item in value), list
    return typed(value)


@per_shape(maxsize=64)
def cache_plan(pattern: Pattern, max_len: int) -> Retention:
    """The retention of a (specialised, causal) pattern, once per pattern and max_len."""
    return retention(pattern, max_len)


class KVCache:
    """Keys (B, H_kv, slots, D) and values (B, H_kv, slots, Dv) of one layer; see the module
    docstring. ``pattern`` is specialised to ``max_len`` on the cache's device, ``plan`` its
    retention (``cache_plan``, computed on the CPU; its pins also kept on the host), and
    ``host_pattern`` the pattern on the CPU, the same draw, for the host's bounds
    (``query_bounds``). ``signature`` names what the cache was built for (variant, parameters,
    heads), so that a call for anything else is refused."""

    def __init__(
        self,
        *,
        pattern: Pattern,
        plan: Retention,
        signature: dict[str, object],
        batch_size: int,
        num_kv_heads: int,
        head_dim: int,
        value_dim: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device,
        host_pattern: Pattern | None = None,
        static: bool = False,
    ) -> None:
        self.pattern, self.signature, self.max_len = pattern, dict(signature), max_len
        self.signature_key = _hashable(self.signature)
        self.static = static
        self.host_pattern = host_pattern
        self._pins = host_ints(plan.pinned)  # the pinned positions, increasing, on the host
        self.plan = dataclasses.replace(plan, pinned=plan.pinned.to(device))
        slots = self.plan.slots
        self.keys = torch.zeros(
            batch_size, num_kv_heads, slots, head_dim, dtype=dtype, device=device
        )
        self.values = torch.zeros(
            batch_size, num_kv_heads, slots, value_dim, dtype=dtype, device=device
        )
        self.slot_pos = torch.full((batch_size, slots), -1, dtype=torch.long, device=device)
        self._lengths = torch.zeros(batch_size, dtype=torch.long, device=device)
        # The host's knowledge: no row holds more than ``longest`` tokens, and while ``even``
        # every row holds exactly that many. None: lengths were set from outside (read again).
        self.longest: int | None = 0
        self.even = True
        self._mark_static(self.keys, self.values, self.slot_pos, self._lengths)
        self._block_sums: dict[int, RunningBlockSums] = {}  # by block size, made on first use
        self._bounds: dict[int, tuple[array, array] | None] = {}  # by query heads
        self._runs: bytes | None = None  # ``reads_first_slots``' table, made on first use
        self._static_most: dict[int, int | None] = {}  # by query heads (``static_most``)
        self._constants: dict[tuple, Tensor] = {}  # by what and shape (``_constant``)

    def _constant(self, key: tuple, make: Callable[[], Tensor]) -> Tensor:
        """A small tensor a step needs and that never changes for this cache (index ranges,
        counts of a whole call, all-true masks), made once on the cache's device: on a GPU each
        made per step was a kernel launch. Made anew while traced (the graph holds it) and on
        fake tensors (never kept: ``zoo.core.device_build``); made outside inference mode, so
        that a later step that records gradients may save it. Shared by every step: never
        modified."""
        if torch.compiler.is_compiling() or has_no_data(self._lengths):
            return make()
        found = self._constants.get(key)
        if found is None:
            with torch.inference_mode(False):
                found = make()
            if has_no_data(found):  # made under a fake tensor mode: for this call only
                return found
            self._constants[key] = found
        return found

    def steps(self, t: int) -> Tensor:
        """(t,) 0 .. t - 1: a call's token offsets (shared: never modify it)."""
        return self._constant(("steps", t), lambda: torch.arange(t, device=self._lengths.device))

    def whole_counts(self, t: int) -> Tensor:
        """(B,) t in every row: the counts of a call whose every row adds all t tokens (shared:
        never modify them)."""
        B, device = self.batch_size, self._lengths.device
        return self._constant(
            ("counts", B, t), lambda: torch.full((B,), t, dtype=torch.long, device=device)
        )

    def all_valid(self, t: int) -> Tensor:
        """(B, t) True: the valid tokens of a call whose every row adds all t (shared: never
        modify it)."""
        B, device = self.batch_size, self._lengths.device
        return self._constant(
            ("valid", B, t), lambda: torch.ones(B, t, dtype=torch.bool, device=device)
        )

    def _row_index(self) -> Tensor:
        """(B, 1) each row's index."""
        B, device = self.batch_size, self._lengths.device
        return self._constant(("rows", B), lambda: torch.arange(B, device=device)[:, None])

    def _mark_static(self, *stores: Tensor) -> None:
        """A static cache's stores as static addresses for torch.compile: a step writes them in
        place, and CUDA graphs (cudagraph trees) skip a graph whose ordinary inputs it mutates."""
        if self.static:
            for store in stores:
                torch._dynamo.mark_static_address(store)

    @property
    def lengths(self) -> Tensor:
        """(B,) the tokens each row holds (on the cache's device): a copy, so that what a caller
        keeps of it, or changes in place, is not the cache's own. Set them by assignment
        (``cache.lengths = t``, ``cache.lengths -= n``): the cache copies the values into its
        own tensor (a static cache's address stays) and reads the host's bound from them again.
        A row set back (a rollback, as speculative decoding makes when it rejects drafted
        tokens) forgets its later tokens; a cache with a ring refuses to go back further than it
        holds (``new_cache(rollback=)``). A row set forward reads slots that ``write`` filled
        (a benchmark filling a cache); it is the caller's to fill them."""
        return self._lengths.clone()

    @lengths.setter
    def lengths(self, value: Tensor) -> None:
        self._set_lengths(self._per_row("cache.lengths", value))

    def _set_lengths(self, value: Tensor, most: int | None = None) -> None:
        """A row set back forgets its later tokens: their slots read as empty and leave the
        block sums, so the next call sees the row as if they never came. ``most``: no row
        loses more than that many tokens (a rollback by an int), so the block sums take out
        those slots alone, not a pass over every key (a speculative round's rollback)."""
        self._check_rollback(value)
        forgotten = self.slot_pos >= value[:, None]  # (B, slots) positions past the new length
        # Block sums are kept only where slot j holds position j (no ring: ``key_block_sums``)
        if self._block_sums and most is not None:
            slots = value[:, None] + self.steps(most)  # (B, most) each row's last ones
            inside = slots < self.keys.shape[2]
            slots = slots.clamp(max=self.keys.shape[2] - 1)
            left = inside & forgotten.gather(1, slots)
            keys = self.keys[self._row_index(), :, slots]  # (B, most, H_kv, D)
            for sums in self._block_sums.values():
                sums.add(self._row_index(), slots, keys, left, sign=-1)
        else:
            for sums in self._block_sums.values():
                sums.remove(self.keys, forgotten)
        self.slot_pos.masked_fill_(forgotten, -1)
        self._lengths.copy_(value)
        self.longest = None

    def rollback(self, n: int | Tensor) -> KVCache:
        """Set each row back by ``n`` tokens (an int, or a (B,) tensor of counts per row), as
        ``cache.lengths -= n`` does, keeping the host's bound of the lengths: the next step reads
        no length on the host (a synchronisation on a GPU, which the assignment costs once).
        Speculative decoding's rounds call this."""
        longest, even = self.longest, self.even
        if isinstance(n, int) and not isinstance(n, bool):
            check_int("n", n, minimum=0)
            self._check_back(n)
            self._set_lengths(self._lengths - n, most=n)
            self.longest = None if longest is None else max(longest - n, 0)
            self.even = even
        else:
            n = self._per_row("rollback: n", n)
            refuse_where(n < 0, "rollback: n must hold counts >= 0", lambda _: f", {n.tolist()}")
            self._check_back(n)
            self.lengths = self._lengths - n
            self.longest, self.even = longest, False  # lengths lowered: still a bound
        return self

    def _check_back(self, n: int | Tensor) -> None:
        """Refuse a rollback of more tokens than a row holds, naming n and the row (read on the
        CPU, asserted on the device elsewhere, as every length check)."""
        held = self._lengths

        def which(bad: Tensor) -> str:  # the error's detail, read only when it is raised
            row = int(torch.argmax(bad.int()))
            shown = n if isinstance(n, int) else n.tolist()
            return f"; row {row} holds {int(held[row])} tokens, n={shown}"

        refuse_where(held - n < 0, "rollback: n must be at most the tokens each row holds", which)

    def _per_row(self, name: str, value: object) -> Tensor:
        """``value`` as a (B,) int64 tensor on the cache's device, or a ValueError naming it."""
        want, device = (self.batch_size,), self._lengths.device
        if (
            not isinstance(value, Tensor)
            or tuple(value.shape) != want
            or not is_integer_dtype(value.dtype)
            or value.device != device
        ):
            shown = (
                f"{tuple(value.shape)} {value.dtype} on {value.device}"
                if isinstance(value, Tensor)
                else repr(value)
            )
            raise ValueError(f"{name} must be a {want} int tensor on {device}, got {shown}")
        return value.long()

    def _check_rollback(self, value: Tensor) -> None:
        """Refuse lengths outside [0, max_len], or a row set back further than the cache still
        holds the keys its next query reads: positions value - window .. value - 1 (``Retention``),
        all still in their slots unless the ring has overwritten some. Values are read on the
        CPU, asserted on the device elsewhere (no synchronisation)."""
        outside = (value < 0) | (value > self.max_len)
        lost = torch.zeros_like(outside)
        held = self._lengths
        if self.plan.ring:
            needed = (value - self.plan.window).clamp(min=0)
            pos = self.slot_pos
            kept = ((pos >= needed[:, None]) & (pos < value[:, None])).sum(1)
            lost = (value < held) & (kept < value - needed)
        ring, window = self.plan.ring, self.plan.window
        messages = (
            f"cache.lengths must hold ints in [0, max_len={self.max_len}]",
            f"cache.lengths set back further than the cache holds: its ring of {ring} slots "
            f"has overwritten keys that a query {window} or fewer positions back reads, so a row "
            f"whose ring has filled rolls back at most {ring - window} tokens behind the newest "
            f"it wrote (rollbacks add up); build the cache with rollback=N to keep N more",
        )

        def which(bad: Tensor) -> str:
            row = int(torch.argmax(bad.int()))
            return f"; row {row} holds {int(held[row])} tokens, set to {int(value[row])}"

        for bad, message in zip((outside, lost), messages, strict=True):
            refuse_where(bad, message, which)

    def next_positions(self, t: int) -> Tensor:
        """(B, t) the absolute positions of a call's t new tokens in each row: the row's length
        onwards, a tensor of their own. One token's is the length itself, copied, not plus
        ``steps(1)``: in a step compiled whole, Inductor copies that sum into FlexAttention's
        mask, where the arange's one element, read at a constant index, becomes
        ``tl.full([XBLOCK], 0)``, a name the flex template lacks (the kernel failed to compile
        on an H200, torch 2.11; torch 2.13 fails an assertion on the same code)."""
        if t == 1:
            return self._lengths[:, None].clone()
        return self._lengths[:, None] + self.steps(t)

    def host_lengths(self) -> tuple[int, bool]:
        """(an upper bound of the rows' lengths, whether every row holds exactly that many),
        known on the host: kept by each call (``advance``); read from ``lengths`` once after
        they were set from outside (max_len and False where their values cannot be read); a
        static cache: max_len and False, always (its steps' shapes never change)."""
        if self.static:
            return self.max_len, False
        if self.longest is None:
            if not can_read_values(self._lengths):
                return self.max_len, False
            self.longest = int(self._lengths.max()) if self._lengths.numel() else 0
            self.even = bool((self._lengths == self.longest).all())
        return self.longest, self.even

    def advance(self, counts: Tensor, t: int, full: bool) -> None:
        """The rows have taken ``counts`` (B,) new tokens of a call of ``t``; ``full``: every
        row took all t (then the host's bound stays exact)."""
        self._lengths += counts
        if self.static:
            return
        longest, even = self.host_lengths()
        self.longest, self.even = min(longest + t, self.max_len), even and full

    def slots_used(self, length: int) -> int:
        """How many of the first slots positions 0 .. length - 1 may occupy (pinned slots first,
        then the ring): a width known on the host."""
        # pinned positions before ``length``: positions 0 .. P - 1 (full, causal) need no search
        pinned = (
            min(length, len(self._pins)) if self.plan.prefix else bisect_left(self._pins, length)
        )
        if self.plan.ring and length > pinned:  # some position went to the ring
            return len(self._pins) + min(self.plan.ring, length)
        return pinned

    def static_most(self, heads: int, width: int) -> int | None:
        """A static cache's bound of the keys one query of ``heads`` may attend (at max_len,
        at most ``width``), kept as an int: a traced step reads no host table. Found on an
        eager step; a step traced before any (None) attends the slots with a mask alone."""
        if heads not in self._static_most:
            if torch.compiler.is_compiling():
                return None
            bounds = self.query_bounds(heads)
            most = None if bounds is None else min(int(bounds[0][self.max_len - 1]), width)
            self._static_most[heads] = most
        return self._static_most[heads]

    def query_bounds(self, heads: int) -> tuple[array, array] | None:
        """For a fixed pattern with ``heads`` query heads: (most, least) on the host, entry n
        the most keys a query at a position up to n may attend and the fewest a query at n
        attends (over the heads; ``zoo.decoding.bounds.query_bounds``), computed on first use;
        None without the host's pattern or for a pattern chosen by content."""
        if heads not in self._bounds:
            host = self.host_pattern
            if host is None or host.routed:
                self._bounds[heads] = None
            else:
                host = with_heads(host, heads) if host.per_head else host
                most, least = query_bounds(host, self.max_len)
                self._bounds[heads] = host_ints(most), host_ints(least)
        return self._bounds[heads]

    def reads_first_slots(self, position: int, count: int) -> bool:
        """Whether a query at ``position`` (every row's) attends exactly the cache's first
        ``count`` slots: a cache of a ring only, whose slot 0 holds the first of the query's
        ``count`` latest positions, for a pattern whose query there attends exactly those
        (``zoo.decoding.bounds.latest_runs``, computed on first use). A block-local query at a
        block's start onwards, say: its step then reads those slots without a mask."""
        ring = self.plan.ring
        if self._pins or not ring or count > ring or (position - count + 1) % ring:
            return False
        if self._runs is None:
            host = self.host_pattern
            usable = host is not None and not host.routed and not host.per_head
            self._runs = host_bools(latest_runs(host, self.max_len)) if usable else b""
        return position < len(self._runs) and bool(self._runs[position])

    @property
    def batch_size(self) -> int:
        return self.keys.shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes held by the cache's tensors (keys, values, slot positions, lengths, pins, and
        the block sums of ``key_block_sums``)."""
        tensors = [self.keys, self.values, self.slot_pos, self._lengths, self.plan.pinned]
        for sums in self._block_sums.values():
            tensors += [sums.sums, sums.counts]
        return sum(t.numel() * t.element_size() for t in tensors)

    def key_block_sums(self, block: int) -> tuple[Tensor, Tensor] | None:
        """The float32 sums (B, H_kv, blocks, D) of the kept keys in each block of ``block``
        slots and (B, blocks) their counts (``zoo.decoding.block_sums``), kept from step to step so
        that a pattern scoring blocks by their mean key does not read every key at every step; None
        for a cache with a ring, whose slots do not stay at one position."""
        if self.plan.ring:
            return None
        if block not in self._block_sums:  # then kept up to date by each write
            with torch.inference_mode(False):  # a later step recording gradients updates them
                made = RunningBlockSums(self.keys, self.slot_pos, block)
            self._block_sums[block] = made
            self._mark_static(made.sums, made.counts)
        sums = self._block_sums[block]
        return sums.sums, sums.counts

    def clone(self) -> KVCache:
        """A cache with the same contents and stores of its own: a prompt's cache forked for
        several continuations, each then written on its own."""
        twin = copy.copy(self)
        twin.keys, twin.values = self.keys.clone(), self.values.clone()
        twin.slot_pos, twin._lengths = self.slot_pos.clone(), self._lengths.clone()
        twin._block_sums = {block: sums.clone() for block, sums in self._block_sums.items()}
        twin._bounds, twin._static_most = dict(self._bounds), dict(self._static_most)
        stores = [t for sums in twin._block_sums.values() for t in (sums.sums, sums.counts)]
        twin._mark_static(twin.keys, twin.values, twin.slot_pos, twin._lengths, *stores)
        return twin

    def select_rows(self, index: Tensor) -> KVCache:
        """Row i takes what row ``index[i]`` holds (keys, values, positions, length, block sums),
        as beam search keeps its best beams: ``index`` (B,) ints in [0, B) on the cache's device,
        rows may repeat. In place where no gradient is recorded (a static cache keeps its
        addresses); the host's bound of the lengths holds for the rows taken."""
        B = self.batch_size
        index = self._per_row("select_rows: index", index)
        refuse_where((index < 0) | (index >= B), f"select_rows: index must hold rows in [0, {B})",
                     lambda _: f", got {index.tolist()}")  # fmt: skip
        graph = torch.is_grad_enabled() and (self.keys.requires_grad or self.values.requires_grad)
        if graph:  # autograd keeps the stores it recorded: new ones
            self.keys, self.values = self.keys[index], self.values[index]
        stores = [self.slot_pos, self._lengths]
        stores += [t for sums in self._block_sums.values() for t in (sums.sums, sums.counts)]
        stores += [] if graph else [self.keys, self.values]
        with torch.no_grad():
            for store in stores:
                store.copy_(store[index])
        return self

    def reset(self) -> KVCache:
        """Forget every token (lengths back to 0), keeping the memory for the next sequences."""
        self.slot_pos.fill_(-1)
        self._lengths.zero_()
        self.longest, self.even = 0, True
        self._block_sums.clear()
        self.keys, self.values = self.keys.detach(), self.values.detach()  # no graph of old steps
        self._mark_static(self.keys, self.values)
        return self

    def __repr__(self) -> str:
        b, h, s, d = self.keys.shape
        return (
            f"KVCache({self.signature.get('variant')!r}, batch={b}, kv_heads={h}, head_dim={d}, "
            f"slots={s} (pinned={self.plan.pinned.numel()}, ring={self.plan.ring}), "
            f"max_len={self.max_len}, lengths={self._lengths.tolist()}, nbytes={self.nbytes})"
        )

    def check_signature(self, signature: dict[str, object]) -> None:
        """Refuse a call whose variant, parameters or heads differ from the cache's."""
        for key, expected in self.signature.items():
            got = signature.get(key)
            if got != expected:
                raise ValueError(
                    f"cache was built for {key}={expected!r}, but this call has {key}={got!r}; "
                    f"make a cache for this layer (new_cache) or pass the one built for it"
                )

    def check_step(self, k: Tensor, v: Tensor, counts: Tensor, positions: Tensor | None) -> None:
        """Refuse new keys k (B, H_kv, t, D), v that do not fit, before anything changes. Values
        are read only where that waits for no device (see the module docstring)."""
        for name, t, want in (("k", k, self.keys), ("v", v, self.values)):
            expected = (*want.shape[:2], "t", want.shape[3])
            if t.dim() != 4 or t.shape[:2] != want.shape[:2] or t.shape[3] != want.shape[3]:
                raise ValueError(
                    f"cache holds {name} of shape (batch, kv_heads, t, head_dim) = {expected}, "
                    f"got {tuple(t.shape)}"
                )
            if t.dtype != want.dtype or t.device != want.device:
                hint = (
                    f" (under torch.autocast the keys come in {t.dtype}: "
                    f"new_cache(..., dtype={t.dtype}))"
                    if autocast_on(t.device) and t.dtype != want.dtype
                    else ""
                )
                raise ValueError(
                    f"cache holds {want.dtype} on {want.device}, got {name} in {t.dtype} on "
                    f"{t.device}; build the cache with the model's dtype and device{hint}"
                )
        steps = k.shape[2]
        if positions is not None:
            want_shape = (self.batch_size, steps)
            if not isinstance(positions, Tensor) or not is_integer_dtype(positions.dtype):
                shown = positions.dtype if isinstance(positions, Tensor) else type(positions)
                raise TypeError(
                    f"positions must be an integer tensor of shape (batch, t) = {want_shape}, "
                    f"the absolute positions of the call's tokens, got {shown}"
                )
            if tuple(positions.shape) != want_shape:
                raise ValueError(
                    f"positions must have shape (batch, t) = {want_shape}, got "
                    f"{tuple(positions.shape)}"
                )
        readable = can_read_values(counts)
        if not readable and not self.static:  # fake tensors (torch.export): shapes checked only
            return
        # values read where that waits for no device (not in a traced graph either)
        on_host = readable and self._lengths.device.type == "cpu"
        longest, _ = self.host_lengths()
        if not on_host and self.static:  # no host bound: asserted on the device, compiled too
            torch._assert_async(
                (self._lengths + counts <= self.max_len).all(),
                f"step too long: past the cache's max_len={self.max_len} (zoo KVCache)",
            )
        elif longest + steps > self.max_len and bool(  # the host's bound holds: nothing to read
            ((after := self._lengths + counts) > self.max_len).any()
        ):
            row = int(torch.argmax((after > self.max_len).int()))
            raise ValueError(
                f"step too long: row {row} holds {int(self._lengths[row])} tokens and adds "
                f"{int(counts[row])}, past the cache's max_len={self.max_len}; build the cache "
                f"with a larger max_len"
            )
        if positions is None:
            return
        expected = self.next_positions(steps)
        valid = torch.arange(steps, device=k.device) < counts[:, None]
        wrong = (positions.to(expected.device) != expected) & valid
        if not on_host:  # checked on the device, without a synchronisation
            torch._assert_async(~wrong.any(), "positions out of order (zoo KVCache.check_step)")
            return
        if bool(wrong.any()):
            row = int(torch.argmax(wrong.any(1).int()))
            raise ValueError(
                f"positions out of order: row {row} holds {int(self._lengths[row])} tokens, so "
                f"its next positions are {expected[row, : int(counts[row])].tolist()}, got "
                f"{positions[row, : int(counts[row])].tolist()}"
            )

    def write(
        self, k: Tensor, v: Tensor, positions: Tensor, valid: Tensor, every_kept: bool = False,
        position: int | None = None,
    ) -> None:  # fmt: skip
        """Store the valid new keys k, v (B, H_kv, t, D) at their positions (B, t), as far as the
        plan keeps them: a ring slot takes the last of the positions that map to it. In place,
        or into new tensors when autograd needs the earlier ones. ``every_kept``: the host knows
        that every token is valid and has a slot (``Retention.keeps_below``), so a step's tokens
        are written as they are, without reading what their slots held.

        Without a host synchronisation: every token (b, j) of the call writes its slot (slot 0
        where the plan keeps it nowhere) with the value that slot ends with, the call's last
        token kept there or the slot's old key, so tokens sharing a slot write the same value. A
        token of one step writes its own slot; a longer call finds each slot's last token with a
        scatter of token indices (O(B * slots) small ints).

        ``position``: the host knows that every row's one token (a step) sits there, so its slot
        is found on the host and written by slice copies, with no index tensor (eagerly, and
        where no gradient is recorded: the indexed writes were the largest part of a step's own
        host time on a CPU, and on a GPU each index tensor is a kernel launch)."""
        B, t = positions.shape
        tracked = (
            k.requires_grad
            or v.requires_grad
            or self.keys.requires_grad
            or self.values.requires_grad
        )
        grad = torch.is_grad_enabled() and tracked
        if position is not None and not grad and not torch.compiler.is_compiling():
            self._write_at(k[:, :, 0], v[:, :, 0], position)
            return
        slots = self.plan.slots
        # (B, t), -1: not kept; a kept position of a prefix is its own slot
        keeps_itself = every_kept and self.plan.kept_at_position
        slot = positions if keeps_itself else self.plan.slot(positions)
        kept, target = (valid, slot) if every_kept else (valid & (slot >= 0), slot.clamp(min=0))
        rows = self._row_index().expand(B, t)
        canonical = None
        if t == 1:  # a step: each row's one token, kept or not, ends its slot (no other shares it)
            new = None if every_kept else kept  # None: every token is new to its slot
            pick, ending = None, (k.transpose(1, 2), v.transpose(1, 2))
        else:  # the call's last kept token in each slot (positions increase with the token)
            token = torch.arange(t, device=positions.device).expand(B, t)
            last = torch.full((B, slots + 1), -1, dtype=torch.long, device=positions.device)
            last.scatter_reduce_(1, torch.where(kept, slot, slots), torch.where(kept, token, -1),
                                 "amax")  # fmt: skip
            winner = last[:, :slots].gather(1, target)  # (B, t): -1 where the slot keeps its key
            new, pick = winner >= 0, winner.clamp(min=0)
            ending = (k.transpose(1, 2)[rows, pick], v.transpose(1, 2)[rows, pick])
            if grad:  # one token per slot carries the gradient (the others write copies)
                first = torch.full((B, slots), -1, dtype=torch.long, device=positions.device)
                canonical = first.scatter_reduce_(1, target, token, "amax").gather(1, target)
                canonical = canonical == token

        def ends_with(store: Tensor, x: Tensor) -> Tensor:  # (B, t, H_kv, D): each slot's end
            if new is None:
                return x
            end = torch.where(new[:, :, None, None], x, store[rows, :, target])
            if canonical is not None:
                end = torch.where(canonical[:, :, None, None], end, end.detach())
            return end

        end_k, end_v = ends_with(self.keys, ending[0]), ends_with(self.values, ending[1])
        for sums in self._block_sums.values():  # a cache without a ring: each slot written once
            sums.add(rows, target, end_k, kept)
        if grad:
            self.keys = _put(self.keys, rows, target, end_k)
            self.values = _put(self.values, rows, target, end_v)
        else:
            self.keys[rows, :, target] = end_k
            self.values[rows, :, target] = end_v
        written = positions if pick is None else positions.gather(1, pick)
        if new is not None:
            written = torch.where(new, written, self.slot_pos[rows, target])
        self.slot_pos[rows, target] = written

    def _write_at(self, k: Tensor, v: Tensor, position: int) -> None:
        """k, v (B, H_kv, D): every row's key and value at ``position``, into its slot if the
        plan keeps it (``write``)."""
        slot = self.host_slot(position)
        if slot < 0:
            return
        self.keys[:, :, slot] = k
        self.values[:, :, slot] = v
        self.slot_pos[:, slot].fill_(position)
        for sums in self._block_sums.values():
            sums.add_at(slot, k)

    def host_slot(self, position: int) -> int:
        """``Retention.slot`` of one position known on the host (-1: not kept), from the pins
        the cache holds on the host."""
        index = bisect_left(self._pins, position)
        if index < len(self._pins) and self._pins[index] == position:
            return index
        return len(self._pins) + position % self.plan.ring if self.plan.ring else -1


def _put(store: Tensor, rows: Tensor, slots: Tensor, new: Tensor) -> Tensor:
    """``store`` with new[...] at (rows[...], :, slots[...]), out of place (autograd keeps the
    old)."""
    out = store.clone()
    out[rows, :, slots] = new
    return out
