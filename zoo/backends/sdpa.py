"""``torch.nn.functional.scaled_dot_product_attention``: FlashAttention for full and causal
attention on GPU (no mask at all), a dense boolean mask for everything else.

Grouped k and v go to SDPA as they are, with ``enable_gqa``: its FlashAttention and cuDNN kernels
share each key/value head among its query heads; its math fallback (CPU, or a dense mask on some
GPUs) repeats them inside the call."""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn.functional import scaled_dot_product_attention

from ..core.call import AttentionCall
from .base import FLOATS, Backend, Capabilities
from .reference import attention_mask, score_bias


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
    )

    def scored_pairs(self, call: AttentionCall) -> int:
        unmasked = call.key_padding_mask is None and call.bias is None and call.q_len == call.kv_len
        if call.pattern.kind == "causal" and call.q.is_cuda and unmasked:
            # FlashAttention skips the blocks above the diagonal.
            return call.q_len * call.kv_len // 2
        return call.q_len * call.kv_len

    def forward(self, call: AttentionCall) -> tuple[Tensor, None]:
        kind = call.pattern.kind
        plain = call.key_padding_mask is None and call.bias is None
        if plain and (kind == "full" or (kind == "causal" and call.q_len == call.kv_len)):
            out = scaled_dot_product_attention(
                call.q,
                call.k,
                call.v,
                dropout_p=call.dropout_p,
                is_causal=kind == "causal",
                scale=call.scale,
                enable_gqa=call.groups > 1,
            )
            return out, None
        mask = attention_mask(call)
        # SDPA gives NaN for a row with no allowed key: let such rows see every key, then zero them.
        has_key = mask.any(dim=-1, keepdim=True)
        mask = mask | ~has_key
        if call.bias is not None:
            bias = score_bias(call, call.q.dtype)
            mask = bias.masked_fill(~mask, float("-inf"))
        out = scaled_dot_product_attention(
            call.q,
            call.k,
            call.v,
            attn_mask=mask,
            dropout_p=call.dropout_p,
            scale=call.scale,
            enable_gqa=call.groups > 1,
        )
        return out * has_key, None
