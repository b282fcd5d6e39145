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
not continue the row) raises before anything in the cache changes.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from ..core.device_build import can_read_values
from ..core.shape_cache import per_shape
from ..patterns import Pattern
from ..patterns.retention import Retention, retention
from .block_sums import RunningBlockSums


def cache_signature(variant: object, params: dict, num_kv_heads: int) -> dict[str, object]:
    """What a cache is built for (a variant with its resolved parameters, and the key/value
    heads): a call for anything else is refused."""
    return {"variant": variant, "params": dict(params), "num_kv_heads": num_kv_heads}


@per_shape(maxsize=64)
def cache_plan(pattern: Pattern, max_len: int) -> Retention:
    """The retention of a (specialised, causal) pattern, once per pattern and max_len."""
    return retention(pattern, max_len)


class KVCache:
    """Keys (B, H_kv, slots, D) and values (B, H_kv, slots, Dv) of one layer; see the module
    docstring. ``pattern`` is specialised to ``max_len`` on the cache's device, ``plan`` its
    retention (``cache_plan``, computed on the CPU). ``signature`` names what the cache was
    built for (variant, parameters, heads), so that a call for something else is refused."""

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
    ) -> None:
        self.pattern, self.signature, self.max_len = pattern, dict(signature), max_len
        self.plan = dataclasses.replace(plan, pinned=plan.pinned.to(device))
        slots = self.plan.slots
        self.keys = torch.zeros(
            batch_size, num_kv_heads, slots, head_dim, dtype=dtype, device=device
        )
        self.values = torch.zeros(
            batch_size, num_kv_heads, slots, value_dim, dtype=dtype, device=device
        )
        self.slot_pos = torch.full((batch_size, slots), -1, dtype=torch.long, device=device)
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)
        self._block_sums: dict[int, RunningBlockSums] = {}  # by block size, made on first use

    @property
    def batch_size(self) -> int:
        return self.keys.shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes held by the cache's tensors (keys, values, slot positions, lengths, pins, and
        the block sums of ``key_block_sums``)."""
        tensors = [self.keys, self.values, self.slot_pos, self.lengths, self.plan.pinned]
        for sums in self._block_sums.values():
            tensors += [sums.sums, sums.counts, sums.summed]
        return sum(t.numel() * t.element_size() for t in tensors)

    def key_block_sums(self, block: int) -> tuple[Tensor, Tensor] | None:
        """The float32 sums (B, H_kv, blocks, D) of the kept keys in each block of ``block``
        slots and (B, blocks) their counts (``zoo.decoding.block_sums``), kept from step to step so
        that a pattern scoring blocks by their mean key does not read every key at every step; None
        for a cache with a ring, whose slots do not stay at one position."""
        if self.plan.ring:
            return None
        if block not in self._block_sums:
            self._block_sums[block] = RunningBlockSums(self.keys, block)
        return self._block_sums[block].update(self.keys, self.slot_pos)

    def reset(self) -> KVCache:
        """Forget every token (lengths back to 0), keeping the memory for the next sequences."""
        self.slot_pos.fill_(-1)
        self.lengths.zero_()
        self._block_sums.clear()
        self.keys, self.values = self.keys.detach(), self.values.detach()  # no graph of old steps
        return self

    def __repr__(self) -> str:
        b, h, s, d = self.keys.shape
        return (
            f"KVCache({self.signature.get('variant')!r}, batch={b}, kv_heads={h}, head_dim={d}, "
            f"slots={s} (pinned={self.plan.pinned.numel()}, ring={self.plan.ring}), "
            f"max_len={self.max_len}, lengths={self.lengths.tolist()}, nbytes={self.nbytes})"
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
        """Refuse new keys k (B, H_kv, t, D), v that do not fit, before anything changes."""
        for name, t, want in (("k", k, self.keys), ("v", v, self.values)):
            expected = (*want.shape[:2], "t", want.shape[3])
            if t.dim() != 4 or t.shape[:2] != want.shape[:2] or t.shape[3] != want.shape[3]:
                raise ValueError(
                    f"cache holds {name} of shape (batch, kv_heads, t, head_dim) = {expected}, "
                    f"got {tuple(t.shape)}"
                )
            if t.dtype != want.dtype or t.device != want.device:
                raise ValueError(
                    f"cache holds {want.dtype} on {want.device}, got {name} in {t.dtype} on "
                    f"{t.device}; build the cache with the model's dtype and device"
                )
        if not can_read_values(counts):  # fake tensors (torch.export): shapes checked only
            return
        after = self.lengths + counts
        if bool((after > self.max_len).any()):
            row = int(torch.argmax((after > self.max_len).int()))
            raise ValueError(
                f"step too long: row {row} holds {int(self.lengths[row])} tokens and adds "
                f"{int(counts[row])}, past the cache's max_len={self.max_len}; build the cache "
                f"with a larger max_len"
            )
        if positions is not None:
            expected = self.lengths[:, None] + torch.arange(k.shape[2], device=k.device)
            valid = torch.arange(k.shape[2], device=k.device) < counts[:, None]
            if tuple(positions.shape) != tuple(expected.shape):
                raise ValueError(
                    f"positions must have shape (batch, t) = {tuple(expected.shape)}, got "
                    f"{tuple(positions.shape)}"
                )
            wrong = (positions.to(expected.device) != expected) & valid
            if bool(wrong.any()):
                row = int(torch.argmax(wrong.any(1).int()))
                raise ValueError(
                    f"positions out of order: row {row} holds {int(self.lengths[row])} tokens, so "
                    f"its next positions are {expected[row, : int(counts[row])].tolist()}, got "
                    f"{positions[row, : int(counts[row])].tolist()}"
                )

    def write(self, k: Tensor, v: Tensor, positions: Tensor, valid: Tensor) -> None:
        """Store the valid new keys k, v (B, H_kv, t, D) at their positions (B, t), as far as the
        plan keeps them: a ring slot takes the last of the positions that map to it. In place,
        or into new tensors when autograd needs the earlier ones."""
        after = self.lengths + valid.sum(1)
        slot = self.plan.slot(positions)
        in_ring = slot >= self.plan.pinned.numel()
        keep = valid & (slot >= 0) & (~in_ring | (positions >= after[:, None] - self.plan.ring))
        rows, cols = keep.nonzero(as_tuple=True)
        slots = slot[rows, cols]
        new_k, new_v = k[rows, :, cols], v[rows, :, cols]  # (N, H_kv, D)
        tracked = k.requires_grad or v.requires_grad or self.keys.requires_grad
        if torch.is_grad_enabled() and tracked:
            self.keys = _put(self.keys, rows, slots, new_k)
            self.values = _put(self.values, rows, slots, new_v)
        else:
            self.keys[rows, :, slots] = new_k
            self.values[rows, :, slots] = new_v
        self.slot_pos[rows, slots] = positions[rows, cols]


def _put(store: Tensor, rows: Tensor, slots: Tensor, new: Tensor) -> Tensor:
    """``store`` with new[i] at (rows[i], :, slots[i]), out of place (autograd keeps the old)."""
    out = store.clone()
    out[rows, :, slots] = new
    return out
