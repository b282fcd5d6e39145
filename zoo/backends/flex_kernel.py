"""FlexAttention's kernel, compiled once, and block masks' tensors from block states: what the
flex backend's forward and its decoding step share."""

from __future__ import annotations

from functools import lru_cache

import torch
from torch import Tensor

from ..core.device_build import has_no_data
from ..core.fused import raise_recompile_limit
from ..core.narrowed import narrowed
from ..layout.block_layout import used_first
from ..patterns import FULL, PARTIAL


def _flex_module():
    from torch.nn.attention import flex_attention

    return flex_attention


def _kernel(compiled: bool, q: Tensor | None = None, static_lengths: bool = False):
    flex = _flex_module().flex_attention
    if q is not None and has_no_data(q) and not torch.compiler.is_compiling():
        return _uncompiled
    if not compiled or torch.compiler.is_compiling():
        # Inside a model that torch.compile traces, the model's graph compiles the kernel.
        return flex
    return _compiled_kernel(not static_lengths and q is not None and q.device.type != "cpu")


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
    static_lengths: bool = False, **kwargs,
):  # fmt: skip
    """The kernel on q, k, v -> output, or with ``lse`` (output, log-sum-exp (B, H, Lq) in
    float32, natural log, -inf on a row without a key); with ``least_head``, q/k and v heads
    padded with zeros to that size first (Inductor's CUDA lowering refuses heads under 16:
    tl.dot's least) and the output cropped back. Zero columns add nothing to a score, and the
    scale stays the true head's. ``static_lengths``: on a GPU too, a kernel compiled for each
    length (``_compiled_kernel``)."""
    kernel = _kernel(compiled, q, static_lengths)
    if lse:
        kwargs.update(_lse_request())
    if q.device.type == "cuda" and kwargs.get("block_mask") is not None:
        options = _cuda_options_now(
            kwargs["block_mask"].BLOCK_SIZE[1], q, k, kwargs.get("kernel_options") or {}
        )
        kwargs["kernel_options"] = options or None
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


# Inductor's CUDA kernels prove a length whole in tiles only where it is a static multiple of
# 128 (``IS_DIVISIBLE``); below that multiple a tile is a power of two, tl.dot's least 16.
_WHOLE_LENGTH = 128
_LEAST_TILE = 16
# The decoding kernel's key tile (FlexDecodeConfig's block_n), filtered before any option applies.
_DECODE_KEY_TILE = 64


def block_tile(block: int) -> int:
    """The largest tile of Inductor's CUDA kernels that divides a block of ``block`` tokens: its
    largest power-of-two divisor, at most 128 (below 16 none runs)."""
    return min(block & -block, _WHOLE_LENGTH)


def forward_tile(block: int) -> int | None:
    """The forward kernel's tile the backend passes for blocks of ``block`` tokens, or None where
    Inductor's own (64 or 128) divide it: the block's tile, at most 64."""
    return None if block % _WHOLE_LENGTH == 0 else min(block_tile(block), _DECODE_KEY_TILE)


def _cuda_options_now(block: int, q: Tensor, k: Tensor, options: dict) -> dict:
    """``cuda_kernel_options``, computed once per block, shapes and options: every call on a GPU
    asks, and its Python took as long as the rest of a planned call's host work."""
    if torch.compiler.is_compiling():  # traced once per graph; dynamo warns at an lru_cache
        return cuda_kernel_options(block, q, k, options)
    try:  # the values' types in the key: True and 1 are equal keys
        items = tuple((key, type(value), value) for key, value in options.items())
        return dict(_cuda_options_of(block, q.shape, k.shape, items))
    except TypeError:  # a value that is not hashable, or symbolic sizes: computed each time
        return cuda_kernel_options(block, q, k, options)


@lru_cache(maxsize=1024)
def _cuda_options_of(block: int, q_shape: torch.Size, k_shape: torch.Size, items: tuple) -> tuple:
    options = {key: value for key, _, value in items}
    return tuple(_options_for(block, q_shape, k_shape, options).items())


def cuda_kernel_options(block: int, q: Tensor, k: Tensor, options: dict) -> dict:
    """The kernel options of a call on CUDA with blocks of ``block`` tokens: the caller's, and
    where it set none of them,
    - ``IS_DIVISIBLE=False`` where both lengths are multiples of 128 but the block does not
      divide one: Inductor's rule (static multiples of 128) would declare them whole, and the
      kernel then walks every tile of a listed block, the last block's past the end, unchecked
      (a length of 384 in blocks of 256). Never True here (``FlexBackend(pad_to_blocks=True)``
      declares it for lengths it padded): Inductor declares static multiples of 128 itself, and
      a symbolic length (the flex backend's kernel from a second length on,
      ``_compiled_kernel``) declared so would be a second compiled family beside the lengths
      that are not multiples (3 compiles for ``bench-compiles``' 20 lengths, where 2 hold), for
      a kernel time not yet measured (eval/results/gpu-campaign-h200-2026-11-28);
    - forward tiles that divide the block where 128 does not (Inductor's default tiles are 64 or
      128, and a tile that does not divide the block is refused);
    - for fewer than 128 queries (Inductor's decoding kernel, whose query tile is the next power
      of two of the queries times the query heads per key head, at least 16): that tile cut to
      one that divides the block, the same as the forward tile (Inductor reads whether the rows
      fill the tile from ``BLOCK_M`` and runs ``fwd_BLOCK_M``: two sizes would load and store
      past the rows), or the main kernel where the decoding kernel has no tile that fits."""
    return _options_for(block, q.shape, k.shape, options)


def _options_for(block: int, q_shape: torch.Size, k_shape: torch.Size, options: dict) -> dict:
    """``cuda_kernel_options`` of q's and k's shapes."""
    out = dict(options)
    q_len, kv_len = q_shape[-2], k_shape[-2]
    forward = forward_tile(block)
    if q_len < _WHOLE_LENGTH:
        group = max(q_shape[1] // max(k_shape[1], 1), 1)
        rows = max(1 << max(q_len * group - 1, 0).bit_length(), _LEAST_TILE)
        query = rows if block % rows == 0 else min(block_tile(block), _DECODE_KEY_TILE)
        query = query if forward is None else min(query, forward)
        if query != rows:
            out.setdefault("BLOCK_M", query)
        if forward is not None:
            out.setdefault("fwd_BLOCK_M", query)
            out.setdefault("fwd_BLOCK_N", forward)
        runs = out.get("fwd_BLOCK_M", out.get("BLOCK_M", rows))
        decodable = block < _DECODE_KEY_TILE or block % _DECODE_KEY_TILE == 0
        fits = runs == out.get("BLOCK_M", rows) and block % runs == 0 and runs % group == 0
        # torch 2.13 refuses the older switch beside its successor, BACKEND, if the caller set it
        if not (decodable and fits) and "BACKEND" not in out:
            out.setdefault("FORCE_USE_FLEX_ATTENTION", True)
    elif forward is not None:
        out.setdefault("fwd_BLOCK_M", forward)
        out.setdefault("fwd_BLOCK_N", forward)
    lengths = (q_len, kv_len)
    if all(n % _WHOLE_LENGTH == 0 for n in lengths) and any(n % block for n in lengths):
        out.setdefault("IS_DIVISIBLE", False)
    return out


def cuda_block_reason(block: int, head_size: int, dtype: torch.dtype, backward: bool) -> str | None:
    """Why Inductor's CUDA kernels cannot run blocks of ``block`` tokens, or None: a block whose
    largest power-of-two divisor is under 16 has no tile; with ``backward``, on a GPU at hand,
    the backward kernel's tiles for this head size and dtype (Inductor's choice per device, which
    no option changes) must divide the block (H100 and H200, head size 64-128, bfloat16:
    (64, 128, 128, 64), so a block of 64 has no backward there)."""
    if block_tile(block) < _LEAST_TILE:
        return (
            f"its CUDA kernels tile a block by a power of two from {_LEAST_TILE}, and "
            f"block_size={block} has none (use a multiple of {_LEAST_TILE})"
        )
    if not backward or block % _WHOLE_LENGTH == 0:  # Inductor's tiles are at most 128
        return None
    tiles = _backward_tiles(head_size, dtype)
    if tiles is not None and all(block % max(c) for c in tiles):
        best = min(tiles, key=max)
        return (
            f"its CUDA backward kernel on this GPU tiles head size {head_size} in "
            f"{str(dtype).removeprefix('torch.')} by {best}, and block_size={block} is not a "
            f"multiple of {max(best)} (Inductor's choice; use block_size={_WHOLE_LENGTH})"
        )
    return None


def _backward_tiles(head_size: int, dtype: torch.dtype) -> list[tuple[int, ...]] | None:
    """The (BLOCK_M1, BLOCK_N1, BLOCK_N2, BLOCK_M2) tiles Inductor may choose for the backward
    kernel on this machine's GPU, or None where no GPU answers (a CPU, fake CUDA tensors) or this
    torch has no such query."""
    if not torch.cuda.is_available():
        return None
    return _backward_tiles_on(torch.cuda.current_device(), head_size, dtype)


@lru_cache(maxsize=64)
def _backward_tiles_on(device: int, head_size: int, dtype: torch.dtype):
    """``_backward_tiles`` on one GPU, asked once."""
    try:
        from torch._inductor.choices import InductorChoices

        configs = InductorChoices().get_flex_attention_bwd_configs(head_size, dtype, "cuda")
        return [(c.block_m1, c.block_n1, c.block_n2, c.block_m2) for c in configs] or None
    except Exception:  # an internal API of Inductor: where it moved, nothing is refused
        return None


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
    # each pattern (its mask_mod's code) and head layout is a graph (on a CPU also each length)
    raise_recompile_limit()
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
