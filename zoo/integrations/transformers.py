"""Zoo variants as Hugging Face transformers attention implementations.

>>> from zoo.integrations import transformers as zoo_hf
>>> name = zoo_hf.register("sliding_window", window_size=256)  # "zoo:sliding_window(...)"
>>> model = AutoModelForCausalLM.from_config(cfg, attn_implementation=name)
>>> model.set_attn_implementation(zoo_hf.register("bigbird", block_size=64))

``register`` puts one function under the name in transformers' ``AttentionInterface`` and the
zoo's mask function under the same name in ``AttentionMaskInterface``. The model's mask is the
outer bound and the variant chooses pairs inside it:

- decoders get the variant's causal form (``causal=True``), encoders its plain form;
- the 2-D ``attention_mask`` becomes the zoo's ``key_padding_mask``;
- a model's own sliding window (Mistral's ``config.sliding_window``, the sliding layers of hybrid
  models), where it cuts, is intersected with the variant: keys j with q - W < j <= q. A sliding
  window cache keeps only those keys; the dropped ones are put back as padding, so every pattern
  keeps its absolute positions. To let a variant reach past the window, build the model with
  ``config.sliding_window = None``. A variant that chooses its keys by content (moba) is refused
  where such a window cuts: keys beyond it would compete in the choice, and the cache has
  dropped them, so generation could not compute what the forward does.

Positions are cache indices (0 is the first token of the padded row), as in transformers' own
masks: with left padding, the absolute positions of a pattern (global tokens, block bounds) count
the padding; shift-invariant patterns (causal, local, sliding_window) do not notice. k and v go to
the zoo un-repeated (grouped-query attention), with the model's ``scaling`` and ``dropout``.

Not supported, each with an error that says so: static caches (``cache_implementation="static"``),
the cross-attention of encoder-decoder models (refused where its keys do not end with its
queries; where the two lengths are equal the mask function cannot tell it from self-attention, and
it would run the variant's pattern between the two sequences' positions, which an encoder-decoder
model does not mean: register zoo names for decoder-only and encoder-only models),
masks the zoo cannot express (extra mask functions for image tokens, packed sequences, chunked
attention, a prepared 4-D mask), soft-capping, attention sinks and position biases.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from importlib import import_module
from types import ModuleType

import torch
from torch import Tensor, nn

from ..backends import backend_named
from ..functional import attention, resolve_pattern
from ..patterns import Intersection, Local, Pattern
from ..patterns.graph import reads_graph

# AttentionInterface and AttentionMaskInterface with the mask builders of masking_utils (4.53),
# model.set_attn_implementation (4.54). Sliding-window cache layers that drop keys (4.56) and
# q_length / q_offset in place of cache_position (5.4) are handled where they exist.
MIN_TRANSFORMERS = "4.54"
# Substrings by which transformers dispatches a name to its own code (flash checks, sdpa
# fallbacks, hub kernels "org/repo", paged caches).
RESERVED = ("flash", "sdpa", "flex_attention", "eager", "paged", "/")
UNSUPPORTED_KWARGS = ("softcap", "s_aux", "position_bias")


def _transformers() -> ModuleType:
    """transformers, imported now, with a clear error where it is missing or too old."""
    try:
        transformers = import_module("transformers")
    except ImportError as error:
        raise ImportError(
            "zoo.integrations.transformers needs the transformers package, which is not "
            'installed: pip install -e ".[hf]" (or pip install "attention-zoo[hf]")'
        ) from error
    from packaging.version import Version

    if Version(transformers.__version__) < Version(MIN_TRANSFORMERS):
        raise ImportError(
            f"zoo.integrations.transformers needs transformers>={MIN_TRANSFORMERS}, found "
            f"{transformers.__version__}: pip install -U 'transformers>={MIN_TRANSFORMERS}'"
        )
    return transformers


@dataclass(frozen=True)
class ZooMask:
    """What the zoo takes from a model's mask, in place of transformers' 4-D tensor.

    Keys reach the attention at positions kv_offset .. kv_offset + kv_length - 1 and queries are
    the last q_length of them (bottom right); ``key_padding`` is (B, kv_offset + kv_length), True
    where the position is padding or was dropped by a sliding-window cache; ``window`` is the
    model's sliding window where it cuts, else None."""

    causal: bool
    window: int | None
    key_padding: Tensor | None
    kv_offset: int
    kv_length: int
    q_length: int


@dataclass(frozen=True, eq=False)
class ZooAttention:
    """The attention function registered under one name: a variant with frozen parameters."""

    name: str
    variant: str
    backend: str
    params: dict
    pattern: Pattern  # the variant with its parameters, for intersecting with a model's window

    def settings(self) -> tuple:
        """What two registrations must share to be the same: variant, backend, parameters."""
        return self.variant, self.backend, sorted(self.params.items())

    def __call__(
        self,
        module: nn.Module,
        query: Tensor,  # (B, H, Lq, D)
        key: Tensor,  # (B, H_kv, Lk, D), not repeated to H heads
        value: Tensor,  # (B, H_kv, Lk, Dv)
        attention_mask: ZooMask | None,
        dropout: float = 0.0,
        scaling: float | None = None,
        **kwargs: object,
    ) -> tuple[Tensor, None]:
        """The variant's attention, (B, Lq, H, Dv) as transformers' layers expect; no weights."""
        for option in UNSUPPORTED_KWARGS:
            if kwargs.get(option) is not None:
                raise ValueError(
                    f"attn_implementation {self.name!r}: the model passes {option}=..., which "
                    "zoo variants do not support; use 'eager' for this model (some models, as "
                    "Gemma2 with soft-capping, refuse 'sdpa' too)"
                )
        if kwargs.get("output_attentions"):  # said once per name (Python's warning filter)
            warnings.warn(
                f"attn_implementation {self.name!r} returns no attention weights "
                "(output_attentions=True gives an empty tuple); use 'eager' to get them",
                UserWarning,
                stacklevel=2,
            )
        mask = attention_mask
        if mask is None:  # a layer called without transformers' mask builders: trust its flags
            causal = kwargs.get("is_causal")
            causal = getattr(module, "is_causal", True) if causal is None else bool(causal)
            mask = ZooMask(causal, None, None, 0, key.shape[2], query.shape[2])
        elif not isinstance(mask, ZooMask):
            raise TypeError(
                f"attn_implementation {self.name!r}: attention_mask must be the 2-D padding mask "
                f"(batch, length), got a prepared {type(mask).__name__} of shape "
                f"{tuple(getattr(mask, 'shape', ()))}; pass the 2-D mask and let the model build it"
            )
        if (key.shape[2], query.shape[2]) != (mask.kv_length, mask.q_length):
            raise ValueError(
                f"attn_implementation {self.name!r}: the mask was built for {mask.q_length} "
                f"queries and {mask.kv_length} keys, the layer has {query.shape[2]} and "
                f"{key.shape[2]}"
            )
        if mask.kv_offset:  # dropped by a sliding-window cache: back as padding, at their places
            shape = (*key.shape[:2], mask.kv_offset)
            key = torch.cat([key.new_zeros(*shape, key.shape[3]), key], dim=2)
            value = torch.cat([value.new_zeros(*shape, value.shape[3]), value], dim=2)
        variant, params = self.variant, self.params
        if mask.window is not None:
            if self.pattern.routed:
                raise ValueError(
                    f"attn_implementation {self.name!r}: this layer has the model's sliding "
                    f"window of {mask.window}, and the variant chooses its keys by content among "
                    "all keys: keys beyond the window would compete in its choice, and a "
                    "sliding-window cache has dropped them, so generation could not match the "
                    "forward; build the model with config.sliding_window = None, or pick a "
                    "variant of fixed pairs"
                )
            band = (mask.window - 1, 0) if mask.causal else (mask.window, mask.window)
            variant, params = Intersection((self.pattern, Local(window_size=band))), {}
        out = attention(
            query,
            key,
            value,
            variant=variant,
            backend=self.backend,
            causal=mask.causal,
            key_padding_mask=mask.key_padding,
            dropout_p=dropout,
            scale=scaling,
            **params,
        )  # (B, H, Lq, Dv)
        return out.transpose(1, 2).contiguous(), None


def zoo_mask(
    batch_size: int,
    kv_length: int,
    kv_offset: int | Tensor = 0,
    mask_function: Callable | None = None,
    attention_mask: Tensor | None = None,
    local_size: int | None = None,
    q_length: int | None = None,
    q_offset: int | Tensor = 0,
    cache_position: Tensor | None = None,
    use_vmap: bool = False,
    config: object = None,
    **kwargs: object,
) -> ZooMask:
    """transformers' mask function (``AttentionMaskInterface``) for every zoo name: what the model
    asks for (causal or not, its sliding window, its padding) as a ``ZooMask``, in O(B * L).

    Before transformers 5.4 the queries arrive as ``cache_position``, from 5.4 as q_length and
    q_offset."""
    name = getattr(config, "_attn_implementation", "zoo")
    if q_length is None:
        q_length, q_offset = cache_position.shape[0], cache_position[0]
    q_end, kv_offset = int(q_offset) + q_length, int(kv_offset)
    if kv_offset + kv_length != q_end:
        raise ValueError(
            f"attn_implementation {name!r}: the keys cover positions {kv_offset} to "
            f"{kv_offset + kv_length - 1} but the queries end at {q_end - 1}; zoo variants need "
            "the keys to end with the queries (self-attention with the default dynamic cache): "
            "a static cache (cache_implementation='static') and the cross-attention of an "
            "encoder-decoder model (keys of another sequence) are not supported"
        )
    device = kwargs.get("device", "cpu")  # transformers 5.4 and later pass it
    for tensor in (cache_position, attention_mask):
        device = tensor.device if tensor is not None else device
    causal, window = _model_pattern(
        name, mask_function, local_size, use_vmap, batch_size, q_end, device
    )
    if window is not None and q_end - 1 < window + (0 if causal else 1):
        window = None  # the window cuts nothing at this length
    key_padding = None
    if attention_mask is not None:
        keep = attention_mask.to(device=device, dtype=torch.bool)[:, :q_end]
        keep = nn.functional.pad(keep, (0, q_end - keep.shape[1]))  # missing positions: padding
        key_padding = None if bool(keep.all()) else ~keep
    if kv_offset:
        if key_padding is None:
            key_padding = torch.zeros(batch_size, q_end, dtype=torch.bool, device=device)
        key_padding = key_padding.clone()
        key_padding[:, :kv_offset] = True
    return ZooMask(causal, window, key_padding, kv_offset, kv_length, q_length)


def _model_pattern(
    name: str,
    mask_function: Callable | None,
    local_size: int | None,
    use_vmap: bool,
    batch_size: int,
    q_end: int,
    device: object,
) -> tuple[bool, int | None]:
    """(causal, window) of the model's own mask function, or a ValueError where it is something
    else. Without a window it must be transformers' causal or bidirectional function itself; with
    one (``local_size``), it must agree with a causal (q - W < j <= q) or bidirectional
    (|q - j| <= W) sliding window on the pairs (q, q + d) near the window's edges."""
    from transformers import masking_utils

    if not use_vmap and local_size is None:
        if mask_function is masking_utils.causal_mask_function:
            return True, None
        # bidirectional masks for encoders: transformers 5.0 and later
        if mask_function is getattr(masking_utils, "bidirectional_mask_function", None):
            return False, None
    elif not use_vmap:
        w, rows = int(local_size), (batch_size, q_end, device)
        if _agrees(mask_function, (1, -1, 1 - w, -w), *rows, lambda q, k: (k <= q) & (q - k < w)):
            return True, w
        offsets = (1, -1, w, -w, w + 1, -w - 1)
        if _agrees(mask_function, offsets, *rows, lambda q, k: (q - k).abs() <= w):
            return False, w
    raise ValueError(
        f"attn_implementation {name!r}: the model asks for a mask that zoo variants cannot "
        "reproduce (not a causal, bidirectional or sliding-window mask: an extra mask function "
        "for image tokens, packed sequences in one row, chunked attention); run this model with "
        "attn_implementation='sdpa'"
    )


def _agrees(
    mask_function: Callable,
    offsets: tuple[int, ...],
    batch_size: int,
    q_end: int,
    device: object,
    expected: Callable,
) -> bool:
    """Whether ``mask_function`` equals ``expected`` on every pair (q, q + d) inside [0, q_end),
    in every row of the batch."""
    q = torch.arange(q_end, device=device)
    batch = torch.arange(batch_size, device=device)[:, None]  # (B, 1)
    head = torch.zeros(1, 1, dtype=torch.long, device=device)
    for d in offsets:
        qs = q[(q + d >= 0) & (q + d < q_end)][None, :]  # (1, n)
        got = torch.as_tensor(mask_function(batch, head, qs, qs + d), device=device).bool()
        want = expected(qs, qs + d)
        if not torch.equal(got.expand(batch_size, -1), want.expand(batch_size, -1)):
            return False
    return True


def register(
    variant: str, *, name: str | None = None, backend: str = "auto", **params: object
) -> str:
    """Register zoo ``variant`` with ``params`` (its window, say) as a transformers attention
    implementation and return its name, for ``from_pretrained(..., attn_implementation=name)``,
    ``from_config`` or ``model.set_attn_implementation(name)``.

    The name defaults to "zoo:VARIANT(param=value, ...)". Registering a name again with the same
    settings returns it; with other settings, or a name transformers reads as one of its own
    ("sdpa", "flash...", "org/repo"), is a ValueError."""
    transformers = _transformers()
    pattern = resolve_pattern(
        variant,
        False,
        params,
        options=("name", "backend"),
        options_of="zoo.integrations.transformers.register",
    )
    if reads_graph(pattern):
        raise ValueError(
            f"variant {variant!r} reads a graph per call (edge_index), which a transformers "
            "model does not pass to its attention; use zoo.MultiHeadAttention(variant='graph') "
            "in your own model, or register a fixed pattern"
        )
    backend_named(backend)  # a name, "auto" or a Backend; anything else named in a TypeError
    if name is None:
        shown = [f"{k}={v!r}" for k, v in sorted(params.items())]
        shown += [f"backend={backend!r}"] if backend != "auto" else []
        name = f"zoo:{variant}" + (f"({', '.join(shown)})" if shown else "")
        # transformers matches its words case-sensitively: backend='sdpa' is shown 'SDPA', so
        # that the name made here passes the check below (it failed its own check)
        for word in RESERVED:
            name = name.replace(word, word.upper())
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty string, got {name!r}")
    clash = [r for r in RESERVED if r in name]
    if clash:
        raise ValueError(
            f"name {name!r} contains {clash[0]!r}, by which transformers picks its own attention "
            "code; choose another name (the default is 'zoo:VARIANT')"
        )
    function = ZooAttention(name, variant, backend, dict(params), pattern)
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    registered = ALL_ATTENTION_FUNCTIONS.get(name)
    if registered is not None:
        if isinstance(registered, ZooAttention) and registered.settings() == function.settings():
            return name
        held = registered.settings() if isinstance(registered, ZooAttention) else registered
        raise ValueError(
            f"attention implementation {name!r} is already registered ({held}); register "
            f"variant {variant!r} under another name"
        )
    transformers.AttentionInterface.register(name, function)
    AttentionMaskInterface.register(name, zoo_mask)
    return name
