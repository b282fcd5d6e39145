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
    view costs nothing), its last dimension contiguous, its start and every stride a multiple
    of 16 elements (aligned loads; the backward checks a single row's stride too): a mask that
    is not is stored with its rows padded, and handed over as a view;
  - the log-sum-exp comes back padded to a multiple of 32 queries; the backward reads it by
    strides, and is handed it at that padded size, as its forward made it;
  - head sizes a multiple of ``head_multiple`` (8), for its aligned kernels: the caller appends
    zero columns (``widened``), which change no score and no output column it keeps;
  - its backward reads the output at the layout its forward writes, (B, M, H, Dv) in memory
    (the row stride is H * Dv): the output handed to it is stored so.

A row whose keys are all masked gets an output of zeros or NaN depending on the kernel: callers
weigh such rows by zero with ``torch.where``, never by multiplying.

Many runs at once (``forward_all``, ``backward_all``): on a CPU one call each. On CUDA a kernel
launch and its host work would cost more than a small run's attention (MoBA at 64K tokens, 16
heads: 2048 runs per pass), so runs of one sequence and head are packed: those without a mask
into one variable-length call of the same kernel (``cu_seqlens``: each run's queries against its
own keys, its log-sum-exp at [run, head, row] of rows padded to 32), masked ones with the same
keys' shape and rows within 2x of each other stacked as a batch into one call, rows padded with
zeros (the masks stacked too). Their results are views of the packed outputs, in the runs'
order; at most ``MOST_RUNS_A_CALL`` runs a call.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

LSE_QUERY_MULTIPLE = 32  # the memory-efficient kernel's log-sum-exp rows are padded to this
MASK_ROW_MULTIPLE = 16  # its mask rows' stride, in elements
MOST_RUNS_A_CALL = (1 << 16) - 1  # a CUDA grid's z extent, where its kernel puts the runs


@dataclass(frozen=True)
class LseKernel:
    """A device's kernel pair (see the module docstring), and ``many_forward`` /
    ``many_backward``, its many runs in few calls where the device has them (``forward_all``,
    ``backward_all`` call one or the other). ``cuda_kernel(ops)`` builds CUDA's on other ops, so
    that a CPU test can run its wrapping on an emulation of them."""

    device_type: str
    head_multiple: int
    forward: Callable[[Tensor, Tensor, Tensor, Tensor | None, float], tuple[Tensor, Tensor]]
    backward: Callable[..., tuple[Tensor, Tensor, Tensor]]
    many_forward: Callable[[list, float], list] | None = None
    many_backward: Callable[[list, float], list] | None = None

    def widened(self, width: int) -> int:
        """The head size the kernel gets for q/k and v heads of at most ``width``."""
        return -(-width // self.head_multiple) * self.head_multiple

    def forward_all(self, runs: list[tuple], scale: float) -> list[tuple[Tensor, Tensor]]:
        """(out, lse) of each run (q, k, v, mask)."""
        if self.many_forward is not None:
            return self.many_forward(runs, scale)
        return [self.forward(*run, scale) for run in runs]

    def backward_all(self, runs: list[tuple], scale: float) -> list[tuple[Tensor, Tensor, Tensor]]:
        """(dq, dk, dv) of each run (grad_out, q, k, v, out, lse, mask)."""
        if self.many_backward is not None:
            return self.many_backward(runs, scale)
        return [self.backward(*run, scale) for run in runs]


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
    """The mask as the memory-efficient kernel takes it: (B, H, M, N) in q's dtype, its start and
    its rows (batches, heads) MASK_ROW_MULTIPLE elements apart, the last dimension contiguous, a
    broadcast dimension of stride 0. The backward checks the row stride even of a single row
    (attention_backward.cu's check_supported, unlike the forward's): so every stride counts."""
    if mask is None:
        return None
    B, H, M = q.shape[:3]
    N = k.shape[2]
    mask = mask.to(q.dtype)
    # In a traced graph (dynamo cannot read a storage offset) always stored anew, padded: not
    # every compiler backend aligns it (Inductor does, for the forward)
    aligned = not torch.compiler.is_compiling() and (
        mask.storage_offset() % MASK_ROW_MULTIPLE == 0
        and all(stride % MASK_ROW_MULTIPLE == 0 for stride in mask.stride()[:-1])
    )
    if mask.stride(-1) != 1 or not aligned:
        padded = -(-N // MASK_ROW_MULTIPLE) * MASK_ROW_MULTIPLE
        stored = mask.new_zeros(*mask.shape[:-1], padded)
        stored[..., :N] = mask
        mask = stored[..., :N]
    return mask.expand(B, H, M, N)


@dataclass(frozen=True)
class _EfficientOps:
    forward: Callable = torch.ops.aten._scaled_dot_product_efficient_attention
    backward: Callable = torch.ops.aten._scaled_dot_product_efficient_attention_backward
    varlen_forward: Callable = torch.ops.aten._efficient_attention_forward
    varlen_backward: Callable = torch.ops.aten._efficient_attention_backward


def _padded_rows(rows: int) -> int:
    return -(-rows // LSE_QUERY_MULTIPLE) * LSE_QUERY_MULTIPLE


def _alone(q: Tensor, k: Tensor) -> bool:
    """A run of one sequence and head (q (1, 1, n, D)): what packing and stacking take."""
    return q.shape[:2] == (1, 1) and k.shape[:2] == (1, 1)


def _packing(runs: list[tuple]) -> tuple[list[int], list[list[int]], list[int]]:
    """Indices of runs (q, k, v, mask) packed by length (no mask), stacked (a mask: by their
    keys' shape and rows within 2x of each other, padded to the most), and called alone; a
    group of one is called alone."""
    packed: list[int] = []
    stacked: dict[tuple, list[int]] = {}
    for i, (q, k, v, mask) in enumerate(runs):
        if not _alone(q, k):
            continue
        if mask is None:
            packed.append(i)
        elif mask.shape[:2] == (1, 1):
            key = (k.shape, v.shape, q.shape[3], mask.shape[2] == 1, q.shape[2].bit_length())
            stacked.setdefault(key, []).append(i)
    if len(packed) < 2:
        packed = []
    groups = [g for g in stacked.values() if len(g) > 1]
    taken = set(packed).union(*groups)
    return packed, groups, [i for i in range(len(runs)) if i not in taken]


def _row_index(rows: list[int], width: int, device: torch.device) -> Tensor:
    """(sum rows,): row i of run r at r * width + i, made on the device from the run lengths."""
    total = sum(rows)
    run = torch.repeat_interleave(
        torch.arange(len(rows), device=device), torch.tensor(rows, device=device),
        output_size=total,
    )  # fmt: skip
    return run * width + torch.arange(total, device=device) - _offsets(rows, device)[run]


def _offsets(lengths: list[int], device: torch.device) -> Tensor:
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)


class _Packed:
    """Runs of one sequence and head, their rows one after another: (1, total, 1, D) tensors
    for the variable-length kernel, and each row's place in its run's log-sum-exp rows."""

    def __init__(self, queries: list[Tensor], keys: list[Tensor]) -> None:
        self.rows = [q.shape[2] for q in queries]
        self.keys = [k.shape[2] for k in keys]
        device = queries[0].device
        self.cu_q = _offsets(self.rows, device)
        self.cu_k = _offsets(self.keys, device)
        self.width = _padded_rows(max(self.rows))
        self.index = _row_index(self.rows, self.width, device)  # into (runs, width) lse rows

    # Both without an operation per run: on a GPU each is host work, and thousands of runs
    # made it most of a MoBA pass (H100, 16K tokens: 8068 operations per forward).
    @staticmethod
    def pack(parts: list[Tensor]) -> Tensor:
        """(1, 1, n_r, D) each -> (1, sum n_r, 1, D)."""
        whole = torch.cat(parts, dim=2)
        return whole.view(1, whole.shape[2], 1, whole.shape[3])

    @staticmethod
    def unpack(x: Tensor, lengths: list[int]) -> list[Tensor]:
        """(1, total, 1, D) -> (1, 1, n_r, D) views, one per run."""
        return list(x.reshape(1, 1, x.shape[1], x.shape[3]).split(lengths, dim=2))


class _Stacked:
    """Runs of one sequence and head stacked as a batch, (G, 1, most rows, ...), their rows
    padded with zeros: a padding row attends with a zero query and zero mask, and its output
    gradient is zero, so it adds nothing to any key's gradient; its results are dropped."""

    def __init__(self, rows: list[int], device: torch.device) -> None:
        self.rows = rows
        self.width = max(rows)
        self.index = _row_index(rows, self.width, device)

    def stack(self, parts: list[Tensor]) -> Tensor:
        """(1, 1, n_r, ...) each -> (G, 1, width, ...)."""
        whole = torch.cat(parts, dim=2)
        flat = whole.reshape(whole.shape[2], -1)
        stacked = flat.new_zeros(len(parts) * self.width, flat.shape[1])
        stacked.index_copy_(0, self.index, flat)
        return stacked.view(len(parts), 1, self.width, *parts[0].shape[3:])

    def unstack(self, x: Tensor) -> list[Tensor]:
        """(G, 1, width, ...) -> (1, 1, n_r, ...) each (views of one gather)."""
        flat = x.reshape(x.shape[0] * self.width, -1)[self.index]
        return list(flat.view(1, 1, flat.shape[0], *x.shape[3:]).split(self.rows, dim=2))


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

    def packed_forward(runs, scale):
        queries, keys, values = ([run[i] for run in runs] for i in range(3))
        p = _Packed(queries, keys)
        out, lse = ops.varlen_forward(
            p.pack(queries), p.pack(keys), p.pack(values), None, p.cu_q, p.cu_k, max(p.rows),
            max(p.keys), 0.0, 0, True, scale=scale,
        )[:2]  # fmt: skip
        lse = lse[:, 0].flatten()[p.index]  # (total,): each row's, in the runs' order
        lses = lse.view(1, 1, -1).split(p.rows, dim=2)
        return list(zip(p.unpack(out, p.rows), lses, strict=True))

    def packed_backward(runs, scale):
        g, q, k, v, out, lse = ([run[i] for run in runs] for i in range(6))
        p = _Packed(q, k)
        rows = torch.zeros(len(runs) * p.width, dtype=torch.float32, device=p.cu_q.device)
        rows[p.index] = torch.cat(lse, dim=2).flatten().float()  # each (1, 1, n_r)
        none = q[0].new_empty((), dtype=torch.long)
        dq, dk, dv = ops.varlen_backward(
            p.pack(g), p.pack(q), p.pack(k), p.pack(v), None, p.pack(out), p.cu_q, p.cu_k,
            max(p.rows), max(p.keys), rows.view(len(runs), 1, p.width), 0.0, none, none, 0,
            False, scale=scale,
        )[:3]  # fmt: skip
        return list(
            zip(p.unpack(dq, p.rows), p.unpack(dk, p.keys), p.unpack(dv, p.keys), strict=True)
        )

    def stacked(call, rows_at, row_parts, row_results, runs, scale):
        """One call on the runs stacked as a batch (``_Stacked``), each run's rows those of its
        part ``rows_at``; parts in ``row_parts`` with a row per query are stacked by rows, the
        others concatenated; results in ``row_results`` unstacked by rows, the others split."""
        counts = [run[rows_at].shape[2] for run in runs]
        s = _Stacked(counts, runs[0][rows_at].device)
        parts = []
        for i in range(len(runs[0])):
            here = [run[i] for run in runs]
            by_row = i in row_parts and all(
                x.shape[2] == n for x, n in zip(here, counts, strict=True)
            )
            parts.append(s.stack(here) if by_row else torch.cat(here))
        per_result = [
            s.unstack(x) if j in row_results else x.split(1)
            for j, x in enumerate(call(*parts, scale))
        ]
        return list(zip(*per_result, strict=True))

    def in_few_calls(single, packed_call, stacked_call, shapes, runs, scale):
        """Each run's results: packed, stacked, or alone (``_packing`` of ``shapes``, each run's
        (q, k, v, mask)), in the runs' order."""
        packed, groups, alone = _packing(shapes)
        calls = [(packed, packed_call)] if packed else []
        calls += [(group, stacked_call) for group in groups]
        # Runs (segments, or stacked batches) are the kernel grid's z axis: at most 65535 a call.
        calls = [
            (indices[start : start + MOST_RUNS_A_CALL], call)
            for indices, call in calls
            for start in range(0, len(indices), MOST_RUNS_A_CALL)
        ]
        results: list = [None] * len(runs)
        for indices, call in calls:
            done = call([runs[i] for i in indices], scale)
            for i, result in zip(indices, done, strict=True):
                results[i] = result
        for i in alone:
            results[i] = single(*runs[i], scale)
        return results

    def forward_all(runs, scale):  # runs: (q, k, v, mask); results: (out, lse)
        by_rows = functools.partial(stacked, forward, 0, (0, 3), (0, 1))
        return in_few_calls(forward, packed_forward, by_rows, runs, runs, scale)

    def backward_all(runs, scale):  # runs: (grad_out, q, k, v, out, lse, mask); (dq, dk, dv)
        by_rows = functools.partial(stacked, backward, 1, (0, 1, 4, 5, 6), (0,))
        shapes = [(q, k, v, mask) for _, q, k, v, _, _, mask in runs]
        return in_few_calls(backward, packed_backward, by_rows, shapes, runs, scale)

    return LseKernel("cuda", 8, forward, backward, forward_all, backward_all)


KERNELS = {"cpu": CPU, "cuda": cuda_kernel()}
KERNEL_DTYPES = {
    "cpu": (torch.float16, torch.bfloat16, torch.float32, torch.float64),
    "cuda": (torch.float16, torch.bfloat16, torch.float32),
}


def kernel_for(device: torch.device) -> LseKernel:
    return KERNELS[device.type]


def runs_on(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a kernel pair here runs tensors of ``dtype`` on ``device``: not on ROCm (its
    memory-efficient kernel lays out the log-sum-exp unpadded, which the wrapping does not
    read), not bfloat16 before sm80 (no such kernel there)."""
    if dtype not in KERNEL_DTYPES.get(device.type, ()):
        return False
    if device.type != "cuda":
        return True
    if torch.version.hip:
        return False
    if dtype == torch.bfloat16 and torch.cuda.is_available():
        return torch.cuda.get_device_capability(device) >= (8, 0)
    return True
