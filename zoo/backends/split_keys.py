"""One query per row against many keys with a mask, the keys split into chunks that one kernel
call runs side by side, merged by log-sum-exp: FlashDecoding's split of the keys, for sdpa's
masked decoding step (``zoo.backends.sdpa.sdpa_decode``).

SDPA runs a masked step on CUDA's memory-efficient kernel, which gives each row and key/value
head (the query heads of a group as its rows, ``grouped_heads``) one thread block over all its
keys: B = 8 rows and 4 key/value heads make 32 blocks on a GPU of 132 multiprocessors, each block
reading every slot of a static cache (``zoo.new_cache(static=True)``, all slots read and masked).
FlashAttention splits the keys of an unmasked step (its ``splitkv`` kernel), but takes no mask.
Here the keys of each row and key/value head are cut into ``chunks`` runs of consecutive slots,
views of the store (no copy), run as the heads of one call of the log-sum-exp kernel
(``lse_kernel``), so the kernel has B * H_kv * chunks blocks; a last, shorter run takes the slots
the chunks leave over. Their outputs merge by ``lse_merge.merge_along``; a run whose keys are all
masked for a query weighs zero.

``key_chunks`` says how many chunks a step takes: on CUDA, enough to give the kernel about
``TARGET_BLOCKS`` blocks, each chunk at least ``MIN_CHUNK`` slots; one (no split) on other devices,
whose kernels parallelise over the keys' blocks themselves, for a step with dropout or one that
records gradients (the merge here is not differentiated), a length that is symbolic in a traced
graph (a compiled dynamic cache: the count would guard every length), head sizes the kernel does
not take as they are, and keys that are no view of a (B * H_kv, slots) store.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..core.fused import fused
from .lse_kernel import kernel_for, runs_on
from .lse_merge import merge_along

TARGET_BLOCKS = 256  # about two blocks per multiprocessor of a Hopper GPU (132)
MIN_CHUNK = 1024  # slots: fewer, and the merge costs more than the blocks gain
CHUNK_MULTIPLE = 16  # a chunk's slots: the kernel's mask rows stay aligned


def key_chunks(q: Tensor, keys: Tensor, values: Tensor, dropout_p: float) -> int:
    """How many chunks ``split_keys_attention`` cuts the keys into for this step (1: no split;
    see the module docstring)."""
    slots = keys.shape[2]
    if q.device.type != "cuda" or q.shape[2] != 1 or dropout_p or not isinstance(slots, int):
        return 1
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, keys, values)):
        return 1
    kernel = kernel_for(q.device)
    heads_fit = all(t.shape[-1] % kernel.head_multiple == 0 for t in (q, values))
    if not heads_fit or not runs_on(q.device, q.dtype) or not _rows_view(keys, values):
        return 1
    rows = keys.shape[0] * keys.shape[1]
    return max(1, min(-(-TARGET_BLOCKS // rows), slots // MIN_CHUNK))


def _rows_view(*stores: Tensor) -> bool:
    """Whether each (B, H_kv, S, D) is a view (B * H_kv, S, D) of its storage: rows and heads
    one stride apart, slots whole rows of D."""
    return all(
        t.stride(3) == 1 and t.stride(2) == t.shape[3] and t.stride(0) == t.shape[1] * t.stride(1)
        for t in stores
    )


@fused  # eagerly some 40 launches around the kernel, each host time a step
def split_keys_attention(
    q: Tensor, keys: Tensor, values: Tensor, mask: Tensor, scale: float | None, chunks: int
) -> Tensor:
    """q (B, H, 1, D), keys and values (B, H_kv, S, D / Dv), ``mask`` (B, 1 or H, 1, S), bool
    (True: may attend) or additive (-inf: may not), every row allowing some key -> (B, H, 1, Dv)
    in q's dtype: attention over the keys in ``chunks`` runs of consecutive slots and a last
    shorter one where they leave slots over, merged by log-sum-exp. On a GPU one compiled graph
    (``zoo.core.fused``: the kernel and a few fused kernels around it)."""
    B, H, _, D = q.shape
    kv_heads, slots, dv = keys.shape[1], keys.shape[2], values.shape[3]
    groups, rows = H // kv_heads, B * kv_heads
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    size = -(-slots // chunks)
    size = -(-size // CHUNK_MULTIPLE) * CHUNK_MULTIPLE
    whole = slots // size  # runs of ``size`` slots; then the rest, if any
    additive = mask if mask.is_floating_point() else torch.where(mask, 0.0, -math.inf)
    additive = additive.to(q.dtype)[:, :, 0]  # (B, 1 or H, S)
    grouping = (1, 1) if additive.shape[1] == 1 else (kv_heads, groups)
    queries = q.reshape(rows, 1, groups, D)
    runs = []
    for start, count, length in ((0, whole, size), (whole * size, 1, slots - whole * size)):
        if count == 0 or length == 0:
            continue
        end = start + count * length
        k = keys[:, :, start:end].reshape(rows, count, length, D)  # views of the stores
        v = values[:, :, start:end].reshape(rows, count, length, dv)
        # (B * H_kv, count, groups, length): each query head's mask on its key/value head's run
        bias = additive[..., start:end].reshape(B, *grouping, count, length)
        bias = bias.expand(B, kv_heads, groups, count, length).transpose(2, 3)
        bias = bias.reshape(rows, count, groups, length)
        runs.append((queries.expand(rows, count, groups, D).contiguous(), k, v, bias))
    parts = kernel_for(q.device).forward_all(runs, scale)
    outs = torch.cat([out for out, _ in parts], dim=1)  # (B * H_kv, runs, groups, Dv)
    lses = torch.cat([lse for _, lse in parts], dim=1)  # (B * H_kv, runs, groups)
    has_key = torch.cat([torch.isfinite(bias).any(-1) for *_, bias in runs], dim=1)
    outs = torch.where(has_key[..., None], outs.float(), 0.0)  # a keyless run's may be NaN
    lses = torch.where(has_key, lses.float(), -math.inf)
    out, _ = merge_along(outs.transpose(1, 2), lses.transpose(1, 2))  # (B * H_kv, groups, Dv)
    return out.to(q.dtype).reshape(B, H, 1, dv)
