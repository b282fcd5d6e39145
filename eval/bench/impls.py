"""What the benchmark runs: zoo backends and the peers, set up on one point's inputs.

A *point* is (length, causal, pass) with its q, k, v and output gradient, shared by every cell at
that point. An implementation's ``setup`` builds its mask (timed on its own, after the zoo's
caches are cleared so the build is really measured) and returns the function that is timed.

Peers:
- ``sdpa_dense``: ``scaled_dot_product_attention`` with no mask, ``is_causal`` for causal points
  (FlashAttention on GPU): the dense baseline of sparsity realization.
- ``flex_standard``: ``torch.compile(flex_attention, dynamic=False)`` with the BlockMask that
  ``create_block_mask`` builds the standard way, from the variant's ``mask_mod`` (it evaluates
  the mask on all n^2 pairs). ``dynamic=False`` as the zoo's flex backend, so that the two differ
  in how the mask is built, not in the compiled kernel.
- ``xformers``: ``memory_efficient_attention`` for full and causal attention, where it imports.
- ``repeat_kv``: for grouped-query points (``kv_heads`` below ``heads``), the zoo's ``auto`` on k
  and v repeated to every query head inside the timed step, as a model without grouped-query
  support runs it (transformers' ``repeat_kv``): the form whose memory GQA must stay below.

Every peer takes grouped k and v as its kernel shares them: SDPA and FlexAttention with
``enable_gqa``, xFormers in its 5-D layout.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.nn.functional import scaled_dot_product_attention

import zoo
import zoo.backends.flex
import zoo.layout.block_layout
import zoo.layout.frames
from zoo.backends import Backend, BlockedBackend, FlexBackend, resolve_backend
from zoo.backends.base import repeat_kv
from zoo.backends.xformers import grouped_layout
from zoo.core.shape_cache import per_shape
from zoo.functional import prepare_call, resolve_pattern
from zoo.mechanisms.dispatch import is_mechanism
from zoo.patterns.compose import dense_on

from .measure import CellSkip, timed_once
from .routed import selection_ms

Run = Callable[[Tensor, Tensor, Tensor], Tensor]


@dataclass
class Point:
    """One (length, causal, pass): the inputs every cell there shares."""

    n: int
    causal: bool
    backward: bool  # the "fwd+bwd" pass
    q: Tensor  # (B, H, n, D); leaves that require grad for the backward pass
    k: Tensor
    v: Tensor
    grad_out: Tensor  # unit-variance output gradient (unused in the forward pass)
    check: bool  # n <= check_max_len: compare with the reference before timing
    references: dict = field(default_factory=dict)

    @property
    def device(self) -> torch.device:
        return self.q.device

    @property
    def grouped(self) -> bool:
        """Whether k and v have fewer heads than q (grouped-query attention)."""
        return self.k.shape[1] != self.q.shape[1]

    @property
    def pass_name(self) -> str:
        return "fwd+bwd" if self.backward else "fwd"

    def step(self, run: Run) -> list[Tensor]:
        """One measured run: the output, and dq, dk, dv for the backward pass."""
        if not self.backward:
            with torch.no_grad():
                return [run(self.q, self.k, self.v)]
        out = run(self.q, self.k, self.v)
        grads = torch.autograd.grad(out, (self.q, self.k, self.v), self.grad_out)
        return [out, *grads]

    def reference(self, variant: str, params: dict) -> list[Tensor]:
        """The reference backend in float32 on the same values, once per variant and point."""
        key = (variant, repr(sorted(params.items())))
        if key not in self.references:
            leaves = [t.detach().float().requires_grad_(self.backward) for t in (self.q, self.k)]
            leaves.append(self.v.detach().float().requires_grad_(self.backward))
            twin = Point(self.n, self.causal, self.backward, *leaves, self.grad_out.float(), False)

            def run(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
                if is_mechanism(variant):  # the same mechanism (same weights) in float32
                    mechanism = bench_mechanism(variant, *_shape_key(params, q), q.device)
                    return zoo.attention(q, k, v, variant=mechanism, causal=self.causal)
                return zoo.attention(
                    q, k, v, variant=variant, backend="reference", causal=self.causal, **params
                )

            self.references[key] = [t.detach() for t in twin.step(run)]
        return self.references[key]


@dataclass
class Prepared:
    """A set-up cell: the timed function and what its setup found."""

    run: Run
    resolved: str  # the backend that runs (auto's choice), or the peer's name
    sparse: bool  # its cost follows the computed blocks, not n^2
    mask_build_ms: float | None  # None: it builds nothing
    block_size: int | None
    block_density: float
    select_ms: float | None = None  # a choice by content, made on every call (moba)


def clear_zoo_caches() -> None:
    """Forget everything the zoo caches per shape: the next build is measured from scratch, and
    cached masks and plans no longer hold device memory."""
    zoo.backends.clear_caches()


def _build_structures(backend: Backend, call) -> None:
    """What the backend builds on first use of a shape, so that it is timed as the mask build."""
    if isinstance(backend, FlexBackend):
        backend.block_mask(call)
    elif isinstance(backend, BlockedBackend):
        backend.scored_pairs(call)  # every part's frame and layout
    elif call.pattern.kind == "sparse" and backend.name in ("sdpa", "reference"):
        dense_on(call.pattern, call.q_len, call.kv_len, call.device)


def block_density(backend: Backend, call) -> tuple[int | None, float]:
    """(block size, computed blocks / all blocks) at the backend's block size; dense: (None, 1)."""
    if not backend.capabilities.sparse:
        return None, 1.0
    block = getattr(backend, "block_size", 1)
    padded_q, padded_k = (math.ceil(x / block) * block for x in (call.q_len, call.kv_len))
    return block, backend.scored_pairs(call) / (padded_q * padded_k)


def _shape_key(params: dict, q: Tensor) -> tuple:
    return tuple(sorted(params.items())), q.shape[1], q.shape[-1]


@per_shape(16)
def bench_mechanism(
    name: str, params: tuple, heads: int, head_dim: int, device: torch.device
) -> zoo.Mechanism:
    """A mechanism as a module would hold it, its learned parameters (linformer's E and F) drawn
    from a fixed seed: the timed cell and its reference check run the same weights."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        spec = zoo.get_mechanism_spec(name)
        return spec.build(num_heads=heads, head_dim=head_dim, **dict(params)).to(device).eval()


def mechanism_setup(impl: ZooImpl, point: Point) -> Prepared:
    """A mechanism computes attention itself: only the "auto" backend runs it."""
    if impl.backend != "auto":
        reason = f"mechanism {impl.variant!r} has no backend; only backend auto runs it"
        raise CellSkip("unsupported", reason)
    try:
        mechanism = bench_mechanism(impl.variant, *_shape_key(impl.params, point.q), point.device)
        mechanism.check_call(
            causal=point.causal, q_len=point.n, kv_len=point.n, padded=False, scaled=False
        )
    except (TypeError, ValueError) as error:
        raise CellSkip("unsupported", str(error)) from error

    def run(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return zoo.attention(q, k, v, variant=mechanism, causal=point.causal)

    return Prepared(run, "mechanism", False, None, None, 1.0)


@dataclass
class ZooImpl:
    """A zoo backend by name ("auto" included) or instance, run through ``zoo.attention``; with
    ``compiled``, that call under ``torch.compile`` (the config's ``compiled_call``)."""

    name: str
    backend: str | Backend
    variant: str
    params: dict
    kind: str = "zoo"
    compiled: bool = False

    def setup(self, point: Point) -> Prepared:
        clear_zoo_caches()
        if is_mechanism(self.variant):
            return mechanism_setup(self, point)

        def build():
            try:
                call = prepare_call(
                    point.q, point.k, point.v, variant=self.variant, causal=point.causal,
                    **self.params,
                )  # fmt: skip
                backend = resolve_backend(self.backend, call)
            except ValueError as error:
                raise CellSkip("unsupported", str(error)) from error
            _build_structures(backend, call)
            return call, backend

        (call, backend), build_ms = timed_once(build, point.device)
        block, density = block_density(backend, call)

        # By name where it has one, as a user calls it ("auto" chooses again, and a plain
        # call runs its plan, ``zoo.core.call_plans``); an instance as it is.
        by_name = self.backend if isinstance(self.backend, str) else backend

        def run(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            return zoo.attention(
                q, k, v, variant=self.variant, backend=by_name, causal=point.causal, **self.params
            )

        if self.compiled:  # its first runs (the warm-up) compile
            run = torch.compile(run)
        select = None
        if call.pattern.routed:
            select = selection_ms(self.variant, self.params, point.causal, point.q, point.k)
        return Prepared(
            run, backend.name, backend.capabilities.sparse, build_ms, block, density, select
        )


@dataclass
class SdpaDense:
    """Dense SDPA without a mask (causal via is_causal): FlashAttention on GPU."""

    name: str = "sdpa_dense"
    variant: str = "full"
    params: dict = field(default_factory=dict)
    kind: str = "peer"

    def setup(self, point: Point) -> Prepared:
        def run(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            return scaled_dot_product_attention(
                q, k, v, is_causal=point.causal, enable_gqa=point.grouped
            )

        return Prepared(run, self.name, False, None, None, 1.0)


def compiled_flex_attention():
    """The zoo's compiled FlexAttention kernel with static shapes (``dynamic=False``), the
    standard way. The zoo's own calls on a GPU use its kernel of automatic dynamic shapes
    (``zoo.backends.flex_kernel._compiled_kernel``): from a sweep's second length on, goal (a)
    compares the zoo's kernel of symbolic lengths with this static one."""
    from zoo.backends.flex_kernel import _kernel

    return _kernel(True)


@dataclass
class FlexStandard:
    """Compiled FlexAttention with ``create_block_mask`` from the variant's mask_mod."""

    variant: str
    params: dict
    name: str = "flex_standard"
    kind: str = "peer"

    def setup(self, point: Point) -> Prepared:
        if point.device.type == "cpu" and point.backward:
            raise CellSkip(
                "unsupported",
                "compiled FlexAttention has no backward pass on CPU (forward only); "
                "measure fwd+bwd on CUDA",
            )
        from torch.nn.attention.flex_attention import create_block_mask

        n, device = point.n, point.device
        if resolve_pattern(self.variant, False, dict(self.params)).routed:
            raise CellSkip(
                "unsupported",
                f"{self.variant!r} is chosen by content: there is no fixed mask_mod for "
                "create_block_mask (the zoo's flex backend builds one per call)",
            )
        try:
            pattern = resolve_pattern(self.variant, point.causal, dict(self.params))
            pattern = pattern.specialize(n, n, device)
        except ValueError as error:
            raise CellSkip("unsupported", str(error)) from error
        heads = point.q.shape[1]
        pattern = pattern.for_heads(heads)  # a pattern per head (BigBird) draws each head's
        mask_mod = pattern.mask_mod(n, n)
        mask_heads = heads if pattern.per_head else None  # a mask per head, or one for all
        mask, build_ms = timed_once(
            lambda: create_block_mask(mask_mod, None, mask_heads, n, n, device=device), device
        )
        kernel = compiled_flex_attention()

        def run(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            return kernel(q, k, v, block_mask=mask, enable_gqa=point.grouped)

        return Prepared(run, self.name, True, build_ms, int(mask.BLOCK_SIZE[0]), _density(mask, n))


def _density(mask, n: int) -> float:
    """Computed blocks / all blocks of a BlockMask over an n x n grid (``BlockMask.sparsity``
    counts a grid shorter than one block wrongly)."""
    block_k = mask.BLOCK_SIZE[1]
    computed = int(mask.kv_num_blocks.sum())
    if mask.full_kv_num_blocks is not None:
        computed += int(mask.full_kv_num_blocks.sum())
    rows = mask.kv_num_blocks.numel()  # batch x heads x query blocks
    return computed / (rows * math.ceil(n / block_k))


@dataclass
class Xformers:
    """xFormers' memory-efficient attention, for full and causal attention (no mask tensor)."""

    variant: str
    params: dict
    name: str = "xformers"
    kind: str = "peer"

    def setup(self, point: Point) -> Prepared:
        try:
            import xformers.ops as xops
        except Exception as error:  # ImportError, or a broken build that fails on import
            raise CellSkip(
                "unavailable",
                f"xformers does not import ({type(error).__name__}: {error}); "
                "pip install xformers to measure it",
            ) from error
        kind = resolve_pattern(self.variant, point.causal, dict(self.params)).kind
        if kind not in ("full", "causal"):
            raise CellSkip(
                "unsupported",
                f"the xformers peer runs full and causal attention only, not the sparse "
                f"pattern of {self.variant!r}",
            )
        bias = xops.LowerTriangularMask() if kind == "causal" else None

        def run(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # xformers takes (B, L, H, D)
            out = xops.memory_efficient_attention(*grouped_layout(q, k, v), attn_bias=bias)
            return (out.flatten(2, 3) if out.dim() == 5 else out).transpose(1, 2)

        return Prepared(run, self.name, False, None, None, 1.0)


@dataclass
class RepeatKv:
    """The zoo's auto choice on k and v repeated to the query heads (the repeat is timed)."""

    variant: str
    params: dict
    name: str = "repeat_kv"
    kind: str = "peer"

    def setup(self, point: Point) -> Prepared:
        if not point.grouped:
            raise CellSkip("unsupported", "repeat_kv needs a point with kv_heads below heads")
        inner = ZooImpl("auto", "auto", self.variant, self.params).setup(point)
        groups = point.q.shape[1] // point.k.shape[1]

        def run(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            return inner.run(q, repeat_kv(k, groups), repeat_kv(v, groups))

        return Prepared(
            run, inner.resolved, inner.sparse, inner.mask_build_ms,
            inner.block_size, inner.block_density,
        )  # fmt: skip


PEERS = ("sdpa_dense", "flex_standard", "xformers", "repeat_kv")


def variant_peer(name: str, variant: str, params: dict):
    """A per-variant peer by name (sdpa_dense is per point, not per variant)."""
    peers = {"flex_standard": FlexStandard, "xformers": Xformers, "repeat_kv": RepeatKv}
    return peers[name](variant, params)
