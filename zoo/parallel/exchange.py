"""The exchange: key/value rows fetched from the ranks that hold them, differentiable, in two
steps so that computation runs while the messages are in flight.

Point-to-point calls only (``torch.distributed.batch_isend_irecv``), which gloo and NCCL both
run (gloo has no ``all_to_all``): each rank posts one send per peer that needs some of its rows
and one receive per peer it needs rows from, as its ``ExchangePlan`` says. ``start_keys`` posts
them and returns at once; ``finish_keys`` waits and lays the keys out in position order. The
rank's interior rows, which read only its own keys, are computed in between
(``zoo.parallel.sharded``). gloo moves the messages on its own threads and NCCL on its own
stream, so both progress during that computation.

The backward runs the same exchange the other way, split the same way: ``finish_keys``'s
backward posts the gradients of the fetched rows back to their owners, and ``start_keys``'s
waits for those of its own rows and adds them in. Autograd runs a graph's later nodes first, so
the interior rows' backward (recorded between the two) runs while those gradients travel.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from ..core.narrowed import narrowed


class Pending:
    """Messages posted and not yet waited for: a tensor sent to each peer of ``outgoing`` and
    one of shape ``incoming[peer]`` (``like``'s dtype and device) received from each peer of
    ``incoming``; peers are ranks within ``group``."""

    def __init__(
        self, outgoing: dict[int, Tensor], incoming: dict[int, tuple[int, ...]], like: Tensor,
        group,
    ) -> None:  # fmt: skip
        self.received = {p: like.new_empty(shape) for p, shape in incoming.items()}
        # Held until the wait: a send may read its tensor until then (NCCL does, on its stream).
        self._sent = [t.contiguous() for t in outgoing.values()]
        ops = [
            dist.P2POp(dist.isend, t, dist.get_global_rank(group, p), group)
            for p, t in zip(outgoing, self._sent, strict=True)
        ]
        ops += [
            dist.P2POp(dist.irecv, t, dist.get_global_rank(group, p), group)
            for p, t in self.received.items()
        ]
        self._requests = dist.batch_isend_irecv(ops) if ops else []

    def wait(self) -> dict[int, Tensor]:
        """peer -> the tensor received from it, once every message of the batch has arrived."""
        for request in self._requests:
            request.wait()
        self._requests, self._sent = [], []
        return self.received


def swap(
    outgoing: dict[int, Tensor], incoming: dict[int, tuple[int, ...]], like: Tensor, group
) -> dict[int, Tensor]:
    """``Pending`` messages, waited for at once."""
    return Pending(outgoing, incoming, like, group).wait()


def _post_rows(
    local: tuple[Tensor, ...], sends: dict, fetch: dict, group, send_pairs=None, fetch_pairs=None
) -> Pending:
    """Post the rows of (B, H, s, E_i) ``local`` tensors (keys and values: side by side in one
    message per peer, (B, H, n, sum E_i)) that each peer fetches from this rank, and the
    receives of the rows this rank fetches from each peer. ``send_pairs`` and ``fetch_pairs``:
    peer -> (head, row) index pairs where only those (heads, rows) travel, as (B, P, E)."""
    send_pairs, fetch_pairs = send_pairs or {}, fetch_pairs or {}
    outgoing = {p: _side_by_side([_selected(x, rows, send_pairs.get(p)) for x in local])
                for p, rows in sends.items()}  # fmt: skip
    shape = (*local[0].shape[:3], sum(x.shape[3] for x in local))
    incoming = {p: _shape(shape, rows, fetch_pairs.get(p)) for p, rows in fetch.items()}
    return Pending(outgoing, incoming, local[0], group)


def _side_by_side(parts: list[Tensor]) -> Tensor:
    """Only the rows that travel are copied together (not the whole shard)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)


def _selected(x: Tensor, rows: Tensor, pairs) -> Tensor:
    """(B, H, n, E) rows of x, or (B, P, E) where only the (head, row) ``pairs`` travel."""
    rows = rows.to(x.device)
    if pairs is None:
        return x.index_select(2, rows)
    heads, at = (t.to(x.device) for t in pairs)
    return x[:, heads, rows[at]]


def _shape(shape: tuple, rows: Tensor, pairs) -> tuple[int, ...]:
    """The shape of ``_selected`` for x of ``shape``."""
    if pairs is None:
        return (*shape[:2], rows.numel(), shape[3])
    return (shape[0], pairs[0].numel(), shape[3])


def _placed(arrived: Tensor, rows: Tensor, pairs, heads: int) -> Tensor:
    """(B, H, n, E) from what ``_selected`` sent: zeros where a head did not need a row (no call
    of that head reads it)."""
    if pairs is None:
        return arrived
    out = arrived.new_zeros(arrived.shape[0], heads, rows.numel(), arrived.shape[-1])
    h, at = (t.to(arrived.device) for t in pairs)
    out[:, h, at] = arrived
    return out


def _by_peer(received: dict[int, Tensor], fetch: dict, fetch_pairs: dict, heads: int) -> dict:
    """peer -> the (B, heads, n, E) rows received from it (heads that did not travel: zeros)."""
    return {p: _placed(t, fetch[p], fetch_pairs.get(p), heads) for p, t in received.items()}


def in_order(
    own: Tensor, fetched: dict[int, Tensor], pieces: tuple, first: int = 0, stop: int | None = None
) -> Tensor:
    """Keys ``first .. stop - 1`` of the list a rank attends, in position order, from slices of
    its own rows (source -1) and of the rows fetched from each peer (source: the peer): a view
    where they lie in one slice."""
    stop = sum(count for *_, count in pieces) if stop is None else stop
    parts, at = [], 0
    for source, start, count in pieces:
        lo, hi = max(first, at), min(stop, at + count)
        if lo < hi:
            parts.append(narrowed(own if source == -1 else fetched[source], 2, start + lo - at,
                                  hi - lo))  # fmt: skip
        at += count
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)


class KeyExchange:
    """One call's exchange of key/value rows, shared by its two autograd steps: what the plan
    says this rank sends and fetches, and the messages in flight between the steps (the rows in
    the forward, their gradients in the backward)."""

    def __init__(self, sends: dict, fetch: dict, group, send_pairs=None, fetch_pairs=None):
        self.sends, self.fetch, self.group = sends, fetch, group
        # peer -> (head, row) pairs where a peer needs some heads of a row only (else None)
        self.send_pairs, self.fetch_pairs = send_pairs or {}, fetch_pairs or {}
        self.pending: Pending | None = None


class _StartKeys(torch.autograd.Function):
    """Posts the exchange; its backward waits for the gradients of the rows this rank sent."""

    @staticmethod
    def forward(ctx, k: Tensor, v: Tensor, exchange: KeyExchange) -> Tensor:
        ctx.exchange, ctx.shapes, ctx.like = exchange, (k.shape, v.shape), k.new_empty(0)
        exchange.pending = _post_rows((k, v), exchange.sends, exchange.fetch, exchange.group,
                                      exchange.send_pairs, exchange.fetch_pairs)  # fmt: skip
        return k.new_zeros(())

    @staticmethod
    def backward(ctx, grad_token: Tensor):
        exchange = ctx.exchange
        returned = exchange.pending.wait()
        exchange.pending = None
        if not exchange.sends:  # nothing comes back (where no call read the shard's keys
            return None, None, None  # either, their gradient is None: zero, as PyTorch writes)
        grads = [ctx.like.new_zeros(shape) for shape in ctx.shapes]
        widths = [shape[-1] for shape in ctx.shapes]
        batch = torch.arange(ctx.shapes[0][0], device=ctx.like.device)[:, None]
        for p, rows in exchange.sends.items():  # a row sent to several peers: all their grads
            rows, pairs = rows.to(ctx.like.device), exchange.send_pairs.get(p)
            for grad, part in zip(grads, returned[p].split(widths, dim=-1), strict=True):
                if pairs is None:
                    grad.index_add_(2, rows, part)
                    continue
                heads, at = (t.to(ctx.like.device) for t in pairs)
                grad.index_put_((batch, heads[None], rows[at][None]), part, accumulate=True)
        return *grads, None


class _FinishKeys(torch.autograd.Function):
    """Waits for the exchange: per peer that sends keys, in rank order, the (B, H, n, Dk) keys
    and (B, H, n, Dv) values received from it; then a token for the output. The token makes
    the backward run on every rank, also where no call reads the fetched rows (a rank must
    still return its peers' gradients). Keys and values travel side by side, one message per
    peer, and come back as outputs of their own per peer: no buffer of every fetched row is
    made, forward or backward."""

    @staticmethod
    def forward(ctx, token: Tensor, k: Tensor, v: Tensor, exchange: KeyExchange):
        ctx.exchange, ctx.like, ctx.widths = exchange, k.new_empty(0), (k.shape[3], v.shape[3])
        ctx.shape = (*k.shape[:3], k.shape[3] + v.shape[3])
        ctx.set_materialize_grads(False)  # rows no call read: no gradient, none made
        received = _by_peer(exchange.pending.wait(), exchange.fetch, exchange.fetch_pairs,
                            k.shape[1])  # fmt: skip
        exchange.pending = None
        return *(part for t in received.values() for part in t.split(ctx.widths, dim=-1)), \
            k.new_zeros(())  # fmt: skip

    @staticmethod
    def backward(ctx, *grads: Tensor | None):
        exchange = ctx.exchange
        batch, heads = ctx.shape[:2]
        outgoing = {}  # each peer's rows (and heads) back to it, keys and values side by side
        for index, (p, rows) in enumerate(exchange.fetch.items()):
            pair = grads[2 * index : 2 * index + 2]  # its keys' and values' gradients
            both = [ctx.like.new_zeros(batch, heads, rows.numel(), w) if g is None else g
                    for g, w in zip(pair, ctx.widths, strict=True)]  # fmt: skip
            grad_p, pairs = torch.cat(both, dim=-1), exchange.fetch_pairs.get(p)
            outgoing[p] = grad_p if pairs is None else _selected(
                grad_p, torch.arange(rows.numel()), pairs)  # fmt: skip
        incoming = {p: _shape(ctx.shape, rows, exchange.send_pairs.get(p))
                    for p, rows in exchange.sends.items()}  # fmt: skip
        exchange.pending = Pending(outgoing, incoming, ctx.like, exchange.group)
        return ctx.like.new_zeros(()), None, None, None


def start_keys(
    k: Tensor, v: Tensor, sends: dict, fetch: dict, group, send_pairs=None, fetch_pairs=None
):
    """Post the exchange of the (B, H, s, Dk) keys and (B, H, s, Dv) values of this rank's
    shard: (a token for ``finish_keys``, the exchange in flight). ``send_pairs``,
    ``fetch_pairs``: as ``KeyExchange`` takes them."""
    exchange = KeyExchange(sends, fetch, group, send_pairs, fetch_pairs)
    return _StartKeys.apply(k, v, exchange), exchange


def finish_keys(
    token: Tensor, k: Tensor, v: Tensor, exchange: KeyExchange
) -> tuple[dict[int, Tensor], dict[int, Tensor], Tensor]:
    """Wait for ``start_keys``'s exchange: (peer -> the (B, H, n, Dk) keys fetched from it,
    peer -> the (B, H, n, Dv) values, for ``in_order``; a zero scalar that the call's output
    must add)."""
    *parts, token = _FinishKeys.apply(token, k, v, exchange)
    peers = list(exchange.fetch)
    return (
        dict(zip(peers, parts[0::2], strict=True)),
        dict(zip(peers, parts[1::2], strict=True)),
        token,
    )


def gather_padding(padding: Tensor, sends: dict, fetch: dict, pieces: tuple, group) -> Tensor:
    """(B, s) key padding of own rows -> (B, m) that of the keys the rank attends."""
    as_rows = padding.to(torch.uint8)[:, None, :, None]  # (B, 1, s, 1): rows like k's
    fetched = _by_peer(_post_rows((as_rows,), sends, fetch, group).wait(), fetch, {}, 1)
    return in_order(as_rows, fetched, pieces)[:, 0, :, 0].bool()


class SwapRows(torch.autograd.Function):
    """Tensors sent to peers and tensors received from peers, differentiable: the backward sends
    each received tensor's gradient back to its sender and receives those of the sent ones.

    Every rank applies it at the same point of its call, with or without anything to send or
    receive, and feeds its first output (a zero scalar, the ``token``) into what comes next
    (the next exchange's ``after``, or the output): the backward then runs on every rank, and
    in the same order on every rank (an exchange's backward waits for the later one's), so no
    rank waits for a peer that runs another exchange or none. ``after``: an earlier exchange's
    output, ordered before this one."""

    @staticmethod
    def forward(ctx, after: Tensor, group, shapes: dict, dtype, peers: tuple, *outgoing: Tensor):
        ctx.group, ctx.peers, ctx.shapes = group, peers, shapes
        ctx.after = (after.shape, after.dtype)
        ctx.sent_shapes = [t.shape for t in outgoing]
        like = after.new_empty(0, dtype=dtype)
        received = swap(dict(zip(peers, outgoing, strict=True)), shapes, like, group)
        return (after.new_zeros((), dtype=dtype), *received.values())

    @staticmethod
    def backward(ctx, grad_token: Tensor, *grad_received: Tensor):
        outgoing = dict(zip(ctx.shapes, grad_received, strict=True))
        incoming = dict(zip(ctx.peers, ctx.sent_shapes, strict=True))
        returned = swap(outgoing, incoming, grad_token, ctx.group)
        grad_after = grad_token.new_zeros(ctx.after[0], dtype=ctx.after[1])
        return (grad_after, None, None, None, None, *returned.values())


class _Tie(torch.autograd.Function):
    """``after`` (a zero token), recorded for autograd wherever one of ``tensors`` records
    gradients; its backward passes the gradient to ``after`` only. The ``SwapRows`` that take it
    are then recorded on every rank of a call that records gradients, also where this rank's
    swaps hold nothing that does (its k and v frozen, only q or a bias's table learning): a rank
    that had not recorded them left the others waiting for its backward's messages."""

    @staticmethod
    def forward(ctx, after: Tensor, *tensors: Tensor) -> Tensor:
        ctx.count = len(tensors)
        return after.clone()

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, *(None,) * ctx.count


def tie(after: Tensor, tensors: tuple[Tensor, ...]) -> Tensor:
    """``after``, recorded wherever any of ``tensors`` records gradients (``_Tie``)."""
    return _Tie.apply(after, *tensors)


def swap_rows(
    after: Tensor, outgoing: dict[int, Tensor], shapes: dict[int, tuple], dtype, group
) -> tuple[Tensor, dict[int, Tensor]]:
    """(token, peer -> received): ``outgoing[peer]`` sent to each peer, a tensor of shape
    ``shapes[peer]`` received from each (``SwapRows``)."""
    token, *received = SwapRows.apply(after, group, shapes, dtype, tuple(outgoing),
                                      *outgoing.values())  # fmt: skip
    return token, dict(zip(shapes, received, strict=True))
