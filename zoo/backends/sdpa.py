"""``torch.nn.functional.scaled_dot_product_attention``: FlashAttention for full and causal
attention on GPU (no mask at all), a dense boolean mask for everything else.

Causal attention of fewer queries than keys is aligned to the bottom right (the queries are the
last ones): on a GPU through ``causal_lower_right``, which FlashAttention and the efficient
kernel run without a mask; on a CPU, where that bias materialises its mask, as two kernel calls
merged by log-sum-exp (``causal_prefix``).

Grouped k and v go to SDPA as they are: without a mask with ``enable_gqa`` (its FlashAttention
and cuDNN kernels share each key/value head among its query heads); with a mask, the query heads
of a key/value head as extra query rows (``masked_sdpa``), since SDPA on CUDA runs grouped heads
with a mask on its math fallback, which repeats every key and value per query head."""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor
from torch.utils._python_dispatch import _disable_current_modes

from ..core.call import AttentionCall
from ..core.fused import fused
from ..core.shape_cache import concrete
from .base import FLOATS, Backend, Capabilities, DecodeStep, step_bias
from .blocked.index_rows import index_rows
from .causal_prefix import causal_after_prefix
from .grouped_heads import fold_groups, unfold_groups
from .reference import attention_mask, rows_may_lack_a_key, score_bias
from .split_keys import key_chunk, split_keys_attention

# SDPA is looked up at each call, here and in the blocked backend, never imported by name: tests
# and bench-overhead replace torch.nn.functional's, which an imported name would escape.


class SdpaBackend(Backend):
    name = "sdpa"
    capabilities = Capabilities(
        devices=("cpu", "cuda"),
        backward=("cpu", "cuda"),
        dtypes=(*FLOATS, torch.float64),
        patterns="any",
        score_bias=True,
        dropout=True,
        routed=True,
        per_head=True,
        decode=True,
    )

    def __init__(self, split_keys: bool = True) -> None:
        if not isinstance(split_keys, bool):
            raise TypeError(f"split_keys must be True or False, got {split_keys!r}")
        self.split_keys = split_keys

    def __repr__(self) -> str:
        return "SdpaBackend()" if self.split_keys else "SdpaBackend(split_keys=False)"

    def decode_step(self, step: DecodeStep) -> Tensor:
        return sdpa_decode(step, self.split_keys)

    def scored_pairs(self, call: AttentionCall) -> int:
        unmasked = call.key_padding_mask is None and call.bias is None and call.q_len <= call.kv_len
        if call.pattern.kind == "causal" and call.q.is_cuda and unmasked:
            # FlashAttention skips the blocks above the diagonal.
            return call.q_len * call.kv_len - call.q_len * call.q_len // 2
        return call.q_len * call.kv_len

    def forward(self, call: AttentionCall) -> tuple[Tensor, None]:
        kind = call.pattern.kind
        plain = call.key_padding_mask is None and call.bias is None
        if plain and (kind == "full" or (kind == "causal" and call.q_len == call.kv_len)):
            out = torch.nn.functional.scaled_dot_product_attention(
                call.q,
                call.k,
                call.v,
                dropout_p=call.dropout_p,
                is_causal=kind == "causal",
                scale=call.scale,
                enable_gqa=call.groups > 1,
            )
            return out, None
        lower_right = plain and kind == "causal" and call.q_len < call.kv_len
        # The CPU kernel takes no dropout, and one head size for q, k and v.
        cpu_kernel = call.dropout_p == 0 and call.v.shape[-1] == call.q.shape[-1]
        if lower_right and (call.q.is_cuda or cpu_kernel):
            return _causal_lower_right(call), None
        mask = attention_mask(call)
        # SDPA gives NaN for a row with no allowed key: let such rows see every key, then zero them
        # (two passes over the (Lq, Lk) mask, made only where a row may have none).
        has_key = None
        if rows_may_lack_a_key(call):
            has_key = mask.any(dim=-1, keepdim=True)
            mask = mask | ~has_key
        if call.bias is not None:
            bias = score_bias(call, call.q.dtype)
            mask = bias.masked_fill(~mask, float("-inf"))
        out = masked_sdpa(call.q, call.k, call.v, mask, call.dropout_p, call.scale)
        return (out if has_key is None else out * has_key), None


def _causal_lower_right(call: AttentionCall) -> Tensor:
    """Causal attention with the queries aligned to the last keys, without a dense mask."""
    if not call.q.is_cuda:
        return causal_after_prefix(call.q, call.k, call.v, call.scale)
    # Imported here: the module imports torch._dynamo, which `import zoo` must not.
    from torch.nn.attention.bias import causal_lower_right

    with _disable_current_modes():  # it holds only the lengths; under a fake mode (torch.export)
        bias = causal_lower_right(call.q_len, call.kv_len)  # its Tensor would be made fake
    return torch.nn.functional.scaled_dot_product_attention(
        call.q, call.k, call.v, attn_mask=bias, dropout_p=call.dropout_p, scale=call.scale,
        enable_gqa=call.groups > 1,
    )  # fmt: skip


def sdpa_decode(step: DecodeStep, split_keys: bool = True) -> Tensor:
    """One step on SDPA over the slots in use (``used_prefix``): with one query per row and fewer
    than half of them allowed, the allowed keys gathered first (``gather_allowed``) to the width
    the host knows bounds them (``step.most_allowed``, ``zoo.backends.base.DecodeStep``);
    otherwise the slots as they are, without a mask where the host knows every query attends
    every slot in use (``every_allowed``). With a mask, grouped query heads go in as extra query
    rows of their key/value head (``grouped_heads``), and on CUDA many slots (a static cache's)
    are split into runs side by side (``split_keys``; ``split_keys=False`` reads them in one
    piece). No device value is read on the host (each would be a synchronisation on a
    GPU)."""
    bias, scale, dropout_p = step.bias, step.score.scale, step.dropout_p
    q, q_pos = step.q, step.q_pos
    keys, values, key_pos = used_prefix(step.slots_in_use, step.keys, step.values, step.key_pos)
    if bias is None and step.every_allowed:  # every slot in use and allowed: no mask at all
        with without_cudnn(q):
            return torch.nn.functional.scaled_dot_product_attention(
                q, keys, values, dropout_p=dropout_p, scale=scale,
                enable_gqa=concrete(q.shape[1] // keys.shape[1]) > 1,
            )  # fmt: skip
    mask = step.mask_within(keys.shape[2])
    most = step.most_allowed
    gathered = None
    if q.shape[2] == 1 and most is not None:
        gathered = gather_allowed(mask[:, :, 0], keys, values, key_pos[:, None], most)
    if gathered is not None:
        mask, keys, values, key_pos = gathered
        mask = mask[:, :, None]
    else:
        key_pos = key_pos[:, None]  # (B, 1, S)
    has_key = mask.any(-1, keepdim=True)  # (B, 1 or H, t, 1)
    attn_mask = mask | ~has_key  # SDPA gives NaN on a row of no keys
    if bias is not None:
        attn_mask = (
            step_bias(bias, q.shape[1], q_pos, key_pos)
            .to(q.dtype)
            .masked_fill(~attn_mask, float("-inf"))
        )
    chunk = key_chunk(q, keys, values, attn_mask, dropout_p) if split_keys else 0
    if chunk:
        return split_keys_attention(q, keys, values, attn_mask, scale, chunk) * has_key
    with without_cudnn(q):
        out = masked_sdpa(q, keys, values, attn_mask, dropout_p, scale)
    return out * has_key


def masked_sdpa(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor, dropout_p: float, scale: float | None
) -> Tensor:
    """SDPA with a mask (bool or additive, broadcasting against (B, H, Lq, Lk)). On CUDA, or
    where the mask differs per head (a view then), grouped query heads go in as extra query
    rows of their key/value head (``grouped_heads``): SDPA on CUDA runs grouped heads with a
    mask on its math fallback, which copies every key and value per query head and materialises
    the scores; folded, its efficient kernel takes them. A mask shared by the heads is repeated
    per query head when folded, so on a CPU, whose kernel takes grouped heads with a mask, it
    is not (at 8K tokens, 8 heads on 2, that copy took 1 GB)."""
    # concrete under torch.compile: SDPA takes a Python bool for enable_gqa
    groups = concrete(q.shape[1] // k.shape[1])
    fold = groups if q.is_cuda or concrete(mask.shape[1]) != 1 else 1
    out = torch.nn.functional.scaled_dot_product_attention(
        fold_groups(q, fold), k, v, attn_mask=fold_groups(mask, fold),
        dropout_p=dropout_p, scale=scale, enable_gqa=groups > fold,
    )  # fmt: skip
    return unfold_groups(out, fold)


def without_cudnn(q: Tensor) -> contextlib.AbstractContextManager:
    """SDPA's CUDA backends that the caller left enabled, less cuDNN, for a call on CUDA whose
    key length changes from call to call (a decoding step reads one more slot each time). cuDNN
    builds an execution graph for each new shape and keeps it for that shape only: per step,
    that build costs tens of milliseconds, where the step's kernel takes microseconds (PyTorch's
    ``TORCH_CUDNN_SDPA_AVOID_RECOMPILE`` is an opt-in for the same cost). FlashAttention and the
    efficient kernel build nothing per shape.

    Only while the math backend stays enabled, which runs every step (a dtype or head size that
    neither FlashAttention nor the efficient kernel takes): a caller who turned it off keeps
    cuDNN, so that no step is left without a kernel. The flag is the process's, as
    ``sdpa_kernel`` sets it; cuDNN's alone is turned off for the call and on again after, not
    through torch's ``sdpa_kernel`` context, which sets every backend's flag in far more host
    time per step (eval/results/decode-step-ops-cpu). Eager only: under ``torch.compile`` the
    flags cannot be read, and the call is left as it is."""
    if q.device.type != "cuda" or torch.compiler.is_compiling():
        return contextlib.nullcontext()
    cuda = torch.backends.cuda
    if not cuda.cudnn_sdp_enabled() or not cuda.math_sdp_enabled():
        return contextlib.nullcontext()
    return _CUDNN_OFF


class _CudnnOff:
    """cuDNN's SDPA off inside, on again after (entered only where it was on)."""

    def __enter__(self) -> None:
        torch.backends.cuda.enable_cudnn_sdp(False)

    def __exit__(self, *exc: object) -> None:
        torch.backends.cuda.enable_cudnn_sdp(True)


_CUDNN_OFF = _CudnnOff()


def gather_allowed(
    mask: Tensor, keys: Tensor, values: Tensor, key_pos: Tensor, most: int
) -> tuple[Tensor, Tensor, Tensor, Tensor] | None:
    """For one query per row: each row's allowed slots, in slot order, packed to the front of
    ``most`` columns (the host's bound of any row's count; the columns after a row's count are
    masked); per head where the mask is (a pattern chosen by content). ``mask`` (B, L, S) with
    L = 1 or H query heads; keys and values (B, H_kv, S, D); key_pos (B, 1, S). Returns the
    packed mask (B, L, K), keys and values (B, H_kv, K, D) where L = 1, else (B, H, K, D) per
    query head, and key_pos (B, L, K); or None where the copies would be at least half of what
    the kernel reads in place (a per-head mask copies keys per query head, so it pays only where
    few are chosen).

    Without a host synchronisation: a running count of each row's allowed slots (one pass over
    the mask, int32), then the j-th allowed slot found by a binary search of j in it, for the
    ``most`` columns; the rest O(K). (``nonzero`` packed them in one pass but needs its count
    on the host.) On a GPU one compiled graph (``zoo.core.fused``), where eagerly it was some 35
    launches a step."""
    L, S = mask.shape[1:]
    width = max(min(most, S), 1)
    kv_heads = keys.shape[1]
    if 2 * width * (kv_heads if L == 1 else L) >= S * kv_heads:
        return None
    return _packed(mask, keys, values, key_pos, width)


@fused(dynamic=True)  # the slots in use and their bound change from step to step
def _packed(
    mask: Tensor, keys: Tensor, values: Tensor, key_pos: Tensor, width: int
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``gather_allowed``'s packing to ``width`` columns."""
    B, L, S = mask.shape
    kv_heads = keys.shape[1]
    # The j-th allowed slot of a row is the first where the row's running count reaches j.
    place = mask.reshape(B * L, S).cumsum(1, dtype=torch.int32)  # (B * L, S), nondecreasing
    counts = place[:, -1:]  # (B * L, 1)
    wanted = torch.arange(1, width + 1, dtype=torch.int32, device=mask.device)
    index = torch.searchsorted(place, wanted.expand(B * L, width).contiguous())  # S: past count
    index = index.clamp(max=S - 1).view(B, L, width)
    packed = (wanted <= counts).view(B, L, width)
    if L == 1:
        by_kv_head = index.expand(B, kv_heads, width)
    else:  # query head h reads key/value head h // groups: its groups' rows side by side
        by_kv_head = index.unflatten(1, (kv_heads, -1)).flatten(2, 3)  # (B, H_kv, G * K)
    # Whole rows of D (``index_rows``): a gather along S with the index expanded over D, or
    # advanced indexing, copies element by element, far slower on CPU than whole rows
    # (measured: eval/results/design-notes-cpu.md#decode-whole-rows).

    def take(t: Tensor) -> Tensor:
        return index_rows(_whole_rows(t), 2, by_kv_head).view(B, -1, width, t.shape[-1])

    return packed, take(keys), take(values), key_pos.expand(B, L, S).gather(2, index)


def used_prefix(
    width: int | None, keys: Tensor, values: Tensor, key_pos: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """The first ``width`` slots of keys, values (B, H_kv, S, D) and key_pos (B, S) (views, no
    copy; all where None): a cache that fills its slots in order (full, causal) is read only as
    far as the host knows it is filled."""
    if width is None or width >= keys.shape[2]:
        return keys, values, key_pos
    width = max(width, 1)
    return keys[:, :, :width], values[:, :, :width], key_pos[:, :width]


def _whole_rows(t: Tensor) -> Tensor:
    """Keys (B, H_kv, S, D) that are the first S slots of a contiguous store (the slots in use,
    ``zoo.decoding.decode``) as a view of the whole store, which ``index_rows`` reads without
    copying it first; any other tensor as it is. Only slots below S are then indexed."""
    B, H, S, D = t.shape
    s0, s1, s2, s3 = t.stride()
    if t.is_contiguous() or s3 != 1 or s2 != D or s1 % D or s0 != H * s1 or s1 // D < S:
        return t
    return t.as_strided((B, H, s1 // D, D), (s0, s1, s2, s3))
