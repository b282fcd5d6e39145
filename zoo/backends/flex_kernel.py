"""FlexAttention's kernel, compiled once, and block masks' tensors from block states: what the
flex backend's forward and its decoding step share."""

from __future__ import annotations

from functools import lru_cache

import torch
from torch import Tensor

from ..core.device_build import has_no_data
from ..core.narrowed import narrowed
from ..layout.block_layout import used_first
from ..patterns import FULL, PARTIAL

# Every pattern (its mask_mod's code) and head layout is a separate compiled graph (on a CPU
# also every length); dynamo's default of 8 would send the ninth silently to the slow, unfused
# eager path.
_RECOMPILE_LIMIT = 256


def _flex_module():
    from torch.nn.attention import flex_attention

    return flex_attention


def _kernel(compiled: bool, q: Tensor | None = None):
    flex = _flex_module().flex_attention
    if q is not None and has_no_data(q) and not torch.compiler.is_compiling():
        return _uncompiled
    if not compiled or torch.compiler.is_compiling():
        # Inside a model that torch.compile traces, the model's graph compiles the kernel.
        return flex
    return _compiled_kernel(q is not None and q.device.type != "cpu")


def _uncompiled(*args, **kwargs):
    """The eager kernel on fake or meta tensors (the CUDA paths checked on a CPU): without the
    dynamo pass eager flex makes, which fails on fake tensors once their sizes vary (torch's
    debugging switch, the higher-order op run as it is)."""
    module = _flex_module()
    saved = module._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG
    module._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = True
    try:
        return module.flex_attention(*args, **kwargs)
    finally:
        module._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = saved


def run_kernel(
    compiled: bool, least_head: int | None, q: Tensor, k: Tensor, v: Tensor, lse: bool = False,
    **kwargs,
):  # fmt: skip
    """The kernel on q, k, v -> output, or with ``lse`` (output, log-sum-exp (B, H, Lq) in
    float32, natural log, -inf on a row without a key); with ``least_head``, q/k and v heads
    padded with zeros to that size first (Inductor's CUDA lowering refuses heads under 16:
    tl.dot's least) and the output cropped back. Zero columns add nothing to a score, and the
    scale stays the true head's."""
    kernel = _kernel(compiled, q)
    if lse:
        kwargs.update(_lse_request())
    width = v.shape[-1]
    if least_head is not None:
        if kwargs.get("scale") is None:
            kwargs["scale"] = q.shape[-1] ** -0.5
        q, k, v = (_pad_head(x, least_head) for x in (q, k, v))
    result = kernel(q, k, v, **kwargs)
    out, aux = result if lse else (result, None)
    if least_head is not None:
        out = narrowed(out, -1, 0, width)
    if not lse:
        return out
    return out, getattr(aux, "lse", aux)  # AuxOutput(lse=...), or the lse itself (older torch)


def _lse_request() -> dict[str, object]:
    """The kernel's argument for its log-sum-exp: ``return_aux`` where torch has it (2.9 on;
    ``return_lse`` is deprecated there), else ``return_lse``."""
    module = _flex_module()
    if hasattr(module, "AuxRequest"):
        return {"return_aux": module.AuxRequest(lse=True)}
    return {"return_lse": True}


def _pad_head(x: Tensor, least: int) -> Tensor:
    return torch.nn.functional.pad(x, (0, least - x.shape[-1])) if x.shape[-1] < least else x


@lru_cache(maxsize=2)
def _compiled_kernel(dynamic_lengths: bool = True):
    """The compiled kernel. ``dynamic_lengths`` (GPUs): automatic dynamic shapes, so the first
    length compiles a static kernel and the second one of symbolic lengths that serves every
    later one (the block mask, built per length outside the graph, is an input); with
    dynamic=False every new length compiled again, 2.5-7.4 s each on an H100. On a CPU the
    kernel stays one per length: Inductor's CPU template for FlexAttention emitted C++ that does
    not compile at symbolic lengths for per-head and tiled masks (bigbird, neighborhood_2d;
    tests/backends/test_flex.py::test_compiled_flex_forward_on_cpu)."""
    flex = _flex_module().flex_attention
    import torch._dynamo.config as dynamo_config

    for name in ("recompile_limit", "cache_size_limit"):  # the newer name, and the older one
        if hasattr(dynamo_config, name):
            setattr(dynamo_config, name, max(getattr(dynamo_config, name), _RECOMPILE_LIMIT))
    return torch.compile(flex, dynamic=None if dynamic_lengths else False)


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
