"""The checked call: ``zoo.attention``'s arguments checked and bound into the ``AttentionCall`` a
backend receives (inputs, the pattern at this shape, encodings, padding, routed choices bound to
this call's q and k, a graph's node order); and its plan, which later calls of its signature run
without the checks (``zoo.core.call_plans``)."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ..patterns import GraphLayout, Pattern, RouteInputs, query_positions, reads_graph
from ..patterns.node_order import in_node_order
from ..positional import PositionalEncoding
from ..registry import get_encoding_spec
from .arguments import check_bool
from .call import (
    AttentionCall,
    call_score,
    check_dropout,
    check_key_padding_mask,
    check_qkv,
    unread_padding,
)
from .call_plans import PlannedCall
from .resolve import call_pattern, concrete_params, resolved_params
from .scores import AdditiveScore
from .shape_cache import new_call, per_shape

if TYPE_CHECKING:
    from ..backends.base import Backend

Encoding = str | PositionalEncoding | None


def build_encoding(
    name: str | PositionalEncoding,
    *,
    dim: int,
    num_heads: int,
    causal: bool = False,
    **params: object,
) -> PositionalEncoding:
    """A positional encoding from the registry (``zoo.list_encodings()``), or the instance given."""
    if isinstance(name, PositionalEncoding):
        if params:
            raise TypeError(
                f"parameters {sorted(params)} apply to an encoding name, not to an instance"
            )
        return name
    return get_encoding_spec(name).build(dim=dim, num_heads=num_heads, causal=causal, **params)


def check_encoding_sizes(pos: PositionalEncoding, *, dim: int, num_heads: int) -> None:
    """Refuse an encoding instance built for another module's sizes, when the module is built:
    a bias for other heads, a table of another width, a rotation its heads cannot take. A
    module's cached steps then need not check it at every step."""
    _check_bias_heads(pos, num_heads, f"the module has num_heads={num_heads}")
    if pos.kind == "embed" and pos.dim != dim:
        raise ValueError(
            f"pos={pos.name!r} was built for dim={pos.dim}, but the module has dim={dim}; "
            f"build it with dim={dim}"
        )
    if pos.kind == "rotate":
        pos.check(q_len=1, kv_len=1, head_dim=dim // num_heads)


def _check_bias_heads(pos: PositionalEncoding, num_heads: int, have: str) -> None:
    """A bias is one table or slope per head: refuse one built for another number of heads."""
    if pos.kind == "bias" and pos.num_heads != num_heads:
        raise ValueError(
            f"pos={pos.name!r} was built for {pos.num_heads} heads, but {have}; build it with "
            f"num_heads={num_heads}"
        )


@per_shape(64)  # built outside a compiled graph, as the per-shape structures
def _shared_encoding(
    name: str, dim: int, num_heads: int, causal: bool, device: torch.device
) -> PositionalEncoding:
    spec = get_encoding_spec(name)
    encoding = spec.probe(dim=dim, num_heads=num_heads, causal=causal).to(device)
    if any(True for _ in encoding.parameters()):
        raise ValueError(
            f"pos={name!r} has learned parameters, which a functional call would draw anew each "
            f"time; build it once and pass the instance: zoo.build_encoding({name!r}, dim=..., "
            "num_heads=...)"
        )
    return encoding


def attention_encoding(
    pos: Encoding, q: Tensor, k: Tensor, causal: bool
) -> PositionalEncoding | None:
    """The encoding that acts inside attention (rotate or bias kind), checked against q and k."""
    if pos is None:
        return None
    num_heads, head_dim = q.shape[1], q.shape[-1]
    if isinstance(pos, str):
        pos = _shared_encoding(pos, num_heads * head_dim, num_heads, causal, q.device)
    if not isinstance(pos, PositionalEncoding):
        raise TypeError(
            f"pos must be an encoding name or a PositionalEncoding, got {type(pos).__name__}"
        )
    if pos.kind == "embed":
        raise ValueError(
            f"pos={pos.name!r} adds a table to a model's input (kind 'embed'), not to attention; "
            "apply it to the input (zoo.MultiHeadAttention does), or use rope, alibi or t5 here"
        )
    if pos.kind == "none":
        return None
    _check_bias_heads(pos, num_heads, f"q has {num_heads}")
    pos.check(q_len=q.shape[2], kv_len=k.shape[2], head_dim=head_dim)
    # An instance's tables (ALiBi's slopes, T5's biases) are indexed by positions on q's device:
    # one left on another failed deep inside torch, after explain had said the call runs.
    # (on meta: a model loaded with assign=True, whose ALiBi makes its slopes where q is)
    held = next(itertools.chain(pos.parameters(), pos.buffers()), None)
    if held is not None and held.device not in (q.device, torch.device("meta")):
        learned = next(pos.parameters(), None) is not None  # (a name would build it anew)
        by_name = "" if learned else f", or pass its name (pos={pos.name!r})"
        raise ValueError(
            f"pos ({type(pos).__name__}) holds its tensors on {held.device}, q is on {q.device}; "
            f"move it there (pos.to(q.device)){by_name}"
        )
    return pos


def call_positions(q_len: int, kv_len: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """(query positions (Lq,), key positions (Lk,)) of a call: queries aligned to the keys'
    end, as ``zoo.attention`` documents."""
    return query_positions(q_len, kv_len, device), torch.arange(kv_len, device=device)


def check_graph_wanted(edge_index: object, pattern: Pattern, variant: object) -> None:
    """Refuse an ``edge_index`` for a pattern that reads no graph (it would be ignored)."""
    if edge_index is not None and not reads_graph(pattern):
        raise ValueError(
            f"edge_index is the graph of variant 'graph'; variant {variant!r} reads no graph"
        )


def prepare_call(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    variant: str | Pattern,
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    scale: float | None = None,
    score: AdditiveScore | None = None,
    pos: Encoding = None,
    return_weights: bool = False,
    edge_index: object = None,
    **params: object,
) -> AttentionCall:
    """Check the arguments of ``attention`` and bind them into the call a backend receives;
    a rotary encoding turns q and k here, before any backend sees them."""
    check_qkv(q, k, v)
    new_call()
    params = concrete_params(params)
    pattern = call_pattern(
        variant, causal, params, q.shape[2], k.shape[2], q.device, heads=q.shape[1]
    )
    encoding = attention_encoding(pos, q, k, causal)
    if encoding is not None and encoding.kind == "rotate":
        q, k = encoding.rotate(q, k, *call_positions(q.shape[2], k.shape[2], q.device))
    key_padding_mask = check_key_padding_mask(key_padding_mask, q.shape[0], k.shape[2], q.device)
    if key_padding_mask is not None:
        k, v = unread_padding(k, key_padding_mask), unread_padding(v, key_padding_mask)
    check_graph_wanted(edge_index, pattern, variant)
    if pattern.routed:  # blocks chosen by content, or a graph: bound here to this call
        pattern = pattern.bind(RouteInputs(q, k, key_padding_mask, causal, edge_index=edge_index))
    order = None
    bias = encoding is not None and encoding.kind == "bias"
    if isinstance(pattern, GraphLayout) and pattern.reorder and not bias:
        # The graph alone (not composed): run in its node order, outputs back in the caller's.
        pattern, order = in_node_order(pattern)
        q, k, v = order.gather(q), order.gather(k), order.gather(v)
        if key_padding_mask is not None:
            key_padding_mask = order.gather(key_padding_mask, dim=1)
    return AttentionCall(
        q=q,
        k=k,
        v=v,
        pattern=pattern,
        variant=variant if isinstance(variant, str) else type(variant).__name__,
        key_padding_mask=key_padding_mask,
        score=call_score(score, scale, q),
        dropout_p=check_dropout(dropout_p),
        bias=encoding.bias if encoding is not None and encoding.kind == "bias" else None,
        learned=tuple(encoding.parameters()) if encoding is not None else (),
        return_weights=check_bool("return_weights", return_weights),
        causal=causal,
        variant_params=resolved_params(variant, params),
        order=order,
    )


def plan_of(
    call: AttentionCall, backend: Backend, encoding: PositionalEncoding | None
) -> PlannedCall | None:
    """The plan of a checked call (``encoding``: the one that acts inside it), or None where it
    has none: a pattern chosen by content, a graph in its node order, no sequences, or an
    encoding with learned parameters. It does what ``prepare_call`` does to q, k and v (turn
    them, zero padded keys), then the backend's plan."""
    chosen = call.pattern.routed or call.pattern.one_call
    if chosen or call.order is not None or call.learned or not call.q.shape[0]:
        return None
    plan = backend.call_plan(call)
    if call.key_padding_mask is not None:
        plan = _Padded(plan, call)
    if encoding is not None and encoding.kind == "rotate":
        plan = _Rotated(encoding, call, plan)
    return plan


class _Padded:
    """A plan whose key padding is checked and whose padded keys and values are zeroed first,
    as ``prepare_call`` does."""

    def __init__(self, plan: PlannedCall, call: AttentionCall) -> None:
        self.plan, self.batch, self.kv_len = plan, call.q.shape[0], call.kv_len

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, padding: Tensor | None) -> Tensor:
        padding = check_key_padding_mask(padding, self.batch, self.kv_len, q.device)
        k, v = unread_padding(k, padding), unread_padding(v, padding)
        return self.plan(q, k, v, padding)


class _Rotated:
    """A plan whose q and k are turned first by a rotary encoding, at the call's positions."""

    def __init__(
        self, encoding: PositionalEncoding, call: AttentionCall, plan: PlannedCall
    ) -> None:
        self.rotate, self.plan = encoding.rotate, plan
        self.positions = call_positions(call.q_len, call.kv_len, call.device)

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, padding: Tensor | None) -> Tensor:
        q, k = self.rotate(q, k, *self.positions)
        return self.plan(q, k, v, padding)
