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
    local: Tensor, sends: dict, fetch: dict, group, send_pairs=None, fetch_pairs=None
) -> Pending:
    """Post the rows of (B, H, s, E) ``local`` that each peer fetches from this rank, and the
    receives of the rows this rank fetches from each peer. ``send_pairs`` and ``fetch_pairs``:
    peer -> (head, row) index pairs where only those (heads, rows) travel, as (B, P, E)."""
    send_pairs, fetch_pairs = send_pairs or {}, fetch_pairs or {}
    outgoing = {p: _selected(local, rows, send_pairs.get(p)) for p, rows in sends.items()}
    incoming = {p: _shape(local.shape, rows, fetch_pairs.get(p)) for p, rows in fetch.items()}
    return Pending(outgoing, incoming, local, group)


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


def _joined(received: dict[int, Tensor], like: Tensor, fetch: dict, fetch_pairs=None) -> Tensor:
    """The received rows in one buffer (B, H, n, E), peers in rank order."""
    if not received:
        return like.new_zeros(*like.shape[:2], 0, like.shape[3])
    fetch_pairs = fetch_pairs or {}
    return torch.cat([_placed(t, fetch[p], fetch_pairs.get(p), like.shape[1])
                      for p, t in received.items()], dim=2)  # fmt: skip


def in_order(
    own: Tensor, fetched: Tensor, pieces: tuple, first: int = 0, stop: int | None = None
) -> Tensor:
    """Keys ``first .. stop - 1`` of the list a rank attends, in position order, from slices of
    its own rows (source -1) and of the fetched buffer (source: the peer): a view where they lie
    in one slice."""
    stop = sum(count for *_, count in pieces) if stop is None else stop
    parts, at = [], 0
    for source, start, count in pieces:
        lo, hi = max(first, at), min(stop, at + count)
        if lo < hi:
            parts.append((own if source == -1 else fetched).narrow(2, start + lo - at, hi - lo))
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
    def forward(ctx, own: Tensor, exchange: KeyExchange) -> Tensor:
        ctx.exchange, ctx.shape, ctx.like = exchange, own.shape, own.new_empty(0)
        exchange.pending = _post_rows(own, exchange.sends, exchange.fetch, exchange.group,
                                      exchange.send_pairs, exchange.fetch_pairs)  # fmt: skip
        return own.new_zeros(())

    @staticmethod
    def backward(ctx, grad_token: Tensor):
        exchange = ctx.exchange
        returned = exchange.pending.wait()
        exchange.pending = None
        if not exchange.sends:  # nothing comes back (where no call read the shard's keys
            return None, None  # either, their gradient is None: zero, as PyTorch writes it)
        grad_own = ctx.like.new_zeros(ctx.shape)
        for p, rows in exchange.sends.items():  # a row sent to several peers: all their grads
            rows, pairs = rows.to(grad_own.device), exchange.send_pairs.get(p)
            if pairs is None:
                grad_own.index_add_(2, rows, returned[p])
                continue
            heads, at = (t.to(grad_own.device) for t in pairs)
            batch = torch.arange(ctx.shape[0], device=grad_own.device)[:, None]
            grad_own.index_put_((batch, heads[None], rows[at][None]), returned[p], accumulate=True)
        return grad_own, None


class _FinishKeys(torch.autograd.Function):
    """Waits for the exchange: (the rows fetched, (B, H, n, E), peers in rank order; a token for
    the output). The token makes the backward run on every rank, also where no call reads the
    fetched rows (a rank must still return its peers' gradients)."""

    @staticmethod
    def forward(ctx, token: Tensor, own: Tensor, exchange: KeyExchange):
        ctx.exchange, ctx.shape, ctx.like = exchange, own.shape, own.new_empty(0)
        ctx.set_materialize_grads(False)  # rows no call read: no gradient, none made
        fetched = _joined(exchange.pending.wait(), own, exchange.fetch, exchange.fetch_pairs)
        exchange.pending = None
        return fetched, own.new_zeros(())

    @staticmethod
    def backward(ctx, grad: Tensor | None, grad_token: Tensor | None):
        exchange = ctx.exchange
        batch, heads, _, width = ctx.shape
        counts = [rows.numel() for rows in exchange.fetch.values()]
        if grad is None:
            grad = ctx.like.new_zeros(batch, heads, sum(counts), width)
        outgoing = {  # each peer's rows (and heads) back to it
            p: grad_p if exchange.fetch_pairs.get(p) is None else
            _selected(grad_p, torch.arange(rows.numel()), exchange.fetch_pairs[p])
            for (p, rows), grad_p in zip(exchange.fetch.items(), torch.split(grad, counts, dim=2),
                                         strict=True)
        }  # fmt: skip
        incoming = {p: _shape(ctx.shape, rows, exchange.send_pairs.get(p))
                    for p, rows in exchange.sends.items()}  # fmt: skip
        exchange.pending = Pending(outgoing, incoming, grad, exchange.group)
        return ctx.like.new_zeros(()), None, None


def start_keys(own: Tensor, sends: dict, fetch: dict, group, send_pairs=None, fetch_pairs=None):
    """Post the exchange of (B, H, s, E) own rows (keys, or values, or both side by side):
    (a token for ``finish_keys``, the exchange in flight). ``send_pairs``, ``fetch_pairs``: as
    ``KeyExchange`` takes them."""
    exchange = KeyExchange(sends, fetch, group, send_pairs, fetch_pairs)
    return _StartKeys.apply(own, exchange), exchange


def finish_keys(token: Tensor, own: Tensor, exchange: KeyExchange) -> tuple[Tensor, Tensor]:
    """Wait for ``start_keys``'s exchange: ((B, H, n, E) the rows fetched, peers in rank order,
    for ``in_order``; a zero scalar that the call's output must add)."""
    return _FinishKeys.apply(token, own, exchange)


def gather_padding(padding: Tensor, sends: dict, fetch: dict, pieces: tuple, group) -> Tensor:
    """(B, s) key padding of own rows -> (B, m) that of the keys the rank attends."""
    as_rows = padding.to(torch.uint8)[:, None, :, None]  # (B, 1, s, 1): rows like k's
    fetched = _joined(_post_rows(as_rows, sends, fetch, group).wait(), as_rows, fetch)
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


def swap_rows(
    after: Tensor, outgoing: dict[int, Tensor], shapes: dict[int, tuple], dtype, group
) -> tuple[Tensor, dict[int, Tensor]]:
    """(token, peer -> received): ``outgoing[peer]`` sent to each peer, a tensor of shape
    ``shapes[peer]`` received from each (``SwapRows``)."""
    token, *received = SwapRows.apply(after, group, shapes, dtype, tuple(outgoing),
                                      *outgoing.values())  # fmt: skip
    return token, dict(zip(shapes, received, strict=True))
