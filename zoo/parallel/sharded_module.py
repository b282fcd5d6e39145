"""``zoo.MultiHeadAttention`` under context parallelism: x (B, s, dim) is this rank's shard.

The module keeps its group as attributes (``cp_group``, ``cp_order``), set at construction or by
``use_context_parallel`` on every attention module of a built model, which is what a training
loop wants: the model is written once, and a launcher decides how many ranks share a sequence.
Inside, the shard's global positions reach the pieces that depend on them: an absolute encoding
(sinusoidal, learned) is added at the rank's global positions, ``valid_lens`` (lengths of the
whole sequences) become this shard's key padding, and the attention call shards by ``cp_group``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..core.call import unread_padded_inputs
from ..core.heads import join_heads
from ..core.valid_lens import padding_from_lengths
from .sharded import check_group, raised_by_the_call
from .shards import ShardLayout, check_order


def use_context_parallel(model: nn.Module, group: object, order: str = "contiguous") -> nn.Module:
    """Set ``cp_group`` and ``cp_order`` on every ``zoo.MultiHeadAttention`` inside ``model``
    (``group=None``: back to one process); returns the model. A zoo attention module that does
    not shard (``context_parallel_refusal``: NSA) is refused, naming it, before any is set: left
    as it is, it would attend within each rank's shard as if it were the whole sequence."""
    if group is not None:
        for name, module in model.named_modules():
            reason = getattr(type(module), "context_parallel_refusal", None)
            if reason is not None:
                raise ValueError(
                    f"use_context_parallel: {name or 'the model'} is a "
                    f"{type(module).__name__}, which does not shard over processes: {reason}"
                )
    for module in model.modules():
        if hasattr(module, "cp_group") and hasattr(module, "cp_order"):
            module.cp_group, module.cp_order = group, order
    return model


def sharded_forward(
    module: nn.Module,
    x: Tensor,
    context: Tensor | None,
    key_padding_mask: Tensor | None,
    valid_lens: Tensor | None,
    return_weights: bool,
) -> Tensor:
    """The module's forward on this rank's shard x (B, s, dim): self-attention only."""
    for name, given, why in (
        ("context", context is not None, "cross-attention is not sharded"),
        ("return_weights", return_weights, "each rank holds only its rows of the weights"),
        ("valid_lens and key_padding_mask", valid_lens is not None and key_padding_mask
         is not None, "give one of the two"),
    ):  # fmt: skip
        if given:
            raise ValueError(f"{name}: not available with cp_group: {why}")
    check_group(module.cp_group, x)
    # What fails here (a shard the order cannot cut, lengths out of range, a learned table too
    # short) is raised by the attention call, which agrees with every rank before it raises:
    # raising here on one rank would leave the others waiting.
    problem = None
    if check_order(module.cp_order, x.shape[1]) is None:
        rank, world = dist.get_rank(module.cp_group), dist.get_world_size(module.cp_group)
        layout = ShardLayout(world, x.shape[1], module.cp_order)
        positions = layout.positions(rank).to(x.device)
        try:
            if valid_lens is not None:  # lengths of the whole sequences: this shard's columns
                whole = padding_from_lengths(valid_lens.to(x.device), world * x.shape[1])
                key_padding_mask = whole[:, positions]
            if module.pos.kind == "embed":
                x = _embedded(module.pos, x, layout, rank)
        except (ValueError, TypeError) as error:
            problem = error
    fits = isinstance(key_padding_mask, Tensor) and key_padding_mask.dtype == torch.bool
    if fits and tuple(key_padding_mask.shape) == tuple(x.shape[:2]):  # else refused by the call
        x = unread_padded_inputs(x, key_padding_mask.to(x.device))
    q, k, v = module._heads(x, x)
    with raised_by_the_call(problem):
        out = module._attend(q, k, v, key_padding_mask, False, None)
    return module.out_proj(join_heads(out))  # (B, s, dim)


def _embedded(encoding: nn.Module, x: Tensor, layout: ShardLayout, rank: int) -> Tensor:
    """x with the absolute encoding of its global positions, chunk by chunk."""
    chunks = [
        encoding.embed(x[:, i * layout.chunk : (i + 1) * layout.chunk], offset=c * layout.chunk)
        for i, c in enumerate(layout.chunks_of(rank))
    ]
    return chunks[0] if len(chunks) == 1 else torch.cat(chunks, dim=1)
