"""FlexAttention emulated in plain PyTorch, differentiable on a CPU (where flex has no backward),
reading a ``BlockMask`` as the kernel does: every pair of a FULL block is scored without asking the
mask_mod, a PARTIAL block's pairs are asked, the rest are masked. A block mask that claims a block
FULL where the pattern masks part of it therefore gives another output here, which eager flex
(it asks the mask_mod everywhere) would hide. The log-sum-exp is returned as the kernel returns it
(-inf and a zero output on a row without a key), and its gradient flows."""

from __future__ import annotations

import torch


def _dense(num_blocks, indices, kv_blocks: int):
    """(B, H, Qb, Kb) bool: the blocks that a (num_blocks, indices) pair lists."""
    B, H, Qb, width = indices.shape
    listed = torch.arange(width) < num_blocks[..., None].long()
    dense = torch.zeros(B, H, Qb, kv_blocks + 1, dtype=torch.bool)
    index = torch.where(listed, indices.long(), kv_blocks)
    return dense.scatter_(-1, index, True)[..., :kv_blocks]


def emulated_flex(q, k, v, score_mod=None, block_mask=None, scale=None, enable_gqa=False,
                  return_lse=False, return_aux=None, kernel_options=None):  # fmt: skip
    B, H, Lq, D = q.shape
    Lk = k.shape[2]
    if enable_gqa:
        k, v = (x.repeat_interleave(H // x.shape[1], dim=1) for x in (k, v))
    scale = D**-0.5 if scale is None else scale
    scores = (q.double() @ k.double().transpose(-1, -2)) * scale
    b = torch.arange(B)[:, None, None, None]
    h = torch.arange(H)[None, :, None, None]
    qi, ki = torch.arange(Lq)[None, None, :, None], torch.arange(Lk)[None, None, None, :]
    if score_mod is not None:
        scores = score_mod(scores, b, h, qi, ki)
    allowed = torch.ones(B, H, Lq, Lk, dtype=torch.bool)
    if block_mask is not None:
        qb, kb = block_mask.BLOCK_SIZE
        kv_blocks = block_mask.kv_indices.shape[-1]
        partial = _dense(block_mask.kv_num_blocks, block_mask.kv_indices, kv_blocks)
        full = torch.zeros_like(partial)
        if block_mask.full_kv_num_blocks is not None:
            full = _dense(block_mask.full_kv_num_blocks, block_mask.full_kv_indices, kv_blocks)

        def widen(x):
            x = x.expand(B, H, -1, -1).repeat_interleave(qb, 2).repeat_interleave(kb, 3)
            return x[:, :, :Lq, :Lk]

        asked = block_mask.mask_mod(b, h, qi, ki).expand(B, H, Lq, Lk)
        allowed = widen(full) | (widen(partial) & asked)
    scores = scores.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    has_key = allowed.any(-1, keepdim=True)
    weights = torch.where(has_key, torch.exp(scores - torch.where(has_key, lse[..., None], 0)), 0)
    out = (weights @ v.double()).to(q.dtype)
    if return_lse or return_aux is not None:
        return out, lse.float()
    return out
