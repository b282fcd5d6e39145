"""``zoo.MultiHeadAttention``: projections, heads, and any variant on any backend."""

from __future__ import annotations

import inspect

import torch
from torch import Tensor, nn

from ..backends import Backend, backend_named
from ..core.arguments import check_bool, check_int, check_probability
from ..core.autocast import autocast_on
from ..core.call import check_key_padding_mask, unread_padded_inputs
from ..core.heads import join_heads, split_heads
from ..core.prepare import check_encoding_sizes
from ..core.scores import AdditiveScore
from ..core.valid_lens import check_valid_lens, padding_from_lengths
from ..decoding.cache import KVCache
from ..decoding.generation import module_step, new_cache
from ..functional import attention, build_encoding, resolve_pattern, resolved_params
from ..mechanisms.dispatch import check_encoding
from ..mechanisms.layer import module_mechanism
from ..parallel.sharded_module import sharded_forward
from ..parallel.shards import check_order_name
from ..patterns import Pattern
from ..positional import PositionalEncoding
from ..registry import get_module_spec, get_spec, is_mechanism_name, list_modules

SCORES = ("dot", "additive")


class MultiHeadAttention(nn.Module):
    """Multi-head attention, (B, L, dim) -> (B, L, dim), with the pattern of ``variant``.

    Args:
        dim: model width; ``num_heads`` must divide it (head_dim = dim // num_heads).
        variant: a registry name or a Pattern; ``**params`` override the variant's parameters.
            A mechanism's name (``zoo.list_mechanisms()``) builds it as the submodule
            ``mechanism`` (linformer's learned E and F live there); see ``zoo.mechanisms``.
        pos: a positional encoding, by name (``zoo.list_encodings()``) or instance, with
            ``pos_params`` overriding its parameters. Its kind says where it acts: "embed"
            encodings (sinusoidal, learned) are added to the module's inputs, x and context, each
            from position 0, before the projections; "rotate" (rope) turns q and k, and "bias"
            (alibi, t5) adds to the scores inside the kernel, both at the aligned positions.
        backend: a backend name, a Backend instance, or "auto".
        dropout: dropout on the attention weights, in training mode only.
        causal: intersect the pattern with the causal mask (a decoder).
        bias: whether the q, k, v and output projections have a bias.
        score: "dot" (scaled dot product) or "additive" (a small learned network over q and k,
            Bahdanau et al.; the reference and blocked backends compute it).
        kv_dim: width of ``context`` in cross-attention, if not ``dim``.
        num_kv_heads: key/value heads for grouped-query attention (Ainslie et al., 2023): each
            is shared by num_heads / num_kv_heads query heads, and the k and v projections
            shrink to num_kv_heads * head_dim. None (default) is num_heads (multi-head); 1 is
            multi-query attention. It must divide num_heads.

    ``forward(x, context=None, key_padding_mask=None, valid_lens=None, return_weights=False)``:
    ``context`` (B, Lk, kv_dim) makes it cross-attention: queries from x, keys and values from
    context, aligned to the context's end when the lengths differ (see ``zoo.patterns.base``).
    ``key_padding_mask`` (B, Lk) is True at padding; ``valid_lens`` (B,) counts the valid keys
    instead. Padded positions may hold anything (NaN too): the module reads them as zeros, so no
    real row's output and no gradient sees what they hold; in self-attention a padded
    position's own output is computed from that zero input. ``return_weights=True`` returns
    (output, weights (B, H, Lq, Lk)); that call runs on the reference backend, which computes
    the same attention densely and keeps the weights.
    ``edge_index`` is the graph of variant ``graph``, per call (``zoo.attention`` lists its forms).
    ``valid_lens`` may also be a list of ints, e.g. ``[3, 4]``.

    TorchScript is not supported: ``torch.jit.script`` and ``torch.jit.trace`` of a model that
    holds this module raise an error saying so (variants, backends and per-shape structures are
    Python). Compile with ``torch.compile(model)``, or export a graph that runs without Python
    with ``torch.export.export(model, args)``.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        *,
        variant: str | Pattern = "full",
        pos: str | PositionalEncoding = "none",
        pos_params: dict[str, object] | None = None,
        backend: str | Backend = "auto",
        dropout: float = 0.0,
        causal: bool = False,
        bias: bool = True,
        score: str = "dot",
        kv_dim: int | None = None,
        num_kv_heads: int | None = None,
        cp_group: object = None,
        cp_order: str = "contiguous",
        **params: object,
    ) -> None:
        super().__init__()
        check_int("dim", dim)
        check_int("num_heads", num_heads)
        if dim % num_heads:
            raise ValueError(
                f"num_heads ({num_heads}) must divide dim ({dim}); "
                f"head_dim would be {dim / num_heads}"
            )
        num_kv_heads = (
            num_heads if num_kv_heads is None else check_int("num_kv_heads", num_kv_heads)
        )
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_kv_heads ({num_kv_heads}) must divide num_heads ({num_heads}): each "
                "key/value head is shared by a group of query heads"
            )
        if score not in SCORES:
            raise ValueError(f"score must be one of {SCORES}, got {score!r}")
        self.dim, self.num_heads, self.head_dim = dim, num_heads, dim // num_heads
        self.num_kv_heads = num_kv_heads
        backend_named(backend)  # a misspelt name or a wrong type fails now, not at a forward
        check_bool("bias", bias)
        check_order_name(cp_order)
        self.backend, self.causal = backend, causal
        # A Mechanism instance given as the variant is registered once, as ``mechanism`` below:
        # as a second submodule its parameters would appear twice in the state dict, which
        # then would not load into the same module built by name.
        self.__dict__["variant"] = variant
        self.dropout = check_probability("dropout", dropout)
        # Context parallelism (zoo.parallel): x is then this rank's shard of each sequence.
        # Plain attributes, so that a training loop can set them after building the model
        # (zoo.parallel.use_context_parallel sets them on every such module of a model).
        self.cp_group, self.cp_order = cp_group, cp_order
        self.params = dict(params)
        self.mechanism = module_mechanism(  # a submodule for a mechanism, else None
            variant,
            self.params,
            num_heads=num_heads,
            head_dim=self.head_dim,
            causal=causal,
            options={"backend": backend, "dropout": self.dropout, "score": score},
            option_names=MODULE_OPTIONS,
        )
        if self.mechanism is None:
            resolve_pattern(  # fail now, not at the first forward
                variant,
                causal,
                self.params,
                options=MODULE_OPTIONS,
                options_of="the module (create_attention / zoo.MultiHeadAttention)",
            )
        kv_dim = dim if kv_dim is None else check_int("kv_dim", kv_dim)
        self.kv_dim = kv_dim
        self.q_proj = nn.Linear(dim, dim, bias=bias)
        self.k_proj = nn.Linear(kv_dim, num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(kv_dim, num_kv_heads * self.head_dim, bias=bias)
        self.out_proj = nn.Linear(dim, dim, bias=bias)
        self.score = AdditiveScore(num_heads, self.head_dim) if score == "additive" else None
        self.pos = build_encoding(
            pos, dim=dim, num_heads=num_heads, causal=causal, **(pos_params or {})
        )
        check_encoding_sizes(self.pos, dim=dim, num_heads=num_heads)
        if self.mechanism is not None:
            check_encoding(f"mechanism {self.mechanism.name!r}", self.pos)
        if self.pos.kind == "embed" and kv_dim != dim:
            raise ValueError(
                f"pos={self.pos.name!r} adds a table of width {dim} to the inputs, but context has "
                f"kv_dim={kv_dim}; use a rotate or bias encoding (rope, alibi, t5) for this module"
            )

    def __prepare_scriptable__(self) -> nn.Module:
        """torch.jit.script calls this first, on every submodule: refuse with a clear error."""
        raise RuntimeError(no_torchscript("torch.jit.script"))

    def extra_repr(self) -> str:
        """The variant with every parameter it runs with (its defaults too), so that two modules
        that look alike in a printout are alike; the options after it."""
        params = resolved_params(self.variant, self.params)
        shown = "".join(f", {k}={v!r}" for k, v in params.items())
        # a Mechanism instance prints as the submodule ``mechanism``, below the line
        variant = repr(self.variant)
        if isinstance(self.variant, nn.Module):
            variant = f"{type(self.variant).__name__} (the submodule mechanism)"
        backend = self.backend if isinstance(self.backend, str) else self.backend.name
        options = f", dropout={self.dropout}" if self.dropout else ""
        kv_heads = (
            "" if self.num_kv_heads == self.num_heads else f", num_kv_heads={self.num_kv_heads}"
        )
        return (
            f"dim={self.dim}, num_heads={self.num_heads}{kv_heads}, "
            f"variant={variant}{shown}, "
            f"causal={self.causal}, backend={backend!r}, pos={self.pos.name!r}{options}"
        )

    def new_cache(
        self,
        batch_size: int,
        max_len: int,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        static: bool = False,
        rollback: int = 0,
    ) -> KVCache:
        """A key-value cache for generating ``batch_size`` sequences of up to ``max_len`` tokens
        with this (causal) module, in its parameters' dtype and device unless given; ``static``:
        steps of fixed shapes, for a compiled step as one CUDA graph; ``rollback``: tokens a row
        may be set back beyond one (``zoo.new_cache``)."""
        if self.mechanism is not None:
            raise ValueError(
                f"new_cache: variant {self.variant!r} is a mechanism (zoo/mechanisms); decoding "
                "with a KVCache runs the masked-softmax variants only"
            )
        weight = self.k_proj.weight
        return new_cache(
            self.variant,
            batch_size=batch_size,
            max_len=max_len,
            num_kv_heads=self.num_kv_heads,
            num_heads=self.num_heads,
            head_dim=self.head_dim,
            causal=self.causal,
            dtype=weight.dtype if dtype is None else dtype,
            device=weight.device if device is None else device,
            static=static,
            rollback=rollback,
            **self.params,
        )

    def forward(
        self,
        x: Tensor,
        context: Tensor | None = None,
        key_padding_mask: Tensor | None = None,
        valid_lens: Tensor | None = None,
        return_weights: bool = False,
        cache: KVCache | None = None,
        positions: Tensor | None = None,
        edge_index: object = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        if not torch.compiler.is_compiling() and torch.jit.is_tracing():
            raise RuntimeError(no_torchscript("torch.jit.trace"))
        self._check_x(x)
        if context is None and self.kv_dim != self.dim:  # before a cached call, which has none
            raise ValueError(
                f"this module reads keys and values from context (kv_dim={self.kv_dim}), but the "
                f"call gives none, and x has the width dim={self.dim}: pass context=..., or build "
                "the module without kv_dim for self-attention (and a cache)"
            )
        if valid_lens is not None:
            valid_lens = check_valid_lens(valid_lens, x.shape[0])
        if cache is not None:
            _check_cached_call(context, key_padding_mask, return_weights)
            return module_step(self, x, cache, valid_lens, positions)
        if positions is not None:
            raise ValueError("positions apply to a call with a cache (cache=...)")
        source = x if context is None else context
        self._check_source(source, x)
        if self.cp_group is not None:  # x is this rank's shard: padding and embedding global
            return sharded_forward(self, x, context, key_padding_mask, valid_lens, return_weights)
        if valid_lens is not None:
            key_padding_mask = padding_of(valid_lens, key_padding_mask, x, source)
        if self.pos.kind == "embed":  # each sequence from its own position 0
            x = self.pos.embed(x)
            source = x if context is None else self.pos.embed(context)
        if key_padding_mask is not None:
            key_padding_mask = check_key_padding_mask(
                key_padding_mask, source.shape[0], source.shape[1], x.device
            )
            source = unread_padded_inputs(source, key_padding_mask)
            x = source if context is None else x
        q, k, v = self._heads(x, source)
        if context is None and key_padding_mask is not None and self._summarises_queries():
            q = q.masked_fill(key_padding_mask[:, None, :, None], 0)  # padding may hold NaN
        result = self._attend(q, k, v, key_padding_mask, return_weights, edge_index)
        out, weights = result if return_weights else (result, None)
        out = self.out_proj(join_heads(out))  # (B, Lq, dim)
        return (out, weights) if return_weights else out

    def _check_x(self, x: object) -> None:
        """Refuse an x that is not (batch, length, dim): the projections would fail less
        clearly."""
        if not isinstance(x, Tensor) or x.dim() != 3 or x.shape[-1] != self.dim:
            shown = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"x must have shape (batch, length, {self.dim}), got {shown}")
        weight = getattr(self.q_proj, "weight", None)  # a method in a quantized Linear
        if isinstance(weight, Tensor) and x.dtype != weight.dtype and not autocast_on(x.device):
            raise ValueError(
                f"x is {x.dtype} but the module's parameters are {weight.dtype}: convert one "
                f"(module.to({x.dtype}) or x.to({weight.dtype})), or run under torch.autocast"
            )

    def _check_source(self, source: object, x: Tensor) -> None:
        """Refuse keys and values' input (context, or x itself) that is not a tensor
        (batch, kv_len, kv_dim) of x's batch, naming the module option that sets its width."""
        if not isinstance(source, Tensor):
            raise TypeError(
                f"context must be a tensor (batch, kv_len, {self.kv_dim}), got "
                f"{type(source).__name__}"
            )
        if source.dim() != 3 or source.shape[0] != x.shape[0] or source.shape[2] != self.kv_dim:
            width = "dim" if self.kv_dim == self.dim else "kv_dim"
            raise ValueError(
                f"context must have shape ({x.shape[0]}, kv_len, {self.kv_dim}), got "
                f"{tuple(source.shape)}: its last dim is the module's {width}, {self.kv_dim} "
                "(build the module with kv_dim= for context of another width)"
            )

    def _heads(self, x: Tensor, source: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q from x, k and v from source, projected and split into heads: k and v into the
        key/value heads, which grouped-query attention shares among the query heads."""
        heads, kv_heads = self.num_heads, self.num_kv_heads
        q = split_heads(self.q_proj(x), heads)  # (B, H, Lq, hd)
        k = split_heads(self.k_proj(source), kv_heads)  # (B, H_kv, Lk, hd)
        v = split_heads(self.v_proj(source), kv_heads)
        return q, k, v

    def _summarises_queries(self) -> bool:
        """Whether the mechanism's output mixes every query row (``Mechanism.summarises_queries``):
        then a padded position's query, which may hold anything, is zeroed in self-attention."""
        return getattr(self.mechanism, "summarises_queries", False)

    def _attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        key_padding_mask: Tensor | None,
        return_weights: bool,
        edge_index: object,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """``zoo.attention`` with the module's options: the weights from the reference backend,
        which keeps them; a mechanism as the variant, its parameters already in it."""
        return attention(
            q,
            k,
            v,
            variant=self.variant if self.mechanism is None else self.mechanism,
            backend="reference" if return_weights else self.backend,
            causal=self.causal,
            key_padding_mask=key_padding_mask,
            dropout_p=self.dropout if self.training else 0.0,
            score=self.score,
            pos=self.pos if self.pos.kind in ("rotate", "bias") else None,
            return_weights=return_weights,
            edge_index=edge_index,
            cp_group=self.cp_group,
            cp_order=self.cp_order,
            **(self.params if self.mechanism is None else {}),
        )


def _check_cached_call(
    context: Tensor | None, key_padding_mask: Tensor | None, return_weights: bool
) -> None:
    """Refuse what a decoding step with a cache does not take: its keys are the cache's, its
    padding on the right (valid_lens), its weights not kept."""
    if context is not None or key_padding_mask is not None or return_weights:
        raise ValueError(
            "a call with a cache takes x and valid_lens (right padding), not context, "
            "key_padding_mask or return_weights"
        )


def padding_of(
    valid_lens: Tensor, key_padding_mask: Tensor | None, x: Tensor, source: Tensor
) -> Tensor:
    """The key padding mask that ``valid_lens`` stands for (one of the two, not both), on x's
    device, over the keys of ``source``."""
    if key_padding_mask is not None:
        raise ValueError("give key_padding_mask or valid_lens, not both")
    return padding_from_lengths(valid_lens.to(x.device), source.shape[1])


def no_torchscript(how: str, module: str = "zoo.MultiHeadAttention") -> str:
    """The refusal of TorchScript (``how``: script or trace) by a zoo module, with what to use."""
    return (
        f"{module} does not support TorchScript ({how}): its variants, backends "
        "and per-shape structures are Python; compile the model with torch.compile(model), or "
        "export a graph that runs without Python with torch.export.export(model, args)"
    )


MODULE_OPTIONS = tuple(
    p.name
    for p in inspect.signature(MultiHeadAttention.__init__).parameters.values()
    if p.kind == p.KEYWORD_ONLY
)


def create_attention(
    name: str | Pattern | nn.Module, *, dim: int, num_heads: int, **overrides: object
) -> MultiHeadAttention | nn.Module:
    """A MultiHeadAttention for a registry variant or mechanism (or a Pattern or Mechanism
    instance, as ``variant=`` takes), or the module of a ``modules:`` entry (NSA); overrides set
    module options or parameters."""
    if isinstance(name, str) and name in list_modules():
        return get_module_spec(name).build(dim=dim, num_heads=num_heads, **overrides)
    if isinstance(name, str) and not is_mechanism_name(name):
        get_spec(name)  # an unknown name fails here, with suggestions
    return MultiHeadAttention(dim, num_heads, variant=name, **overrides)
