"""FlexAttention (``torch.nn.attention.flex_attention``) with a ``BlockMask`` built from the
analytic block layout (``BlockMask.from_kv_blocks``), never by evaluating all n^2 pairs.

The pattern's ``allowed`` is the mask_mod for partial blocks, a positional bias the score_mod. The
kernel is compiled once per shape and pattern and cached by ``torch.compile``. Compiled
FlexAttention on CPU runs inference only: no backward, so training on CPU goes to another backend.
Block masks are cached per pattern and shape; a key padding mask makes the layout per sequence
(wholly padded key blocks are skipped, partly padded ones masked). A pattern that differs per
query head (``Pattern.per_head``) gives a block mask per head, cached per shape and number of
heads like the others.

A pattern of one part runs in the order where it is block-sparse (``flex_frame``): a 2-D pattern
in its grid's tiles (``zoo.layout.tiles``), a strided or dilated one with its tokens regrouped by
position mod its stride. q, k and v are gathered into that order, the mask_mod reads each slot's
position, and the output is scattered back to the caller's order. A pattern of parts in different
orders (``strided`` with its local band) runs each part in its own order, one kernel call each
with its log-sum-exp, merged by log-sum-exp (``own_orders``, ``lse_merge.merge``), where that
computes at most half the blocks of one call in the natural order, where every block a strided
part touches is partial (strided at 16K, blocks of 128: 638 blocks against all 16384). Compiled
flex on a CPU returns no log-sum-exp: there such a pattern runs as one call.

A layout chosen by content (MoBA) runs with its queries gathered by chosen key block where that
scores fewer pairs (``gathers``, ``flex_chosen``): one kernel call on FULL blocks, each query's
rows merged by log-sum-exp; else as the union of a query block's choices, the per-query choice
in the mask_mod.

Whole blocks on CPU. Compiled FlexAttention on CPU (torch 2.13) returned wrong values or NaN at
lengths that are not a multiple of 16, differently from one process to the next (see
``tests/backends/test_flex_lengths.py`` for the torch-only reproduction). On CPU the backend
therefore pads q, k and v with zeros to whole blocks, masks the padded keys out in the mask_mod
and crops the output: the kernel only ever sees whole blocks. CUDA's kernel masks its last
block itself.

``pad_to_blocks=True`` pads q, k and v to whole blocks on every device, and on CUDA declares the
lengths whole to Inductor (``IS_DIVISIBLE``: its kernel then bounds-checks no load). Inductor
declares that itself only for static multiples of 128, so the kernel of symbolic lengths that the
backend's compiled kernel runs from its second length on (``flex_kernel._compiled_kernel``)
checks every load; declared for every call, it is one compiled family for every length. Off by
default until a GPU measures what it buys (``eval/configs/bench_divisible_gpu.yaml``).

``static_lengths=True`` compiles a forward's kernel for each length on a GPU too
(``dynamic=False``, as the CPU does): no kernel of symbolic lengths, a compile for every new
length (seconds each), each pattern and length a graph of dynamo's per-function limit
(``zoo.core.fused.RECOMPILE_LIMIT``; past it flex runs eagerly, dense). Off by default: the
default keeps to two compiles for any number of lengths. A decoding step takes the default (a
growing cache would compile at every step), and the option does nothing where the kernel is not
compiled here (``compile=False``, inside a model that torch.compile traces, fake tensors). Why it
exists: on an H200 the symbolic kernel ran slower than FlexAttention compiled for the length,
with the same block mask, mask_mod and kernel options (eval/results/gpu-campaign-h200-2026-11-28-c,
bench-divisible); ``flex_static`` in that benchmark times the two kernels side by side.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from ..core.arguments import check_int
from ..core.call import AttentionCall
from ..core.call_plans import PlannedCall
from ..core.device_build import has_no_data
from ..core.shape_cache import concrete, per_shape
from ..layout.block_layout import build_layout
from ..layout.frames import Frame, build_frame
from ..patterns import EMPTY, FULL, PARTIAL, Pattern
from .base import FLOATS, Backend, Capabilities, DecodeStep
from .flex_chosen import (
    chosen_parts,
    gather_queries,
    gathered_pays,
    gathered_rows_of,
    kept_keys,
    merged_per_query,
)
from .flex_decode import flex_decode
from .flex_kernel import (
    _WHOLE_LENGTH,
    _flex_module,
    cuda_block_reason,
    flex_block_tensors,
    forward_tile,
    run_kernel,
)
from .flex_lookup import lookup_mask_mod, lookup_pays
from .lse_merge import merge


def flex_frame(pattern: Pattern, q_len: int, kv_len: int, block: int, device) -> Frame:
    """The order in which a pattern of one part is block-sparse: its grid's tiles (a 2-D
    pattern), its tokens regrouped by position mod its stride (strided, dilated: in the natural
    order every block they touch is partial, so the kernel computes and masks all n^2 pairs), or
    the natural order."""
    order = pattern.stride if len(pattern.parts()) == 1 else 1
    return build_frame(order, q_len, kv_len, block, block, device)


def _one_graph_per_shape(q: Tensor, k: Tensor, v: Tensor) -> None:
    """Under torch.compile, q's, k's and v's sizes made concrete: Inductor's lowering of the
    kernel failed on sizes that dynamo made symbolic after a change of shape ("A subgraph
    argument ... has been modified")."""
    if torch.compiler.is_compiling():
        for size in (*q.shape, *k.shape, *v.shape):
            concrete(size)


def _slot_mask(pattern: Pattern, frame: Frame, q_len: int, kv_len: int):
    """The mask_mod on the frame's slots: in the natural order the pattern's own, or on a GPU a
    table lookup where the pattern is constant on squares of positions and its own evaluates
    several families (``flex_lookup``); in a tiled order, the pattern at each slot's position,
    padding slots left out."""
    if frame.q.identity and frame.k.identity:
        device = frame.q.position.device
        looked_up = None
        if device.type != "cpu" and not pattern.routed and lookup_pays(pattern):
            looked_up = lookup_mask_mod(pattern, q_len, kv_len, device)
        return looked_up or pattern.mask_mod(q_len, kv_len)
    q_pos, k_pos, k_valid = frame.q.position, frame.k.position, frame.k.valid

    def tiled_mask(b, h, q_idx, kv_idx):
        return pattern.allowed_at(b, h, q_pos[q_idx], k_pos[kv_idx]) & k_valid[kv_idx]

    return tiled_mask


def _seq_lengths(frame: Frame, whole_blocks: bool) -> tuple[int, int]:
    if whole_blocks or not frame.q.identity:
        return frame.q.slots, frame.k.slots
    return frame.q.length, frame.k.length


def _counts(state: Tensor) -> tuple[float, float, int]:
    """(FULL, PARTIAL, all) blocks of a layout [..., Qb, Kb], per sequence and head (mean)."""
    state = state.reshape(-1, *state.shape[-2:])
    full, partial = ((state == kind).sum((1, 2)).double().mean() for kind in (FULL, PARTIAL))
    return float(full), float(partial), state.shape[1] * state.shape[2]


@per_shape(maxsize=128)
def _own_orders(
    pattern: Pattern, q_len: int, kv_len: int, block: int, device: torch.device
) -> tuple[Pattern, ...] | None:
    """``FlexBackend.own_orders``, per shape."""
    parts = pattern.parts()
    if len(parts) < 2 or pattern.routed or all(part.stride == 1 for part in parts):
        return None
    # One call's blocks as the pattern's states say, not settled on squares (build_layout):
    # every block a strided part touches in the natural order is PARTIAL, and asking each again
    # would cost more than this choice is worth.
    frame = flex_frame(pattern, q_len, kv_len, block, device)
    one = sum(_counts(pattern.block_state(frame.q.spans().column(), frame.k.spans().row()))[:2])
    own = sum(sum(_fixed_block_counts(p, q_len, kv_len, block, device)[:2]) for p in parts)
    return parts if 2 * own <= one else None


@per_shape(maxsize=128)
def _fixed_block_counts(
    pattern: Pattern, q_len: int, kv_len: int, block: int, device: torch.device
) -> tuple[float, float, int]:
    """``_counts`` of a fixed pattern's layout on flex's frame."""
    return _counts(build_layout(pattern, flex_frame(pattern, q_len, kv_len, block, device)).state)


@per_shape(maxsize=128)
def _pattern_block_mask(
    pattern: Pattern,
    q_len: int,
    kv_len: int,
    block: int,
    device: torch.device,
    whole_blocks: bool = False,
):
    """The block mask of a pattern; with ``whole_blocks`` for q, k and v padded to whole blocks
    (the frame's slots), whose padded keys the mask_mod leaves out."""
    frame = flex_frame(pattern, q_len, kv_len, block, device)
    state = build_layout(pattern, frame).state
    state = state if state.dim() == 4 else state[None]  # [1, H, ...] for a pattern per head
    mask_mod = _slot_mask(pattern, frame, q_len, kv_len)
    if whole_blocks and frame.k.identity and frame.k.slots != kv_len:
        pattern_mask = mask_mod
        # A tensor, not an int: dynamo would specialize on an int and recompile for every length.
        length = torch.tensor(kv_len, device=device)

        def mask_mod(b, h, q_idx, kv_idx):
            return pattern_mask(b, h, q_idx, kv_idx) & (kv_idx < length)

    return _flex_module().BlockMask.from_kv_blocks(
        *flex_block_tensors(state),
        BLOCK_SIZE=block,
        mask_mod=mask_mod,
        seq_lengths=_seq_lengths(frame, whole_blocks),
    )


def _padded_block_mask(call: AttentionCall, block: int, whole_blocks: bool = False):
    """A per-sequence block mask: key blocks all padding are skipped, partly padded ones masked.
    Keys past the sequence are padding slots of the frame, so ``whole_blocks`` needs nothing more.
    """
    frame = flex_frame(call.pattern, call.q_len, call.kv_len, block, call.device)
    state = build_layout(call.pattern, frame).state
    keep = frame.k.gather(~call.key_padding_mask[:, :, None])[..., 0]  # (B, slots); False: padding
    by_block = keep.view(keep.shape[0], -1, block)
    any_kept, all_kept = by_block.any(-1)[:, None, :], by_block.all(-1)[:, None, :]
    if state.dim() == 4:  # [1, H, ...] for a pattern per head: (B, 1, 1, key blocks)
        any_kept, all_kept = any_kept[:, None], all_kept[:, None]
    state = torch.where(all_kept, state, torch.clamp(state, max=PARTIAL))
    state = torch.where(any_kept, state, EMPTY)
    pattern_mask = _slot_mask(call.pattern, frame, call.q_len, call.kv_len)

    def padded_mask(b, h, q_idx, kv_idx):
        return pattern_mask(b, h, q_idx, kv_idx) & keep[b, kv_idx]

    return _flex_module().BlockMask.from_kv_blocks(
        *flex_block_tensors(state),
        BLOCK_SIZE=block,
        mask_mod=padded_mask,
        seq_lengths=_seq_lengths(frame, whole_blocks),
    )


def _routed_block_mask(call: AttentionCall, block: int, whole_blocks: bool = False):
    """A per-sequence, per-head block mask of a layout chosen by content (made per call): the
    union of each query block's chosen key blocks, the per-query choice in the mask_mod."""
    frame = build_frame(1, call.q_len, call.kv_len, block, block, call.device)
    B, H = call.q.shape[:2]
    keep = kept_keys(call, block)  # whole blocks: the keys past the sequence are padding too
    state = call.pattern.block_state(frame.q.spans().column(), frame.k.spans().row())
    by_block = keep.view(B, -1, block)
    any_kept, all_kept = by_block.any(-1)[:, None, None, :], by_block.all(-1)[:, None, None, :]
    state = torch.where(all_kept, state, torch.clamp(state, max=PARTIAL))
    state = torch.where(any_kept, state, EMPTY).expand(B, H, -1, -1)
    pattern, offset = call.pattern, call.kv_len - call.q_len

    def routed_mask(b, h, q_idx, kv_idx):
        return pattern.allowed_at(b, h, q_idx + offset, kv_idx) & keep[b, kv_idx]

    return _flex_module().BlockMask.from_kv_blocks(
        *flex_block_tensors(state),
        BLOCK_SIZE=block,
        mask_mod=routed_mask,
        seq_lengths=_seq_lengths(frame, whole_blocks),
    )


class FlexBackend(Backend):
    """FlexAttention; ``compile=False`` runs its eager (dense, unfused) path, for tests only.
    ``kernel_options``: passed to the kernel as they are (tiles, warps, stages, TMA: the levers
    FlexAttention's Triton kernel exposes on a GPU; the GPU campaign's realization stage tries
    some as named backends)."""

    name = "flex"
    capabilities = Capabilities(
        devices=("cpu", "cuda"),
        backward=("cuda",),
        dtypes=FLOATS,
        patterns="any",
        score_bias=True,
        sparse=True,
        routed=True,
        per_head=True,
        decode=True,
        padded_heads=("cuda", 16),
    )

    def __init__(
        self,
        block_size: int = 128,
        compile: bool = True,
        kernel_options: dict | None = None,
        pad_to_blocks: bool = False,
        static_lengths: bool = False,
    ) -> None:
        self.block_size = check_int("block_size", block_size)
        self.compile = compile
        if kernel_options is not None and not isinstance(kernel_options, dict):
            raise TypeError(
                f"kernel_options must be a dict of FlexAttention's kernel options (tiles "
                f"BLOCK_M, BLOCK_N, num_warps, num_stages, USE_TMA, ...), got {kernel_options!r}"
            )
        self.kernel_options = dict(kernel_options or {})
        if not isinstance(pad_to_blocks, bool):
            raise TypeError(f"pad_to_blocks must be True or False, got {pad_to_blocks!r}")
        if pad_to_blocks and self.block_size % _WHOLE_LENGTH:
            raise ValueError(
                f"pad_to_blocks=True declares the padded lengths whole in Inductor's tiles (up to "
                f"{_WHOLE_LENGTH}), so block_size must be a multiple of {_WHOLE_LENGTH}, got "
                f"block_size={self.block_size}"
            )
        self.pad_to_blocks = pad_to_blocks
        if not isinstance(static_lengths, bool):
            raise TypeError(f"static_lengths must be True or False, got {static_lengths!r}")
        self.static_lengths = static_lengths

    def __repr__(self) -> str:
        options = f", kernel_options={self.kernel_options}" if self.kernel_options else ""
        options += ", pad_to_blocks=True" if self.pad_to_blocks else ""
        options += ", static_lengths=True" if self.static_lengths else ""
        return f"FlexBackend(block_size={self.block_size}, compile={self.compile}{options})"

    def unavailable(self) -> str | None:
        try:
            _flex_module()
        except ImportError as error:
            return f"torch.nn.attention.flex_attention does not import ({error})"
        return None

    def reason_against(self, call: AttentionCall) -> str | None:
        """The capabilities' reasons, and on CUDA a block size Inductor's kernels cannot tile
        (``cuda_block_reason``)."""
        reason = super().reason_against(call)
        if reason is None and call.device.type == "cuda":
            # Inductor picks the backward's tiles by the (padded) query head size
            least = self.capabilities.head_padding(call.device, call.q.shape[-1], call.v.shape[-1])
            head = max(call.q.shape[-1], least or 0)
            reason = cuda_block_reason(self.block_size, head, call.q.dtype, call.needs_grad)
        return reason

    def whole_blocks(self, call: AttentionCall) -> bool:
        """Whether q, k and v are padded to whole blocks for this call (see the module doc): with
        ``pad_to_blocks``, and on a CPU wherever the kernel is compiled (``compiled_on_cpu``)."""
        return self.pad_to_blocks or self.compiled_on_cpu(call)

    def compiled_on_cpu(self, call: AttentionCall) -> bool:
        """Whether the kernel is compiled on a CPU for this call, by this backend or by a
        torch.compile around the call (with ``compile=False`` too): there Inductor's template
        failed on a partial block, and returns no log-sum-exp."""
        compiled = self.compile or torch.compiler.is_compiling()
        return compiled and call.device.type == "cpu"

    def block_mask(self, call: AttentionCall):
        """The BlockMask the kernel runs on: over the queries gathered by chosen key block where
        they are (``gathers``), else over the call's queries (of its one part: see
        ``own_orders``)."""
        if self.gathers(call):
            return gathered_rows_of(call, self.block_size, fuse=self.compile).block_mask
        whole = self.whole_blocks(call)
        if call.pattern.routed:
            return _routed_block_mask(call, self.block_size, whole)
        if call.key_padding_mask is None:
            return _pattern_block_mask(
                call.pattern, call.q_len, call.kv_len, self.block_size, call.device, whole
            )
        return _padded_block_mask(call, self.block_size, whole)

    def block_counts(self, call: AttentionCall) -> tuple[float, float, int]:
        """(FULL blocks, PARTIAL blocks, all blocks) of the call's block masks per sequence and
        head (their mean where the layout differs per sequence or head; summed over the parts
        where they run each in its own order, ``own_orders``), key padding aside; over the rows
        of (query, chosen block) pairs where they are gathered (``gathers``: then key padding
        included, and all blocks those of the rows' grid). In a PARTIAL block the kernel
        evaluates the mask_mod for every element."""
        parts = self.own_orders(call)
        if parts is not None:
            counts = [self.block_counts(replace(call, pattern=part)) for part in parts]
            return sum(c[0] for c in counts), sum(c[1] for c in counts), counts[0][2]
        if self.gathers(call):  # over the gathered rows
            mask = self.block_mask(call)
            full, partial = (float(n.sum(-1).double().mean()) for n in (
                mask.full_kv_num_blocks, mask.kv_num_blocks))  # fmt: skip
            return full, partial, mask.kv_indices.shape[-2] * mask.kv_indices.shape[-1]
        if not call.pattern.routed:  # per shape, built with values also for fake tensors
            return _fixed_block_counts(
                call.pattern, call.q_len, call.kv_len, self.block_size, call.device
            )
        frame = flex_frame(call.pattern, call.q_len, call.kv_len, self.block_size, call.device)
        return _counts(call.pattern.block_state(frame.q.spans().column(), frame.k.spans().row()))

    def own_orders(self, call: AttentionCall) -> tuple[Pattern, ...] | None:
        """The parts of a fixed pattern whose parts are block-sparse in different token orders
        (``strided`` with its local band), where running each part in its own order
        (``flex_frame``) and merging them by log-sum-exp computes at most half the blocks of one
        call in the natural order (in which every block a strided part touches is partial);
        else None: one call. Only where the kernel returns its log-sum-exp (``returns_lse``)."""
        if not self.returns_lse(call):
            return None
        return _own_orders(call.pattern, call.q_len, call.kv_len, self.block_size, call.device)

    def returns_lse(self, call: AttentionCall) -> bool:
        """Whether the kernel returns its log-sum-exp, with its autograd, for this call: not
        compiled on a CPU (torch 2.13: "torch.compile on CPU only supports inference and
        return_lse is not supported yet"; ``compiled_on_cpu`` says where it is), and not on fake
        CUDA tensors that record gradients (eager flex there cannot record the log-sum-exp's
        autograd: "Cannot access accelerator device"; one call has the same shapes, all a fake
        call checks)."""
        return not self.compiled_on_cpu(call) and not (call.needs_grad and has_no_data(call.q))

    def gathers(self, call: AttentionCall) -> bool:
        """Whether a layout chosen by content runs on its queries gathered by key block
        (``flex_chosen``): one ``ChosenBlocks``, alone or intersected with fixed patterns, where
        its rows' bound of scored pairs is under the whole grid (``gathered_pays``), and the
        kernel returns its log-sum-exp (``returns_lse``; elsewhere the union's mask)."""
        if not call.pattern.routed or not self.returns_lse(call):
            return False
        parts = chosen_parts(call.pattern)
        return parts is not None and gathered_pays(call, *parts, self.block_size)

    def scored_pairs(self, call: AttentionCall) -> int:
        full, partial, _ = self.block_counts(call)
        return round((full + partial) * self.block_size**2)

    def layout_note(self, call: AttentionCall) -> str:
        note = self._block_note(call)
        if self.pad_to_blocks and call.device.type == "cuda" and not self.gathers(call):
            note += "; q, k and v padded to whole blocks and declared whole (IS_DIVISIBLE)"
        tile = forward_tile(self.block_size)
        if call.device.type == "cuda" and tile is not None:
            note += (
                f"; its CUDA kernels' forward tiles of {tile} (block_size={self.block_size} is no "
                f"multiple of Inductor's 128)"
            )
        return note

    def _block_note(self, call: AttentionCall) -> str:
        if call.pattern.routed and has_no_data(call.q):
            return f"block mask of {self.block_size}: chosen by content, counted per call"
        full, partial, blocks = self.block_counts(call)
        parts = self.own_orders(call)
        split = f", {len(parts)} parts each in its own order" if parts is not None else ""
        if self.gathers(call):
            split = ", queries gathered by chosen key block"
        return (
            f"block mask of {self.block_size}{split}: {full:.4g} full and {partial:.4g} partial "
            f"of {blocks} blocks per sequence and head (the mask_mod runs per element in "
            f"partial ones)"
        )

    def forward(self, call: AttentionCall) -> tuple[Tensor, None]:
        return self._kernels(call)(call.q, call.k, call.v), None

    def call_plan(self, call: AttentionCall) -> PlannedCall:
        """The kernels on the call's block masks, found once (``_kernels``). With key padding,
        whose block mask is made from each call's mask, the forward pass per call
        (``Backend.call_plan``)."""
        if call.key_padding_mask is not None:
            return super().call_plan(call)
        return self._kernels(call)

    def _kernels(self, call: AttentionCall):
        """The call's kernel calls, as a function of q, k and v: one call, one on the queries
        gathered by chosen key block (``gathers``), or one per part in its own order
        (``own_orders``), each merged by log-sum-exp."""
        if self.gathers(call):
            return self._gathered_plan(call)
        parts = self.own_orders(call)
        if parts is None:
            return self._kernel_plan(call, lse=False)
        runs = [self._kernel_plan(replace(call, pattern=p), lse=True) for p in parts]

        def merged(q: Tensor, k: Tensor, v: Tensor, padding: None = None) -> Tensor:
            outs, lses = zip(*(run(q, k, v) for run in runs), strict=True)
            out, _ = merge(outs, lses)  # each part's share of every row (``lse_merge``)
            return out.to(q.dtype)

        return merged

    def _gathered_plan(self, call: AttentionCall):
        """The kernel on the rows of (query, chosen key block) pairs (``flex_chosen``), each
        query's rows merged by log-sum-exp, as a function of q, k and v."""
        rows = gathered_rows_of(call, self.block_size, fuse=self.compile)
        score_mod = None
        if call.bias is not None:
            bias, row_query = call.bias, rows.row_query
            offset = call.kv_len - call.q_len

            def gathered_bias(score, b, h, q_idx, kv_idx):
                return score + bias(h, row_query[b, h, q_idx] + offset, kv_idx).to(score.dtype)

            score_mod = gathered_bias
        least, kernel_args = self._kernel_args(call, score_mod, rows.block_mask)
        compiled, static = self.compile, self.static_lengths

        def run(q: Tensor, k: Tensor, v: Tensor, padding: None = None) -> Tensor:
            _one_graph_per_shape(q, k, v)
            out, lse = run_kernel(compiled, least, gather_queries(q, rows), k, v, lse=True,
                                  static_lengths=static, **kernel_args)  # fmt: skip
            return merged_per_query(out, lse, rows, q.dtype, fuse=compiled)

        return run

    def _kernel_plan(self, call: AttentionCall, lse: bool):
        """The kernel on the call's pattern in its order (``flex_frame``), as a function of q, k
        and v -> output (B, H, Lq, Dv) in the caller's order, with ``lse`` also its
        log-sum-exp (B, H, Lq)."""
        score_mod = None
        frame = flex_frame(call.pattern, call.q_len, call.kv_len, self.block_size, call.device)
        if call.bias is not None:
            bias, offset = call.bias, call.kv_len - call.q_len
            q_pos, k_pos = frame.q.position, frame.k.position

            def positional_bias(score, b, h, q_idx, kv_idx):
                return score + bias(h, q_idx + offset, kv_idx).to(score.dtype)

            def tiled_bias(score, b, h, q_idx, kv_idx):
                return score + bias(h, q_pos[q_idx], k_pos[kv_idx]).to(score.dtype)

            score_mod = positional_bias if frame.q.identity else tiled_bias
        gather = self.whole_blocks(call) or not frame.q.identity
        least, kernel_args = self._kernel_args(
            call, score_mod, self.block_mask(call), whole=self.pad_to_blocks
        )
        compiled, static, q_len = self.compile, self.static_lengths, call.q_len

        def run(q: Tensor, k: Tensor, v: Tensor, padding: None = None):
            _one_graph_per_shape(q, k, v)
            if gather:
                q, k, v = frame.q.gather(q), frame.k.gather(k), frame.k.gather(v)
                if torch.compiler.is_compiling():
                    # Inductor's CPU lowering of the kernel reads q's layout as that of a stored
                    # tensor and fails on a view of another kernel's output (the heads of a
                    # projection, say): hand it stored tensors.
                    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
            result = run_kernel(compiled, least, q, k, v, lse=lse, static_lengths=static,
                                **kernel_args)  # fmt: skip
            out, out_lse = result if lse else (result, None)
            if not frame.q.identity:
                out = frame.q.scatter(out)
                out_lse = None if out_lse is None else frame.q.scatter(out_lse, dim=-1)
            elif out.shape[-2] != q_len:
                out = out[..., :q_len, :]
                out_lse = None if out_lse is None else out_lse[..., :q_len]
            return (out, out_lse) if lse else out

        return run

    def _kernel_args(
        self, call: AttentionCall, score_mod, block_mask, whole: bool = False
    ) -> tuple[int | None, dict]:
        """(the head size q, k and v are padded to, or None; the kernel's keyword arguments) of
        a call's kernel on this block mask; ``whole``: q, k and v padded to whole blocks, which
        a CUDA kernel is told (``IS_DIVISIBLE``)."""
        least = self.capabilities.head_padding(call.device, call.q.shape[-1], call.v.shape[-1])
        declared = {"IS_DIVISIBLE": True} if whole and call.device.type == "cuda" else {}
        kernel_options = {**declared, **self.kernel_options}
        options = {"kernel_options": kernel_options} if kernel_options else {}
        kernel_args = dict(
            score_mod=score_mod, block_mask=block_mask, scale=call.scale,
            enable_gqa=call.groups > 1,  # k and v shared by each group of query heads, not copied
            **options,
        )  # fmt: skip
        return least, kernel_args

    def decode_step(self, step: DecodeStep) -> Tensor:
        """A block mask over the step's query rows and the cache's slots (``flex_decode``)."""
        sizes = step.q.shape[-1], step.values.shape[-1]
        least = self.capabilities.head_padding(step.q.device, *sizes)
        return flex_decode(step, self.block_size, self.compile, least, self.kernel_options)
