"""The exchange: key/value rows fetched from the ranks that hold them, differentiable.

Point-to-point calls only (``torch.distributed.batch_isend_irecv``), which gloo and NCCL both
run (gloo has no ``all_to_all``): each rank posts one send per peer that needs some of its rows
and one receive per peer it needs rows from, as its ``ExchangePlan`` says, and waits for all of
them. The backward runs the same exchange the other way: the gradients of the fetched rows go
back to their owners, who add them into the gradients of their own rows.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor


def swap(
    outgoing: dict[int, Tensor], incoming: dict[int, tuple[int, ...]], like: Tensor, group
) -> dict[int, Tensor]:
    """Send ``outgoing[peer]`` to each peer and receive a tensor of shape ``incoming[peer]``
    (``like``'s dtype and device) from each peer; peers are ranks within ``group``."""
    received = {p: like.new_empty(shape) for p, shape in incoming.items()}
    ops = [
        dist.P2POp(dist.isend, t.contiguous(), dist.get_global_rank(group, p), group)
        for p, t in outgoing.items()
    ]
    ops += [
        dist.P2POp(dist.irecv, t, dist.get_global_rank(group, p), group)
        for p, t in received.items()
    ]
    if ops:
        for request in dist.batch_isend_irecv(ops):
            request.wait()
    return received


def _fetched(local: Tensor, sends: dict, fetch: dict, group) -> Tensor:
    """(B, H, s, E) own rows -> (B, H, n, E) the rows this rank fetches, peers in rank order,
    having sent each peer the rows it fetches from this rank."""
    outgoing = {p: local.index_select(2, rows.to(local.device)) for p, rows in sends.items()}
    incoming = {p: (*local.shape[:2], rows.numel(), local.shape[3]) for p, rows in fetch.items()}
    received = swap(outgoing, incoming, local, group)
    if not received:
        return local.new_zeros(*local.shape[:2], 0, local.shape[3])
    return torch.cat(list(received.values()), dim=2)


def in_order(own: Tensor, fetched: Tensor, pieces: tuple) -> Tensor:
    """The keys in position order from slices of own rows (source -1) and of the fetched
    buffer (source: the peer)."""
    parts = [(own if source == -1 else fetched).narrow(2, first, count)
             for source, first, count in pieces]  # fmt: skip
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)


class GatherKeys(torch.autograd.Function):
    """(B, H, s, E) own rows -> (B, H, m, E) the keys a rank attends, in position order: its own
    and those fetched from peers. One function for both, so that its backward runs on every rank
    whose keys are used (a rank that fetches nothing must still return its peers' gradients)."""

    @staticmethod
    def forward(ctx, own: Tensor, sends: dict, fetch: dict, pieces: tuple, group) -> Tensor:
        ctx.sends, ctx.fetch, ctx.pieces, ctx.group = sends, fetch, pieces, group
        ctx.rows = own.shape[2]
        return in_order(own, _fetched(own, sends, fetch, group), pieces)

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad_own = grad.new_zeros(*grad.shape[:2], ctx.rows, grad.shape[3])
        grad_fetched = grad.new_zeros(
            *grad.shape[:2], sum(r.numel() for r in ctx.fetch.values()), grad.shape[3]
        )
        at = 0
        for source, first, count in ctx.pieces:  # each key's gradient back to its slot
            target = grad_own if source == -1 else grad_fetched
            target.narrow(2, first, count).add_(grad.narrow(2, at, count))
            at += count
        counts = [rows.numel() for rows in ctx.fetch.values()]
        outgoing = dict(zip(ctx.fetch, torch.split(grad_fetched, counts, dim=2), strict=True))
        incoming = {
            p: (*grad.shape[:2], rows.numel(), grad.shape[3]) for p, rows in ctx.sends.items()
        }
        returned = swap(outgoing, incoming, grad, ctx.group)
        for p, rows in ctx.sends.items():  # a row sent to several peers gathers all their grads
            grad_own.index_add_(2, rows.to(grad.device), returned[p])
        return grad_own, None, None, None, None


def gather_keys(own: Tensor, sends: dict, fetch: dict, pieces: tuple, group) -> Tensor:
    """The keys (or values, or both side by side) this rank attends (``GatherKeys``)."""
    return GatherKeys.apply(own, sends, fetch, pieces, group)


def gather_padding(padding: Tensor, sends: dict, fetch: dict, pieces: tuple, group) -> Tensor:
    """(B, s) key padding of own rows -> (B, m) that of the keys the rank attends."""
    as_rows = padding.to(torch.uint8)[:, None, :, None]  # (B, 1, s, 1): rows like k's
    fetched = _fetched(as_rows, sends, fetch, group)
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
