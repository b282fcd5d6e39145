"""``python -m eval attention-map CHECKPOINT``: one head's weights in a trained harness model.

Checkpoints come from a sweep run with ``save_checkpoints=true`` (``<out>/checkpoints/*.pt``).
The map is drawn on one sequence sampled from the cell's task, as the seed notes draw them: rows
are queries, columns keys. ``zoo attention-map NAME`` draws an untrained model instead.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from zoo.__main__ import int_at_least
from zoo.views.pictures import draw_attention

from ..tasks import get_task
from .seeds import sample_seed
from .train import build_model


def attention_map(
    checkpoint: str | Path,
    out: str | Path,
    *,
    layer: int = 0,
    head: int = 0,
    length: int | None = None,
) -> Path:
    """Draw head ``head`` of block ``layer`` on a sequence of ``length`` (default: train_len)."""
    saved = torch.load(checkpoint, map_location="cpu", weights_only=True)
    cell = saved["cell"]
    length = cell["train_len"] if length is None else length
    task = get_task(cell["task"], seq_len=length, **cell["task_params"])
    model = build_model(cell, task)
    model.load_state_dict(saved["model"])
    model.check_length(length)
    batch = task.sample(1, sample_seed(cell["seed"], "eval", 0))
    weights = model.eval().attention_weights(batch.inputs, batch.padding_mask, layer)
    title = (
        f"{cell['variant']}+{cell['encoding']} trained on {cell['task']} (L={cell['train_len']}): "
        f"layer {layer}, head {head}, length {length}"
    )
    return draw_attention(weights, out, head=head, title=title)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m eval attention-map", description=__doc__.splitlines()[0]
    )
    parser.add_argument("checkpoint")
    parser.add_argument("--layer", type=int_at_least(0), default=0)
    parser.add_argument("--head", type=int_at_least(0), default=0)
    parser.add_argument("--length", type=int_at_least(1), default=None)
    parser.add_argument("--out", default="attention-map.png")
    args = parser.parse_args(argv)
    try:
        picture = attention_map(
            args.checkpoint, args.out, layer=args.layer, head=args.head, length=args.length
        )
    except (OSError, ValueError, TypeError) as error:  # no such file, a layer out of range
        parser.error(str(error))
    print(picture)
    return 0
