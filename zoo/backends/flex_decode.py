"""FlexAttention for a call against a ``KVCache``: the ``flex`` decoding backend of
``zoo.decoding.decode``.

The call's t query rows attend the cache's S slots (and, for a prefill into a ring, its own keys
after them, ``zoo.decoding.decode``). The block mask covers exactly those rows and slots::

                 slots (in slot order, not position order: a ring wraps)
                 [ 17 18 19 | 12 13 14 15 16 ]   <- slot_pos: absolute positions
    query 19     [  x  x  x |  .  x  x  x  x ]   sliding window 7 at position 19

- ``mask_mod(b, h, q_idx, kv_idx)`` reads the query's and the slot's absolute positions
  (``q_pos[b, q_idx]``, ``key_pos[b, kv_idx]``) and asks the pattern (``allowed_at``), so a ring
  buffer, pinned global keys and per-sequence lengths need nothing of their own; empty slots and
  padding queries are masked out.
- The block layout (which key blocks are empty, partial or full for each query block) is read
  from the step's own mask, which ``zoo.decoding.decode`` has made on the same positions:
  O(t * S), the size of one decode step's scores, per call.
- A positional bias is the ``score_mod``, at the same absolute positions.
- A pattern chosen by content (moba) is bound to the cache's keys first; its mask is per head.

Compiled FlexAttention on CPU (by the backend, or by a torch.compile around the step) pads q, k
and v to whole blocks (``zoo.backends.flex``); the padded slots are empty and the padded queries
invalid, so the output is cropped. Elsewhere only the mask is padded, to read its blocks.
Inference only: dropout is refused (``Backend.decode_reason_against``: flex declares no dropout)
and compiled flex has no backward on CPU.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..patterns import EMPTY, FULL, PARTIAL
from .base import DecodeStep
from .flex_kernel import _flex_module, flex_block_tensors, run_kernel


def _pad(x: Tensor, dim: int, size: int, value: float | bool | int) -> Tensor:
    """x padded with ``value`` along ``dim`` to ``size``."""
    extra = size - x.shape[dim]
    if extra == 0:
        return x
    shape = list(x.shape)
    shape[dim] = extra
    return torch.cat((x, x.new_full(shape, value)), dim)


def flex_decode(
    step: DecodeStep, block: int, compile: bool, least_head: int | None = None,
    kernel_options: dict | None = None,
) -> Tensor:  # fmt: skip
    """A decoding step (``zoo.backends.base.DecodeStep``) on FlexAttention with blocks of
    ``block`` -> (B, H, t, Dv); heads padded to ``least_head`` if given (``run_kernel``), the
    backend's ``kernel_options`` passed on."""
    q, keys, values, pattern = step.q, step.keys, step.values, step.pattern
    q_pos, key_pos, key_ok, valid, mask = (
        step.q_pos,
        step.key_pos,
        step.key_ok,
        step.valid,
        step.mask,
    )
    bias, scale = step.bias, step.score.scale
    t, slots = q.shape[2], keys.shape[2]
    # See FlexBackend.whole_blocks: on a CPU wherever the kernel is compiled, here or around us.
    # Elsewhere the kernel bounds a last block cut short itself, so the cache is not copied to
    # pad it (a copy of every slot per step); only the mask is, to read its blocks' states.
    whole = (compile or torch.compiler.is_compiling()) and q.device.type == "cpu"
    q_blocks, kv_blocks = -(-t // block) * block, -(-slots // block) * block
    q_len, kv_len = (q_blocks, kv_blocks) if whole else (t, slots)
    q, q_pos, valid = _pad(q, 2, q_len, 0.0), _pad(q_pos, 1, q_len, 0), _pad(valid, 1, q_len, False)
    keys, values = _pad(keys, 2, kv_len, 0.0), _pad(values, 2, kv_len, 0.0)
    key_pos, key_ok = _pad(key_pos, 1, kv_len, -1), _pad(key_ok, 1, kv_len, False)
    grid = _pad(mask, 3, kv_blocks, False)
    B, heads = grid.shape[:2]
    if t < block:  # one query block, partly padding: no block is FULL, nor is the mask padded
        some = grid.view(B, heads, 1, t, kv_blocks // block, block).any(5).any(3)
        state = torch.where(some, PARTIAL, EMPTY).to(torch.int8)
    else:
        grid = _pad(grid, 2, q_blocks, False).view(B, heads, -1, block, kv_blocks // block, block)
        some, every = grid.any(5).any(3), grid.all(5).all(3)  # (B, 1 or H, q blocks, k blocks)
        state = torch.where(every, FULL, torch.where(some, PARTIAL, EMPTY)).to(torch.int8)

    def step_mask(b, h, q_idx, kv_idx):
        allowed = pattern.allowed_at(b, h, q_pos[b, q_idx], key_pos[b, kv_idx])
        return allowed & key_ok[b, kv_idx] & valid[b, q_idx]

    block_mask = _flex_module().BlockMask.from_kv_blocks(
        *flex_block_tensors(state), BLOCK_SIZE=block, mask_mod=step_mask,
        seq_lengths=(q_len, kv_len),
    )  # fmt: skip
    score_mod = None
    if bias is not None:

        def score_mod(score, b, h, q_idx, kv_idx):
            return score + bias(h, q_pos[b, q_idx], key_pos[b, kv_idx]).to(score.dtype)

    out = run_kernel(
        compile, least_head, q, keys, values, score_mod=score_mod, block_mask=block_mask,
        scale=scale, enable_gqa=q.shape[1] != keys.shape[1],
        kernel_options=dict(kernel_options) if kernel_options else None,
    )  # fmt: skip
    return out[:, :, :t]
