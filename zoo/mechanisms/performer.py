"""``performer``: FAVOR+, positive orthogonal random features (Choromanski et al., 2021).

The softmax kernel exp(s·q·k) (s the score scale, 1/sqrt(D) by default) is estimated without
bias by m positive random features of x = sqrt(s)·x::

    φ(x) = exp(W x - |x|²/2) / sqrt(m),    W (m, D),   E_W[φ(q)·φ(k)] = exp(s·q·k)

The rows of W are drawn in blocks of D mutually orthogonal directions (the QR of a Gaussian
matrix, signs fixed so that it is Haar-distributed) and each is scaled by the norm of an
independent Gaussian D-vector, so that every row is marginally N(0, I) (the estimate stays
unbiased) while the orthogonality lowers its variance.
Attention is then the feature-map form of ``zoo.mechanisms.kernel``: non-causal by
associativity, causal by the chunked prefix form, O(n·m·Dv).

For stability each query's features are divided by their largest exp, and the keys' by the
largest among the keys that query sees (``zoo.mechanisms.kernel``: all valid keys of the head,
or causally those up to the query): both factors cancel in the normalised weights. A key whose
log-feature lies more than ~87 below that largest underflows to zero weight in float32. The
paper's code divides by one largest over the whole sequence, so that causally a later key could
round an earlier query's keys away; here it cannot.

Parameters (published defaults):
    num_features: m; None is int(D·ln D), the paper's choice (266 features for D = 64).
    seed: W is drawn from ``torch.Generator().manual_seed(seed)`` on the CPU, so one seed gives
        one W on every device.
    redraw_interval: in training, draw a new W (from seed + 1, seed + 2, ...) every that many
        forward calls; None never redraws. A module's state: a functional call refuses it.
    chunk_size: the causal chunk length (64); changes the cost, not the result.
LRA Table 1: ListOps 18.01, average 51.41.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..core.arguments import SEED_MAX, check_int, check_seed
from .base import Mechanism, check_optional_int, zero_padded
from .kernel import feature_attention


def orthogonal_features(num_features: int, dim: int, seed: int) -> Tensor:
    """W (num_features, dim) in float64: blocks of orthonormal rows, each row scaled to the norm
    of a Gaussian vector (so each row is distributed as N(0, I))."""
    generator = torch.Generator().manual_seed(seed)
    blocks = []
    for _ in range(math.ceil(num_features / dim)):
        gaussian = torch.randn(dim, dim, generator=generator, dtype=torch.float64)
        q, r = torch.linalg.qr(gaussian)
        # Signs from R's diagonal make Q Haar-distributed (uniform directions); without them
        # LAPACK's QR leans the rows, and the kernel estimate is biased
        # (measured: eval/results/design-notes-cpu.md#performer-qr-signs).
        q = q * torch.sign(torch.diagonal(r))
        blocks.append(q.T)  # rows orthonormal
    directions = torch.cat(blocks)[:num_features]
    norms = torch.randn(num_features, dim, generator=generator, dtype=torch.float64).norm(dim=1)
    return directions * norms[:, None]


def positive_features(x: Tensor, projection: Tensor, scale: float) -> Tensor:
    """φ(x) = exp(W x' - |x'|²/2) / sqrt(m), x' = sqrt(scale)·x: the unbiased estimator, with
    no stabilising factor (tests average it over draws of W)."""
    x = x * math.sqrt(scale)
    return torch.exp(x @ projection.T - (x * x).sum(-1, keepdim=True) / 2) / math.sqrt(
        projection.shape[0]
    )


class PerformerAttention(Mechanism):
    family = "performer"

    def __init__(
        self,
        *,
        num_heads: int,
        head_dim: int,
        num_features: int | None = None,
        seed: int = 0,
        redraw_interval: int | None = None,
        chunk_size: int = 64,
    ) -> None:
        super().__init__(num_heads=num_heads, head_dim=head_dim)
        default = int(head_dim * math.log(head_dim)) if head_dim > 1 else 1
        self.num_features = check_optional_int("num_features", num_features) or max(default, 1)
        self.seed = check_seed("seed", seed)
        self.redraw_interval = check_optional_int("redraw_interval", redraw_interval)
        self.chunk_size = check_int("chunk_size", chunk_size)
        self.register_buffer(
            "projection", torch.empty(self.num_features, head_dim, dtype=torch.float32)
        )
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """W drawn from ``seed`` again, the redraw schedule from its start: as built, and after a
        model made on the meta device is materialised (``to_empty``, then each module's reset)."""
        self.draws = 0  # W was drawn from seed + draws
        self.calls = 0  # forward calls in training since the last draw
        fresh = orthogonal_features(self.num_features, self.head_dim, self.seed)
        with torch.no_grad():
            self.projection.copy_(fresh)

    def get_extra_state(self) -> Tensor:
        """The redraw schedule, (draws so far, training calls since the last), saved beside the
        projection as a tensor (as every other entry of a state dict): a module restored from a
        checkpoint redraws at the same steps, from the same seeds, as the one saved."""
        return torch.tensor([self.draws, self.calls], dtype=torch.int64)

    def set_extra_state(self, state: Tensor) -> None:
        self.draws, self.calls = (int(n) for n in state.tolist())

    def _load_from_state_dict(self, state_dict, prefix, *args) -> None:
        """A state dict without the schedule (saved before it was kept) loads strictly, as the
        schedule of a module never redrawn: draws and calls 0."""
        missing = args[2]  # local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        super()._load_from_state_dict(state_dict, prefix, *args)
        key = prefix + "_extra_state"
        if key not in state_dict and key in missing:
            missing.remove(key)
            self.draws = self.calls = 0

    def call_state(self) -> str | None:
        if self.redraw_interval is None:
            return None
        return f"redraw_interval={self.redraw_interval} counts a module's training calls"

    def redraw(self) -> None:
        """Draw the next W (from seed + draws + 1)."""
        self.draws += 1
        seed = (self.seed + self.draws) % (SEED_MAX + 1)  # past 2**32 - 1, from 0 again
        fresh = orthogonal_features(self.num_features, self.head_dim, seed)
        self.projection.copy_(fresh)

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
        if self.training and self.redraw_interval is not None:
            if self.calls == self.redraw_interval:
                self.redraw()
                self.calls = 0
            self.calls += 1
        dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        w, root = self.projection.to(dtype), math.sqrt(scale)
        if key_padding_mask is not None:
            k, v = zero_padded(k, key_padding_mask), zero_padded(v, key_padding_mask)
        x_q, x_k = q.to(dtype) * root, k.to(dtype) * root
        # log φ without the 1/sqrt(m), then the stabilising factors (they cancel, see above).
        # In place where autograd allows: the (L, m) passes are what bounds the time at long n.
        log_q = x_q @ w.T  # (B, H, Lq, m)
        log_q.sub_((x_q * x_q).sum(-1, keepdim=True) / 2)
        log_q.sub_(log_q.amax(dim=-1, keepdim=True).detach())
        log_k = x_k @ w.T  # (B, H, Lk, m)
        log_k.sub_((x_k * x_k).sum(-1, keepdim=True) / 2)
        # Each key at its own largest feature (its log-scale apart): feature_attention takes
        # each query's sums relative to the largest scale among the keys that query sees.
        key_scale = log_k.amax(dim=-1).detach()  # (B, H, Lk)
        if key_padding_mask is not None:
            key_scale = key_scale.masked_fill(key_padding_mask[:, None, :], -torch.inf)
        log_k.sub_(torch.where(torch.isfinite(key_scale), key_scale, 0)[..., None])
        phi_k = log_k.exp_()
        if key_padding_mask is not None:
            phi_k = phi_k.masked_fill(key_padding_mask[:, None, :, None], 0)
        out = feature_attention(
            log_q.exp_(), phi_k, v.to(dtype), causal=causal, chunk_size=self.chunk_size,
            key_log_scale=key_scale,
        )  # fmt: skip
        return out.to(q.dtype)

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, num_features={self.num_features}, seed={self.seed}, "
            f"redraw_interval={self.redraw_interval}, chunk_size={self.chunk_size}"
        )
