"""``valid_lens``: the number of valid tokens of each sequence (its padding on the right), as the
modules take it, and the key padding mask it stands for."""

from __future__ import annotations

import torch
from torch import Tensor

from .arguments import is_integer_dtype
from .device_build import can_read_values


def check_valid_lens(valid_lens: object, batch: int | None = None) -> Tensor:
    """``valid_lens``, the number of valid keys of each sequence, as a (batch,) integer tensor:
    a 1-D integer tensor, or a list or tuple of ints (made a tensor here)."""
    if isinstance(valid_lens, list | tuple):
        if not all(isinstance(n, int) and not isinstance(n, bool) for n in valid_lens):
            raise TypeError(
                f"valid_lens must hold ints (the valid keys of each sequence), got {valid_lens!r}"
            )
        try:
            valid_lens = torch.tensor(valid_lens, dtype=torch.long)
        except (OverflowError, RuntimeError, ValueError) as error:  # an int beyond 64 bits
            raise ValueError(
                f"valid_lens must hold key counts (ints of 64 bits), got {valid_lens!r}"
            ) from error
    if not isinstance(valid_lens, Tensor):
        raise TypeError(
            "valid_lens must be a 1-D integer tensor or a list of ints (the valid keys of each "
            f"sequence), got {type(valid_lens).__name__}"
        )
    dtype = valid_lens.dtype
    if not is_integer_dtype(dtype):
        raise TypeError(
            f"valid_lens must have an integer dtype (torch.long, say), got dtype {dtype}: it "
            "counts the valid keys of each sequence"
        )
    if valid_lens.dim() != 1 or (batch is not None and valid_lens.shape[0] != batch):
        expected = "(batch,)" if batch is None else f"(batch,) = ({batch},)"
        raise ValueError(
            f"valid_lens must have shape {expected}, one key count per sequence, got "
            f"{tuple(valid_lens.shape)}"
        )
    return valid_lens


def padding_from_lengths(valid_lens: Tensor, kv_len: int) -> Tensor:
    """(B,) numbers of valid keys -> (B, kv_len) key padding mask (True = padding)."""
    valid_lens = check_valid_lens(valid_lens)
    # A data-dependent check: checked in eager mode, skipped inside a compiled graph (where it
    # would be a graph break) and on fake tensors (which have no values). On a GPU it is a
    # device-side assertion: reading the values would stall the host on every call.
    out_of_range = (valid_lens < 0) | (valid_lens > kv_len)
    if can_read_values(valid_lens) and valid_lens.device.type != "cpu":
        torch._assert_async(~out_of_range.any(), f"valid_lens must lie in [0, {kv_len}]")
    elif can_read_values(valid_lens) and bool(out_of_range.any()):
        raise ValueError(
            f"valid_lens must lie in [0, {kv_len}] (the key length), got {valid_lens.tolist()}"
        )
    return torch.arange(kv_len, device=valid_lens.device)[None, :] >= valid_lens[:, None]
