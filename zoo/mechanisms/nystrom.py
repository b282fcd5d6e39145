"""``nystrom``: the Nyström approximation of softmax attention (Xiong et al., 2021).

m landmarks are the means of m contiguous segments of the queries (Q̃) and of the keys (K̃);
segment j holds the positions i with floor(i·m / n) = j (equal segments when m divides n). The
softmax matrix is approximated through them::

    out = softmax(s·Q K̃ᵀ) · pinv(softmax(s·Q̃ K̃ᵀ)) · softmax(s·Q̃ Kᵀ) · V
           (Lq, m)              (m, m)                  (m, Lk)

with s the score scale and pinv the Moore-Penrose inverse by ``pinv_iterations`` steps of the
iteration of the reference implementation (Razavi et al., 2014): Z0 = Aᵀ / (‖A‖₁‖A‖∞), then
Z <- Z (13I - AZ (15I - AZ (7I - AZ))) / 4. O(n·m·D + m³). With m = n every landmark is one
token and, with an exact inverse, out = softmax(s·QKᵀ) V. m is min(num_landmarks, Lq): not
bounded by Lk, which counts padded keys; with fewer valid keys than m each is a landmark of its
own and the empty segments are dropped (below).

Padded keys contribute nothing, whatever they hold and however many there are: the key segments
are cut over each sequence's valid keys (position i among them, of L valid: floor(i·m / L)), key
landmarks are their means (a segment with none is dropped from both inner softmaxes), and
softmax(s·Q̃ Kᵀ) masks them. Query landmarks are the means of all query rows, which a call's
key padding mask does not describe (cross-attention's queries may be as many as its keys). In
self-attention ``MultiHeadAttention`` zeroes the queries of padded positions first
(``summarises_queries``), as the reference implementation masks Q: their content, NaN too,
changes no real row, though their number thins the query landmarks. No causal form (a landmark
mixes later tokens): refused.

Parameters (published defaults): num_landmarks m = 64; pinv_iterations = 6; conv_kernel: the
reference's optional depthwise convolution over the sequence on V (one kernel per head), added
to the output: None (off) or an odd size, 33 in the paper. It is learned (module only) and needs
Lq = Lk.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from ..backends.reference import safe_softmax
from ..core.arguments import check_int
from .base import Mechanism, check_optional_int, zero_padded


def newton_schulz_pinv(a: Tensor, iterations: int) -> Tensor:
    """An approximate Moore-Penrose inverse of a (..., m, m') by the iteration above."""
    eye = torch.eye(a.shape[-2], dtype=a.dtype, device=a.device)
    norm_1 = a.abs().sum(dim=-2).amax(dim=-1)  # largest column sum
    norm_inf = a.abs().sum(dim=-1).amax(dim=-1)  # largest row sum
    z = a.transpose(-1, -2) / (norm_1 * norm_inf).clamp_min(1e-30)[..., None, None]
    for _ in range(iterations):
        az = a @ z
        z = 0.25 * z @ (13 * eye - az @ (15 * eye - az @ (7 * eye - az)))
    return z


def segment_means(x: Tensor, m: int, keep: Tensor | None) -> tuple[Tensor, Tensor]:
    """x (B, H, n, D) -> the means of m contiguous segments (B, H, m, D) and (B, m) whether
    each holds a row: of each sequence's kept rows (keep (B, n) bool; all without it), kept row
    i of L in segment floor(i·m / L); the others read as zeros (padding may hold anything)."""
    B, H, n, D = x.shape
    if keep is None:
        keep = torch.ones(B, n, dtype=torch.bool, device=x.device)
    rank = keep.cumsum(1) - 1  # (B, n): each kept row's place among its sequence's
    segment = (rank * m // keep.sum(1, keepdim=True).clamp_min(1)).clamp(0, m - 1)
    kept = torch.where(keep[:, None, :, None], x, 0.0)
    index = segment[:, None, :, None].expand(B, H, n, D)
    total = x.new_zeros(B, H, m, D).scatter_add(2, index, kept)
    count = x.new_zeros(B, m).scatter_add(1, segment, keep.to(x.dtype))
    return total / count.clamp_min(1)[:, None, :, None], count > 0


def nystrom_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    num_landmarks: int,
    scale: float,
    inverse: Callable[[Tensor], Tensor],
    key_padding_mask: Tensor | None = None,
) -> Tensor:
    """The formula above, with ``inverse`` for pinv (tests pass ``torch.linalg.pinv``)."""
    m = min(num_landmarks, q.shape[2])  # not by Lk: padded keys would change the segments
    keep = None if key_padding_mask is None else ~key_padding_mask  # (B, Lk)
    q_marks, _ = segment_means(q, m, None)
    k_marks, k_present = segment_means(k, m, keep)
    present = k_present[:, None, None, :]  # (B, 1, 1, m): landmark columns with a valid key
    kernel_1 = safe_softmax(
        torch.where(present, q @ k_marks.transpose(-1, -2) * scale, -torch.inf)
    )  # (B, H, Lq, m)
    kernel_2 = safe_softmax(
        torch.where(present, q_marks @ k_marks.transpose(-1, -2) * scale, -torch.inf)
    )  # (B, H, m, m)
    scores_3 = q_marks @ k.transpose(-1, -2) * scale  # (B, H, m, Lk)
    if keep is not None:
        scores_3 = torch.where(keep[:, None, None, :], scores_3, -torch.inf)
    kernel_3 = safe_softmax(scores_3)
    return kernel_1 @ (inverse(kernel_2) @ (kernel_3 @ v))


class NystromAttention(Mechanism):
    family = "nystrom"
    causal = False
    summarises_queries = True  # its query landmarks mix every query row

    def __init__(
        self,
        *,
        num_heads: int,
        head_dim: int,
        num_landmarks: int = 64,
        pinv_iterations: int = 6,
        conv_kernel: int | None = None,
    ) -> None:
        super().__init__(num_heads=num_heads, head_dim=head_dim)
        self.num_landmarks = check_int("num_landmarks", num_landmarks)
        self.pinv_iterations = check_int("pinv_iterations", pinv_iterations, minimum=0)
        self.conv_kernel = check_optional_int("conv_kernel", conv_kernel)
        if conv_kernel is not None and conv_kernel % 2 == 0:
            raise ValueError(f"conv_kernel must be odd (centred on each token), got {conv_kernel}")
        self.conv = None
        if conv_kernel is not None:  # (B, H, Lk, Dv) as an image of H channels
            padding = (conv_kernel // 2, 0)
            self.conv = nn.Conv2d(
                num_heads,
                num_heads,
                (conv_kernel, 1),
                padding=padding,
                groups=num_heads,
                bias=False,
            )

    def reason(self, capability: str) -> str:
        if capability == "causal":
            return "a landmark is the mean of a segment, later tokens included"
        return "conv_kernel adds a convolution of V at each query's own position"

    def check_call(
        self, *, causal: bool, q_len: int, kv_len: int, padded: bool, scaled: bool
    ) -> None:
        super().check_call(causal=causal, q_len=q_len, kv_len=kv_len, padded=padded, scaled=scaled)
        if self.conv is not None and q_len != kv_len:
            raise ValueError(
                f"mechanism {self.name!r} with conv_kernel={self.conv_kernel} needs q_len == "
                f"kv_len, got {q_len} and {kv_len}: {self.reason('cross')}"
            )

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        causal: bool,
        key_padding_mask: Tensor | None,
        scale: float,
    ) -> Tensor:
        if key_padding_mask is not None:
            k, v = zero_padded(k, key_padding_mask), zero_padded(v, key_padding_mask)
        dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        out = nystrom_attention(
            q.to(dtype),
            k.to(dtype),
            v.to(dtype),
            num_landmarks=self.num_landmarks,
            scale=scale,
            inverse=lambda a: newton_schulz_pinv(a, self.pinv_iterations),
            key_padding_mask=key_padding_mask,
        )
        if self.conv is not None:
            out = out + self.conv(v.to(self.conv.weight.dtype)).to(dtype)
        return out.to(q.dtype)

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, num_landmarks={self.num_landmarks}, "
            f"pinv_iterations={self.pinv_iterations}, conv_kernel={self.conv_kernel}"
        )
