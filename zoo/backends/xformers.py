"""xFormers' ``memory_efficient_attention`` with its structured attention biases, for the patterns
it runs natively: full, causal (bottom-right, as the zoo aligns), and local windows, causal or not
(``LocalAttentionFromBottomRightMask``: query at position p attends keys p - left .. p + right,
the zoo's ``window_size=(left, right)``).

Imported lazily. xFormers' wheels carry compiled operators built for one torch version; where the
package is missing, its operators do not load against the installed torch, or there is no CUDA
device, the backend reports itself unavailable with that reason and ``auto`` never takes it.
Still to do: key padding, score biases, and compositions (a window plus global tokens, merged by
log-sum-exp with ``memory_efficient_attention_partial`` and ``merge_attentions``).
"""

from __future__ import annotations

from functools import lru_cache

import torch
from torch import Tensor

from ..call import AttentionCall
from ..patterns import Causal, Full, Intersection, Local, Pattern
from .base import Backend, Capabilities


@lru_cache(maxsize=1)
def _unavailable() -> str | None:
    try:
        import xformers
        import xformers.ops as xops
    except ImportError as error:
        return f"xformers is not installed ({error}); pip install attention-zoo[xformers]"
    if not torch.cuda.is_available():
        return "xformers' memory_efficient_attention needs a CUDA device"
    probe = torch.zeros(1, 8, 1, 64, device="cuda", dtype=torch.float16)
    try:
        xops.memory_efficient_attention(probe, probe, probe)
    except Exception as error:  # operators built for another torch, or none for this GPU
        first = str(error).strip().splitlines()[0]
        return f"xformers {xformers.__version__} cannot run on torch {torch.__version__}: {first}"
    return None


def window_of(pattern: Pattern) -> tuple[int, int] | str | None:
    """(left, right) for a local window, None for full, "causal" for causal; "" if not native."""
    parts = pattern.children if isinstance(pattern, Intersection) else (pattern,)
    causal = any(isinstance(p, Causal) for p in parts)
    rest = [p for p in parts if not isinstance(p, Causal | Full)]
    if not rest:
        return "causal" if causal else None
    if len(rest) == 1 and isinstance(rest[0], Local):
        left, right = rest[0].window_size
        return (left, 0) if causal else (left, right)
    return ""


def attention_bias(pattern: Pattern):
    """The xFormers bias object for a natively supported pattern."""
    from xformers.ops.fmha import attn_bias

    window = window_of(pattern)
    if window is None:
        return None
    if window == "causal":
        return attn_bias.LowerTriangularFromBottomRightMask()
    return attn_bias.LocalAttentionFromBottomRightMask(
        window_left=window[0], window_right=window[1]
    )


class XformersBackend(Backend):
    name = "xformers"
    capabilities = Capabilities(
        devices=("cuda",),
        backward=("cuda",),
        dtypes=(torch.float32, torch.bfloat16, torch.float16),
        patterns="any",
        dropout=True,
        sparse=True,  # its local-window kernel skips the blocks outside the window
    )

    def unavailable(self) -> str | None:
        return _unavailable()

    def reason_against(self, call: AttentionCall) -> str | None:
        reason = super().reason_against(call)
        if reason is None and window_of(call.pattern) == "":
            native = "full, causal and local windows"
            reason = f"it runs {native} natively, not the pattern of {call.variant!r}"
        if reason is None and call.key_padding_mask is not None:
            reason = "it takes no key padding mask here yet"
        return reason

    def forward(self, call: AttentionCall) -> tuple[Tensor, None]:
        import xformers.ops as xops

        def bmhk(x: Tensor) -> Tensor:  # (B, H, L, D) -> (B, L, H, D), xFormers' layout
            return x.transpose(1, 2)

        out = xops.memory_efficient_attention(
            bmhk(call.q), bmhk(call.k), bmhk(call.v),
            attn_bias=attention_bias(call.pattern), p=call.dropout_p, scale=call.scale,
        )  # fmt: skip
        return out.transpose(1, 2), None
