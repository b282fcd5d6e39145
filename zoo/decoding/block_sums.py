"""Sums of keys per block of ``block`` positions: what a pattern that scores key blocks by their
mean key (MoBA) reads, computed at once for a call's keys or kept up to date in a ``KVCache``.

Scoring blocks from the keys themselves reads every key, O(keys * D) per call. For one decoding
step that is as much as dense attention reads, so a cache keeps the sums and adds only the keys
written since the last step (``RunningBlockSums``): a step then scores blocks in O(blocks * D).
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor

from ..core.fused import fused

SUM_CHUNK = 1 << 24  # key elements copied to float32 at once (64 MB)


@torch.no_grad()
def block_sums(k: Tensor, keep: Tensor, block: int) -> tuple[Tensor, Tensor]:
    """k (B, H_kv, L, D), keep (B, L) True where a key counts -> the float32 sums (B, H_kv,
    blocks, D) of the kept keys in each block of ``block`` positions (the last one shorter when
    L is not a multiple) and (B, blocks) how many keys each holds.

    On a GPU one compiled graph that reads k once and writes only the sums (``zoo.core.fused``),
    where eagerly each chunk of blocks was a dozen operations and launches; eagerly a few blocks
    at a time, since a float32 copy of every key, and its product with ``keep``, were each as
    large as k (512 MB apiece at 128K tokens, 16 heads, D = 64)."""
    return _sums(k, keep, block)


def _padded_keep(keep: Tensor, blocks: int, block: int) -> Tensor:
    """keep (B, L) -> (B, blocks, block), False past L."""
    padded = torch.nn.functional.pad(keep, (0, blocks * block - keep.shape[1]))
    return padded.view(-1, blocks, block)


def _chunked_sums(k: Tensor, keep: Tensor, block: int) -> tuple[Tensor, Tensor]:
    """``block_sums`` eagerly, a few blocks at a time."""
    B, kv_heads, length, D = k.shape
    blocks = -(-length // block)
    keep = _padded_keep(keep, blocks, block)
    weights = keep.to(torch.float32)[:, None, :, :, None]  # (B, 1, blocks, block, 1)
    sums = torch.empty(B, kv_heads, blocks, D, dtype=torch.float32, device=k.device)
    step = max(1, SUM_CHUNK // max(1, B * kv_heads * block * D))  # blocks at a time
    for first in range(0, blocks, step):
        last = min(first + step, blocks)
        keys = k[:, :, first * block : last * block].to(torch.float32, copy=True)
        tail = (last - first) * block - keys.shape[2]  # the short last block
        keys = torch.nn.functional.pad(keys, (0, 0, 0, tail)) if tail else keys
        keys = keys.unflatten(2, (last - first, block)).mul_(weights[:, :, first:last])
        sums[:, :, first:last] = keys.sum(3)
    return sums, keep.sum(-1)


@fused(eager=_chunked_sums)
def _sums(k: Tensor, keep: Tensor, block: int) -> tuple[Tensor, Tensor]:
    """``block_sums`` in one expression, which a compiler fuses into one pass over k."""
    length = k.shape[2]
    blocks = -(-length // block)
    keep = _padded_keep(keep, blocks, block)
    keys = torch.nn.functional.pad(k, (0, 0, 0, blocks * block - length))
    keys = keys.unflatten(2, (blocks, block)).to(torch.float32) * keep[:, None, :, :, None]
    return keys.sum(3), keep.sum(-1)


class RunningBlockSums:
    """``block_sums`` of a cache's keys, slot j at position j (a cache without a ring: no slot is
    ever overwritten): summed at once when made, then each key added as the cache writes it
    (``add``), with no read of a device value on the host."""

    @torch.no_grad()
    def __init__(self, keys: Tensor, slot_pos: Tensor, block: int) -> None:
        self.block = block
        self.sums, self.counts = block_sums(keys, slot_pos >= 0, block)

    @torch.no_grad()
    def add(self, rows: Tensor, slots: Tensor, keys: Tensor, kept: Tensor, sign: int = 1) -> None:
        """Add the keys (..., H_kv, D) written at (rows, slots) (each of the leading shape) where
        ``kept``; the others add nothing (zeros, whatever their keys hold). ``sign=-1`` takes
        them out (slots forgotten by a rollback)."""
        blocks = slots // self.block
        added = torch.where(kept[..., None, None], keys.float(), 0.0)
        self.sums.transpose(1, 2).index_put_((rows, blocks), sign * added, accumulate=True)
        self.counts.index_put_((rows, blocks), sign * kept.long(), accumulate=True)

    @torch.no_grad()
    def add_at(self, slot: int, keys: Tensor) -> None:
        """``add`` for keys (B, H_kv, D) written at one slot of every row, a slot the host
        knows (``KVCache.write``'s step at a host position): no index tensor."""
        block = slot // self.block
        self.sums[:, :, block] += keys.float()
        self.counts[:, block] += 1

    def clone(self) -> RunningBlockSums:
        twin = copy.copy(self)
        twin.sums, twin.counts = self.sums.clone(), self.counts.clone()
        return twin

    @torch.no_grad()
    def remove(self, keys: Tensor, forgotten: Tensor) -> None:
        """Take out the keys (B, H_kv, slots, D) of the slots ``forgotten`` (B, slots), in place
        (a static cache's sums keep their address)."""
        sums, counts = block_sums(keys, forgotten, self.block)
        self.sums.sub_(sums)
        self.counts.sub_(counts)
