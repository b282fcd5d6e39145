"""One query per row against many keys with a mask, the keys split into runs of consecutive slots
that one kernel call runs side by side, merged by log-sum-exp: FlashDecoding's split of the keys,
for sdpa's masked decoding step (``zoo.backends.sdpa.sdpa_decode``).

SDPA runs a masked step on CUDA's memory-efficient kernel, which gives each row and key/value
head (the query heads of a group as its rows, ``grouped_heads``) one thread block over all its
keys: B = 8 rows and 4 key/value heads make 32 blocks on a GPU of 132 multiprocessors, each block
reading every slot of a static cache (``zoo.new_cache(static=True)``, all slots read and masked).
FlashAttention splits the keys of an unmasked step (its ``splitkv`` kernel), but takes no mask.
Here the keys of each row and key/value head are cut into runs of ``chunk`` consecutive slots,
views of the store (no copy), run as the heads of one call of the log-sum-exp kernel
(``lse_kernel``), so the kernel has B * H_kv * (slots // chunk) blocks; one more call takes the
slots the runs leave over, if any. Their outputs merge by ``lse_merge.merge_along``; a run
whose keys are all masked for a query weighs zero.

The run length is fixed (``CHUNK``), not a share of the slots: a cache's slots grow by one each
step, and a count of runs that followed them would be a new compiled graph at each change
(``split_keys_attention`` is one on a GPU); the count is then a size like any other, symbolic
after a second length. ``key_chunk`` says whether a step splits: on CUDA, where the kernel would
have fewer than ``TARGET_BLOCKS`` blocks and there are at least two runs' slots. Not on other
devices, whose kernels parallelise over the keys' blocks themselves; not for a step with dropout
or one that records gradients (the kernel's log-sum-exp carries none, so the merge's weights
would be constants to autograd); not for head sizes the kernel does not take as they are, nor
keys that are no view of a (B * H_kv, slots) store. How long a run should be on a given GPU has
not been timed yet: the decoding benchmark's ``sdpa_whole`` (``SdpaBackend(split_keys=False)``)
times the step without the split beside it.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..core.fused import fused
from .lse_kernel import kernel_for, runs_on
from .lse_merge import merge_along

TARGET_BLOCKS = 256  # about two thread blocks per multiprocessor of a Hopper GPU (132)
CHUNK = 1024  # slots a run (a multiple of 16: the kernel's mask rows stay aligned)


def key_chunk(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor, dropout_p: float) -> int:
    """The run length ``split_keys_attention`` takes for this step, or 0: no split (see the
    module docstring)."""
    if q.device.type != "cuda" or q.shape[2] != 1 or dropout_p:
        return 0
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, keys, values, mask)):
        return 0
    kernel = kernel_for(q.device)
    heads_fit = all(t.shape[-1] % kernel.head_multiple == 0 for t in (q, values))
    if not heads_fit or not runs_on(q.device, q.dtype) or not _rows_view(keys, values):
        return 0
    few_blocks = keys.shape[0] * keys.shape[1] < TARGET_BLOCKS
    return CHUNK if few_blocks and keys.shape[2] >= 2 * CHUNK else 0


def _rows_view(*stores: Tensor) -> bool:
    """Whether each (B, H_kv, S, D) is a view (B * H_kv, S, D) of its storage: rows and heads
    one stride apart, slots whole rows of D."""
    return all(
        t.stride(3) == 1 and t.stride(2) == t.shape[3] and t.stride(0) == t.shape[1] * t.stride(1)
        for t in stores
    )


@fused  # eagerly some 70 operations around the kernel, each host time a step
def split_keys_attention(
    q: Tensor, keys: Tensor, values: Tensor, mask: Tensor, scale: float | None, chunk: int
) -> Tensor:
    """q (B, H, 1, D), keys and values (B, H_kv, S, D / Dv), ``mask`` (B, 1 or H, 1, S), bool
    (True: may attend) or additive (-inf: may not), every row allowing some key -> (B, H, 1, Dv)
    in q's dtype: attention over the keys in runs of ``chunk`` consecutive slots, and the slots
    left over in one more, merged by log-sum-exp. On a GPU one compiled graph
    (``zoo.core.fused``: the kernel's calls and a few fused kernels around them)."""
    B, H, _, D = q.shape
    kv_heads, slots, dv = keys.shape[1], keys.shape[2], values.shape[3]
    groups, rows = H // kv_heads, B * kv_heads
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    whole = slots // chunk
    additive = mask if mask.is_floating_point() else torch.where(mask, 0.0, -math.inf)
    additive = additive.to(q.dtype)[:, :, 0]  # (B, 1 or H, S)
    grouping = (1, 1) if additive.shape[1] == 1 else (kv_heads, groups)
    queries = q.reshape(rows, 1, groups, D)
    runs = []
    for start, count, length in ((0, whole, chunk), (whole * chunk, 1, slots - whole * chunk)):
        if count == 0 or length == 0:
            continue
        end = start + count * length
        k = keys[:, :, start:end].reshape(rows, count, length, D)  # views of the stores
        v = values[:, :, start:end].reshape(rows, count, length, dv)
        # (B * H_kv, count, groups, length): each query head's mask on its key/value head's
        # run, a copy (B and H_kv share no stride in the mask, whose rows are B and query heads)
        bias = additive[..., start:end].reshape(B, *grouping, count, length)
        bias = bias.expand(B, kv_heads, groups, count, length).transpose(2, 3)
        bias = bias.reshape(rows, count, groups, length)
        runs.append((queries.expand(rows, count, groups, D).contiguous(), k, v, bias))
    parts = kernel_for(q.device).forward_all(runs, scale)
    outs = torch.cat([out for out, _ in parts], dim=1)  # (B * H_kv, runs, groups, Dv)
    lses = torch.cat([lse for _, lse in parts], dim=1)  # (B * H_kv, runs, groups)
    reads = torch.cat([torch.isfinite(bias).any(-1) for *_, bias in runs], dim=1)
    outs = torch.where(reads[..., None], outs.float(), 0.0)  # a run without a key may be NaN
    lses = torch.where(reads, lses.float(), -math.inf)
    out, _ = merge_along(outs.transpose(1, 2), lses.transpose(1, 2))  # (B * H_kv, groups, Dv)
    return out.to(q.dtype).reshape(B, H, 1, dv)
