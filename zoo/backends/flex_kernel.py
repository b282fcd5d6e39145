"""FlexAttention's kernel, compiled once, and block masks' tensors from block states: what the
flex backend's forward and its decoding step share."""

from __future__ import annotations

from functools import lru_cache

import torch
from torch import Tensor

from ..layout.block_layout import used_first
from ..patterns import FULL, PARTIAL

# Every pattern and shape is a separate compiled graph; dynamo's default of 8 would send the
# ninth silently to the slow, unfused eager path.
_RECOMPILE_LIMIT = 256


def _flex_module():
    from torch.nn.attention import flex_attention

    return flex_attention


def _kernel(compiled: bool):
    flex = _flex_module().flex_attention
    if not compiled or torch.compiler.is_compiling():
        # Inside a model that torch.compile traces, the model's graph compiles the kernel.
        return flex
    return _compiled_kernel()


@lru_cache(maxsize=1)
def _compiled_kernel():
    flex = _flex_module().flex_attention
    import torch._dynamo.config as dynamo_config

    for name in ("recompile_limit", "cache_size_limit"):  # the newer name, and the older one
        if hasattr(dynamo_config, name):
            setattr(dynamo_config, name, max(getattr(dynamo_config, name), _RECOMPILE_LIMIT))
    return torch.compile(flex, dynamic=False)


def flex_block_tensors(state: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices) from a [B, Qb, Kb] state,
    shaped [B, 1, Qb, ...] (one layout for all heads), or from a [B, H, Qb, Kb] state (a layout
    chosen by content, per head)."""

    def ordered(which: Tensor) -> tuple[Tensor, Tensor]:
        count, index = which.sum(dim=-1).to(torch.int32), used_first(which).to(torch.int32)
        if which.dim() == 3:
            count, index = count[:, None], index[:, None]
        return count.contiguous(), index.contiguous()

    return (*ordered(state == PARTIAL), *ordered(state == FULL))
