"""The oracle: dense scores in float32 (float64 for float64 inputs) and an explicit softmax.
Grouped k and v are repeated to every query head, the textbook definition of grouped-query
attention that the other backends are held to."""

from __future__ import annotations

import torch
from torch import Tensor

from ..core.autocast import float32_inside
from ..core.call import AttentionCall
from ..core.shape_cache import per_shape
from ..patterns import Pattern, query_positions
from ..patterns.compose import dense_on
from .base import (
    FLOATS,
    Backend,
    Capabilities,
    DecodeStep,
    head_index,
    key_keep,
    repeat_kv,
    step_bias,
)


@per_shape(maxsize=64)
def _every_row_has_key(pattern: Pattern, q_len: int, kv_len: int, device: torch.device) -> bool:
    return bool(dense_on(pattern, q_len, kv_len, device).any(dim=-1).all())


def exp_and_mass(scores: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """exp(scores - the row's maximum), the row's sum of it and the maximum (detached), over the
    last dim; a row of -inf only gives zeros, a sum of 0 and a maximum of -inf. The pieces from
    which softmax outputs over disjoint keys merge exactly (``blocked.merge``)."""
    peak = scores.amax(dim=-1).detach()
    exp = torch.exp(scores - torch.where(torch.isfinite(peak), peak, 0)[..., None])
    return exp, exp.sum(dim=-1), peak


def safe_softmax(scores: Tensor) -> Tensor:
    """Softmax over the last dim that gives zeros, with zero gradients, for rows of -inf only."""
    exp, total, _ = exp_and_mass(scores)
    return exp / torch.where(total > 0, total, 1)[..., None]


def attention_mask(call: AttentionCall) -> Tensor:
    """(B or 1, H or 1, Lq, Lk) bool: the pattern and the key padding."""
    if call.pattern.routed:  # chosen by content: (B, H, Lq, Lk), made for this call only
        mask = call.pattern.dense(call.q_len, call.kv_len)
    else:  # (Lq, Lk), or (1, H, Lq, Lk) for a pattern per head, once per shape
        mask = dense_on(call.pattern, call.q_len, call.kv_len, call.device)
        mask = mask if mask.dim() == 4 else mask[None, None]
    keep = key_keep(call)
    return mask if keep is None else mask & keep[:, None, None, :]


def rows_may_lack_a_key(call: AttentionCall) -> bool:
    """Whether a query row of ``attention_mask(call)`` may allow no key (a kernel that gives NaN
    for such a row needs a guard): always with padding or a pattern chosen by content, whose
    masks are the call's; for a fixed pattern, whether its dense view leaves a row (of a head)
    without a key at the call's lengths, found once per shape."""
    if call.pattern.routed or call.key_padding_mask is not None:
        return True
    return not _every_row_has_key(call.pattern, call.q_len, call.kv_len, call.device)


def score_bias(call: AttentionCall, dtype: torch.dtype) -> Tensor:
    """(H, Lq, Lk) positional bias on the dense grid."""
    q_pos = query_positions(call.q_len, call.kv_len, call.device)
    k_pos = torch.arange(call.kv_len, device=call.device)
    heads = head_index(call.q.shape[1], call.device, 2)
    return call.bias(heads, q_pos[None, :, None], k_pos[None, None, :]).to(dtype)


def masked_scores(call: AttentionCall) -> tuple[Tensor, Tensor]:
    """(scores (B, H, Lq, Lk), -inf where the pattern or the padding forbids a pair; values
    (B, H, Lk, Dv) with grouped heads repeated), in float32 (float64 for float64): the dense
    definition of the call, biases added."""
    dtype = torch.float64 if call.q.dtype == torch.float64 else torch.float32
    k, v = (repeat_kv(t.to(dtype), call.groups) for t in (call.k, call.v))
    q, k = call.score.prepare(call.q.to(dtype), k)
    scores = call.score.pairwise(q, k)  # (B, H, Lq, Lk)
    if call.bias is not None:
        scores = scores + score_bias(call, scores.dtype)
    return scores.masked_fill(~attention_mask(call), float("-inf")), v


class ReferenceBackend(Backend):
    name = "reference"
    capabilities = Capabilities(
        devices=("cpu", "cuda"),
        backward=("cpu", "cuda"),
        dtypes=(*FLOATS, torch.float64),
        patterns="any",
        scores=("dot", "additive"),
        score_bias=True,
        dropout=True,
        return_weights=True,
        routed=True,
        per_head=True,
        decode=True,
    )

    def decode_step(self, step: DecodeStep) -> Tensor:
        return reference_decode(step)

    def forward(self, call: AttentionCall) -> tuple[Tensor, Tensor]:
        # float32 as its definition says, also under torch.autocast (whose matmuls would lower
        # it: the oracle would then be the least precise backend)
        with float32_inside(call.device):
            scores, v = masked_scores(call)
            weights = safe_softmax(scores)
            dropped = (
                torch.nn.functional.dropout(weights, call.dropout_p) if call.dropout_p else weights
            )
            out = dropped @ v
        return out.to(call.q.dtype), weights


def reference_decode(step: DecodeStep) -> Tensor:
    """One step with dense float32 scores (float64 for float64) and the explicit softmax."""
    q, keys, values, key_pos, q_pos, mask = (
        step.q,
        step.keys,
        step.values,
        step.key_pos,
        step.q_pos,
        step.mask,
    )
    bias, score, dropout_p = step.bias, step.score, step.dropout_p
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    groups = q.shape[1] // keys.shape[1]
    k, v = (repeat_kv(t.to(dtype), groups) for t in (keys, values))
    qs, k = score.prepare(q.to(dtype), k)
    scores = score.pairwise(qs, k)  # (B, H, t, S)
    if bias is not None:
        key_pos = key_pos[:, None]
        scores = scores + step_bias(bias, q.shape[1], q_pos, key_pos).to(scores.dtype)
    weights = safe_softmax(scores.masked_fill(~mask, float("-inf")))
    if dropout_p:
        weights = torch.nn.functional.dropout(weights, dropout_p)
    return (weights @ v).to(q.dtype)
