"""Native Sparse Attention (Yuan et al., DeepSeek, 2025): three causal branches, gated.

For each query head, with queries at t = 0 .. L-1 (self-attention, causal)::

    o = g_cmp * o_cmp + g_slc * o_slc + g_win * o_win,   g = sigmoid(W_g x_t)  (per head)

- compressed (o_cmp): keys and values mean-pooled over windows of ``block_length`` l taken every
  ``block_stride`` s (window i covers positions i*s .. i*s + l - 1; only whole windows), then an
  optional learned map (``learned_compression``: a linear map of head_dim, starting at the
  identity). Query t attends window i when the window has ended: i*s + l - 1 <= t. Padded keys
  are left out of a window's mean; a window of padding only is never attended.
- selected (o_slc): keys in blocks of ``select_block`` l'. Block j's importance for query t is
  the compressed branch's attention probability summed over the windows that overlap block j and
  over the query heads of a GQA group (so a group shares its choice). The first block and the
  ``num_local`` blocks ending at the query's own are always chosen and count toward
  ``select_count`` n; the best others by importance fill the rest (ties to the lower index;
  blocks after the query's own and blocks of padding only never). The query attends every key of
  its chosen blocks, causally. The choice gets no gradient.
- window (o_win): the query and the ``window - 1`` keys before it (``sliding_window``).

The branches run on the zoo's parts: the compressed one as a fixed pattern (``Compressed``) over
the pooled keys, the selected one as blocks chosen by content (``zoo.patterns.ChosenBlocks``), the
window as the registry's ``sliding_window``, each on the module's backend. The three branches
share q, k and v (the paper gives each its own keys and values; one projection keeps the module
comparable with MultiHeadAttention at equal parameters, plus the gates).

Published settings: l=32, s=16, l'=64, n=16, w=512 (with num_local 2).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor, nn

from ..backends import Backend, backend_named, resolve_backend
from ..core.arguments import check_bool, check_int
from ..core.call import (
    AttentionCall,
    check_key_padding_mask,
    unread_padded_inputs,
    unread_padding,
)
from ..core.heads import join_heads, split_heads
from ..core.scores import DotProduct
from ..core.valid_lens import check_valid_lens
from ..functional import attention
from ..patterns import Causal, ChosenBlocks, Intersection, Pattern, Spans
from ..patterns.base import state_from
from ..patterns.routed import top_blocks
from .multi_head import no_torchscript, padding_of


@dataclass(frozen=True)
class Compressed(Pattern):
    """Query t may attend compressed key i when window i (positions i*stride .. i*stride +
    length - 1) has ended by t. Specialized for (q_len, kv_len): ``shift`` = q_len - kv_len turns
    a bottom-right aligned query position into t."""

    length: int
    stride: int
    shift: int | None = None

    def specialize(self, q_len: int, kv_len: int, device: torch.device | None = None) -> Pattern:
        return replace(self, shift=q_len - kv_len)

    def allowed(self, q_pos: Tensor, kv_pos: Tensor) -> Tensor:
        return kv_pos * self.stride + self.length - 1 <= q_pos + self.shift

    def block_state(self, q: Spans, k: Spans) -> Tensor:
        end = self.length - 1 - self.shift
        some = k.lo * self.stride + end <= q.hi
        every = k.hi * self.stride + end <= q.lo
        return state_from(some, every, q, k)


def pool(x: Tensor, keep: Tensor, length: int, stride: int) -> tuple[Tensor, Tensor]:
    """(B, H, L, D) -> window means (B, H, N, D) over kept positions (keep (B, L)), and (B, N)
    True where a window has some kept position; N = (L - length) // stride + 1 whole windows.
    Positions not kept read as zeros (padding may hold anything: 0 * NaN would spread it)."""
    x = torch.where(keep[:, None, :, None], x, 0)
    windows = x.unfold(2, length, stride)  # (B, H, N, D, length)
    weights = keep.to(x.dtype).unfold(1, length, stride)  # (B, N, length)
    count = weights.sum(-1)  # (B, N)
    total = (windows * weights[:, None, :, None, :]).sum(-1)
    return total / count.clamp(min=1)[:, None, :, None], count > 0


def overlaps(windows: int, blocks: int, length: int, stride: int, block: int, device) -> Tensor:
    """(windows, blocks) float: 1 where window i (i*stride .. i*stride + length - 1) and block j
    (j*block .. j*block + block - 1) share a position."""
    start = torch.arange(windows, device=device)[:, None] * stride
    first = torch.arange(blocks, device=device)[None, :] * block
    return ((start < first + block) & (start + length > first)).float()


class IdentityFirst(nn.Linear):
    """A linear map that starts as the identity (weight I, bias 0), when built and when reset
    (``reset_parameters``, as after a model made on the meta device is materialised): the
    learned compression begins as the plain mean of each block."""

    def reset_parameters(self) -> None:
        super().reset_parameters()  # draws as nn.Linear does, so later modules draw as before
        nn.init.eye_(self.weight)
        nn.init.zeros_(self.bias)


class NativeSparseAttention(nn.Module):
    """NSA, (B, L, dim) -> (B, L, dim), causal self-attention; see the module docstring.

    Args:
        dim, num_heads, num_kv_heads: as ``zoo.MultiHeadAttention`` (grouped-query attention
            shares each key/value head, and the selected blocks, among a group).
        block_length, block_stride: the compressed windows (l, s).
        select_block, select_count, num_local: the selected blocks (l', n, local blocks).
        window: the sliding window's keys, the query included (w).
        learned_compression: a learned linear map on the pooled keys and values.
        backend: the backend of the three branches ("auto", or a name).
    """

    # What zoo.parallel.use_context_parallel says of it: its branches are not sharded.
    context_parallel_refusal = (
        "its compressed, selected and window branches attend within one process's sequence "
        "(a sequence of each rank's length would be attended as if whole); run it unsharded"
    )

    def __init__(
        self,
        dim: int,
        num_heads: int,
        *,
        num_kv_heads: int | None = None,
        block_length: int = 32,
        block_stride: int = 16,
        select_block: int = 64,
        select_count: int = 16,
        num_local: int = 2,
        window: int = 512,
        learned_compression: bool = False,
        causal: bool = True,
        backend: str | Backend = "auto",
        bias: bool = True,
    ) -> None:
        super().__init__()
        check_int("dim", dim)
        check_int("num_heads", num_heads)
        self.num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        check_int("num_kv_heads", self.num_kv_heads)
        if dim % num_heads or num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads must divide dim and num_kv_heads num_heads, got dim={dim}, "
                f"num_heads={num_heads}, num_kv_heads={self.num_kv_heads}"
            )
        if causal is not True:
            raise ValueError(f"NSA is defined for causal self-attention; got causal={causal!r}")
        self.length = check_int("block_length", block_length)
        self.stride = check_int("block_stride", block_stride)
        self.select_block = check_int("select_block", select_block)
        self.select_count = check_int("select_count", select_count)
        self.num_local = check_int("num_local", num_local, minimum=0)
        self.window = check_int("window", window)
        if self.select_count < self.num_local + 1:
            raise ValueError(
                f"select_count ({select_count}) must leave room for the first block and the "
                f"num_local ({num_local}) local blocks it always chooses: at least {num_local + 1}"
            )
        # A string "False" is truthy and would build what it declines; a misspelt backend would
        # fail only at the first forward.
        check_bool("bias", bias)
        check_bool("learned_compression", learned_compression)
        backend_named(backend)
        self.dim, self.num_heads, self.head_dim = dim, num_heads, dim // num_heads
        self.backend = backend
        kv_width = self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(dim, dim, bias=bias)
        self.k_proj = nn.Linear(dim, kv_width, bias=bias)
        self.v_proj = nn.Linear(dim, kv_width, bias=bias)
        self.out_proj = nn.Linear(dim, dim, bias=bias)
        self.gate = nn.Linear(dim, 3 * num_heads)  # (compressed, selected, window) per head
        self.compress_k = self.compress_v = None
        if learned_compression:
            self.compress_k = IdentityFirst(self.head_dim, self.head_dim)
            self.compress_v = IdentityFirst(self.head_dim, self.head_dim)
        self.compressed = Compressed(self.length, self.stride)

    def extra_repr(self) -> str:
        return (
            f"dim={self.dim}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
            f"block_length={self.length}, block_stride={self.stride}, "
            f"select_block={self.select_block}, select_count={self.select_count}, "
            f"num_local={self.num_local}, window={self.window}, "
            f"learned_compression={self.compress_k is not None}"
        )

    def __prepare_scriptable__(self) -> nn.Module:
        """torch.jit.script calls this first, on every submodule: refuse with a clear error."""
        raise RuntimeError(no_torchscript("torch.jit.script", "NativeSparseAttention"))

    def forward(
        self, x: Tensor, key_padding_mask: Tensor | None = None, valid_lens: Tensor | None = None
    ) -> Tensor:
        """x (B, L, dim) -> (B, L, dim); padding as ``MultiHeadAttention`` takes it: a
        ``key_padding_mask`` (B, L), True at padding, or ``valid_lens`` (B,), the real tokens of
        each row (then right padding), not both."""
        if not torch.compiler.is_compiling() and torch.jit.is_tracing():
            raise RuntimeError(no_torchscript("torch.jit.trace", "NativeSparseAttention"))
        if not isinstance(x, Tensor) or x.dim() != 3 or x.shape[-1] != self.dim:
            shown = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"x must have shape (batch, length, {self.dim}), got {shown}")
        if valid_lens is not None:
            valid_lens = check_valid_lens(valid_lens, x.shape[0])
            key_padding_mask = padding_of(valid_lens, key_padding_mask, x, x)
        # The branches pool, select blocks and invert the mask before any backend checks it: a
        # wrong shape or dtype would otherwise fail deep inside with PyTorch's own message.
        key_padding_mask = check_key_padding_mask(
            key_padding_mask, x.shape[0], x.shape[1], x.device
        )
        if key_padding_mask is not None:
            x = unread_padded_inputs(x, key_padding_mask)
        q = split_heads(self.q_proj(x), self.num_heads)
        k = split_heads(self.k_proj(x), self.num_kv_heads)
        v = split_heads(self.v_proj(x), self.num_kv_heads)
        o_cmp, p_cmp = self.compressed_branch(q, k, v, key_padding_mask)
        o_slc = self.selected_branch(q, k, v, p_cmp, key_padding_mask)
        o_win = attention(
            q, k, v, variant="sliding_window", window_size=self.window - 1, causal=True,
            key_padding_mask=key_padding_mask, backend=self.backend,
        )  # fmt: skip
        gates = torch.sigmoid(self.gate(x)).to(q.dtype)  # (B, L, 3H)
        g = gates.unflatten(-1, (3, -1)).permute(2, 0, 3, 1)[..., None]  # (3, B, H, L, 1)
        out = g[0] * o_cmp + g[1] * o_slc + g[2] * o_win  # (B, H, L, hd)
        return self.out_proj(join_heads(out))

    def compressed_branch(
        self, q: Tensor, k: Tensor, v: Tensor, padding: Tensor | None
    ) -> tuple[Tensor, Tensor | None]:
        """o_cmp (B, H, L, hd), and the attention probabilities (B, H, L, N) without gradient
        (None when the sequence is shorter than one window: no compressed key, o_cmp = 0)."""
        B, _, length, _ = q.shape
        if length < self.length:
            return torch.zeros_like(q), None
        keep = torch.ones(B, length, dtype=torch.bool, device=q.device)
        if padding is not None:
            keep = ~padding
        k_cmp, some = pool(k, keep, self.length, self.stride)
        v_cmp, _ = pool(v, keep, self.length, self.stride)
        if self.compress_k is not None:
            k_cmp, v_cmp = self.compress_k(k_cmp), self.compress_v(v_cmp)
        out = attention(
            q, k_cmp, v_cmp, variant=self.compressed, key_padding_mask=~some, backend=self.backend
        )
        with torch.no_grad():
            windows = k_cmp.shape[2]
            allowed = self.compressed.specialize(length, windows).dense(length, windows)
            allowed = allowed.to(q.device) & some[:, None, None, :]
            k_rep = k_cmp.repeat_interleave(self.num_heads // self.num_kv_heads, dim=1)
            scores = (q.float() @ k_rep.float().transpose(-1, -2)) * self.head_dim**-0.5
            scores = scores.masked_fill(~allowed, float("-inf"))
            peak = scores.amax(-1, keepdim=True)
            exp = torch.exp(scores - torch.where(torch.isfinite(peak), peak, 0))
            probs = exp / exp.sum(-1, keepdim=True).clamp(min=1e-30)
        return out, probs

    @torch.no_grad()
    def choose(
        self, p_cmp: Tensor | None, L: int, padding: Tensor | None, device: torch.device
    ) -> Tensor:
        """(B, H, L, select_count or fewer) int32 on ``device``: the selected blocks of each
        query (module docstring), as ``ChosenBlocks.picks`` holds them (``blocks`` in an empty
        slot). Without ``p_cmp`` (a sequence shorter than one compression block) only the forced
        blocks are chosen."""
        B, H = (1, 1) if p_cmp is None else p_cmp.shape[:2]
        blocks = -(-L // self.select_block)
        importance = torch.zeros(B, H, L, blocks, device=device)
        if p_cmp is not None:
            m = overlaps(p_cmp.shape[-1], blocks, self.length, self.stride, self.select_block,
                         device)  # fmt: skip
            group = self.num_heads // self.num_kv_heads
            importance = (p_cmp @ m).unflatten(1, (-1, group)).sum(2, keepdim=True)
            importance = importance.expand(-1, -1, group, -1, -1).flatten(1, 2)
        own = (torch.arange(L, device=device) // self.select_block)[:, None]
        block = torch.arange(blocks, device=device)[None, :]
        forced = (block == 0) | ((block <= own) & (block > own - self.num_local))
        available = block <= own
        if padding is not None:
            unpadded = torch.nn.functional.pad(~padding, (0, blocks * self.select_block - L))
            available = (
                available & unpadded.view(-1, blocks, self.select_block).any(-1)[:, None, None, :]
            )
        return top_blocks(importance, self.select_count, available, forced)

    def selected_branch(
        self, q: Tensor, k: Tensor, v: Tensor, p_cmp: Tensor | None, padding: Tensor | None
    ) -> Tensor:
        L = q.shape[2]
        chosen = self.choose(p_cmp, L, padding, q.device).expand(q.shape[0], q.shape[1], -1, -1)
        blocks = -(-L // self.select_block)
        pattern = Intersection((ChosenBlocks(self.select_block, chosen, blocks, 0), Causal()))
        # The call is built here, not through zoo.attention: its per-shape caches would keep
        # each call's chosen blocks alive.
        if padding is not None:
            k, v = unread_padding(k, padding), unread_padding(v, padding)
        call = AttentionCall(
            q=q, k=k, v=v, pattern=pattern, variant="nsa", key_padding_mask=padding,
            score=DotProduct(self.head_dim**-0.5), causal=True,
        )  # fmt: skip
        return resolve_backend(self.backend, call).forward(call)[0]
