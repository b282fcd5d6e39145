"""One fused attention kernel call that also returns each query's log-sum-exp, per device: what
the ``blocked`` backend's runs by key block (``blocked.by_key``) call and merge.

Both kernels take q (B, H, M, D), k and v (B, H, N, D / Dv) and an additive float mask that
broadcasts against (B, H, M, N), or None; the scale is the caller's. ``forward`` returns the
output (B, H, M, Dv) and the log-sum-exp (B, H, M) in float32. ``backward`` takes the output and
log-sum-exp of the *whole* row (the merge of every run that holds it), which makes a run's
gradients its exact share of the row's (``lse_merge``).

- CPU: PyTorch's flash kernel for CPU (``_scaled_dot_product_flash_attention_for_cpu``).
- CUDA: the memory-efficient kernel (``_scaled_dot_product_efficient_attention``), PyTorch's one
  CUDA kernel that takes an additive mask and returns the log-sum-exp, in float32, float16 and
  bfloat16 (its FlashAttention kernel takes no mask). Its requirements, met here:

  - the mask is 4-D at the full (B, H, M, N) size (its backward checks every size; an expanded
    view costs nothing), its last dimension contiguous and its rows a multiple of 16 elements
    apart (aligned loads): a mask whose rows are not is stored with its rows padded, a view;
  - the log-sum-exp comes back padded to a multiple of 32 queries; the backward reads it by
    strides, and is handed it at that padded size, as its forward made it;
  - head sizes a multiple of ``head_multiple`` (8), for its aligned kernels: the caller appends
    zero columns (``widened``), which change no score and no output column it keeps;
  - its backward reads the output at the layout its forward writes, (B, M, H, Dv) in memory
    (the row stride is H * Dv): the output handed to it is stored so.

A row whose keys are all masked gets an output of zeros or NaN depending on the kernel: callers
weigh such rows by zero with ``torch.where``, never by multiplying.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

LSE_QUERY_MULTIPLE = 32  # the memory-efficient kernel's log-sum-exp rows are padded to this
MASK_ROW_MULTIPLE = 16  # its mask rows' stride, in elements


@dataclass(frozen=True)
class LseKernel:
    """A device's kernel pair (see the module docstring); ``ops``: the ATen forward and backward
    it calls, swappable so that a CPU test can run the CUDA wrapping on an emulation of them."""

    device_type: str
    head_multiple: int
    forward: Callable[[Tensor, Tensor, Tensor, Tensor | None, float], tuple[Tensor, Tensor]]
    backward: Callable[..., tuple[Tensor, Tensor, Tensor]]

    def widened(self, width: int) -> int:
        """The head size the kernel gets for q/k and v heads of at most ``width``."""
        return -(-width // self.head_multiple) * self.head_multiple


def _cpu_forward(q, k, v, mask, scale):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, attn_mask=mask, scale=scale
    )
    return out, lse


def _cpu_backward(grad_out, q, k, v, out, lse, mask, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, q, k, v, out, lse, 0.0, False, attn_mask=mask, scale=scale
    )


CPU = LseKernel("cpu", 1, _cpu_forward, _cpu_backward)


def _bias(mask: Tensor | None, q: Tensor, k: Tensor) -> Tensor | None:
    """The mask as the memory-efficient kernel takes it: (B, H, M, N) in q's dtype, rows
    MASK_ROW_MULTIPLE apart (or broadcast, stride 0), the last dimension contiguous."""
    if mask is None:
        return None
    B, H, M = q.shape[:3]
    N = k.shape[2]
    mask = mask.to(q.dtype)
    rows_apart = mask.shape[-2] == 1 or mask.stride(-2) % MASK_ROW_MULTIPLE == 0
    if mask.stride(-1) != 1 or not rows_apart:
        padded = -(-N // MASK_ROW_MULTIPLE) * MASK_ROW_MULTIPLE
        stored = mask.new_zeros(*mask.shape[:-1], padded)
        stored[..., :N] = mask
        mask = stored[..., :N]
    return mask.expand(B, H, M, N)


@dataclass(frozen=True)
class _EfficientOps:
    forward: Callable = torch.ops.aten._scaled_dot_product_efficient_attention
    backward: Callable = torch.ops.aten._scaled_dot_product_efficient_attention_backward


def cuda_kernel(ops: _EfficientOps | None = None) -> LseKernel:
    """The CUDA kernel pair on the memory-efficient kernel's ops (or ``ops`` standing in)."""
    ops = ops or _EfficientOps()

    def forward(q, k, v, mask, scale):
        out, lse = ops.forward(q, k, v, _bias(mask, q, k), True, 0.0, False, scale=scale)[:2]
        return out, lse[..., : q.shape[2]]

    def backward(grad_out, q, k, v, out, lse, mask, scale):
        M = q.shape[2]
        padded = -(-M // LSE_QUERY_MULTIPLE) * LSE_QUERY_MULTIPLE
        lse = torch.nn.functional.pad(lse.float(), (0, padded - M)).contiguous()
        none = q.new_empty((), dtype=torch.long)  # philox seed and offset: no dropout
        out = out.transpose(1, 2).contiguous().transpose(1, 2)  # (B, M, H, Dv) in memory
        grads = ops.backward(
            grad_out, q, k, v, _bias(mask, q, k), out, lse, none, none, 0.0,
            [True, True, True, False], False, scale=scale,
        )  # fmt: skip
        return grads[0], grads[1], grads[2]

    return LseKernel("cuda", 8, forward, backward)


KERNELS = {"cpu": CPU, "cuda": cuda_kernel()}
KERNEL_DTYPES = {
    "cpu": (torch.float16, torch.bfloat16, torch.float32, torch.float64),
    "cuda": (torch.float16, torch.bfloat16, torch.float32),
}


def kernel_for(device: torch.device) -> LseKernel:
    return KERNELS[device.type]


def runs_on(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a kernel pair here runs tensors of ``dtype`` on ``device``."""
    return dtype in KERNEL_DTYPES.get(device.type, ())
