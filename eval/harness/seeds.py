"""Which sequences a cell draws: one seed per batch, from the cell's seed, the stream ("train" or
"eval") and the batch's index in it.

torch's CPU generator (a Mersenne Twister) is seeded by the low 32 bits of its seed: seeds that
differ only above them draw the same numbers. A batch's seed is therefore laid out within 32
bits: the stream in the lowest bit, the batch's index in the next ``BATCH_BITS``, the cell seed
above them, so every (cell seed, stream, index) within bounds draws its own batch.
"""

from __future__ import annotations

BATCH_BITS = 20  # batches per stream and cell seed: steps x data-parallel ranks, checks included
SEED_BITS = 31 - BATCH_BITS  # cell seeds from 0 to 2**SEED_BITS - 1 (eval/harness/run.py)


def sample_seed(cell_seed: int, stream: str, index: int) -> int:
    """The task-sampling seed of batch ``index`` in a stream ("train" or "eval") of a cell seed:
    distinct for every (cell seed, stream, index) within the bounds, so two cell seeds never
    draw the same batch and a train batch never meets an eval one. Out of bounds: ValueError."""
    if not 0 <= cell_seed < 2**SEED_BITS:
        raise ValueError(f"cell seed must be from 0 to {2**SEED_BITS - 1}, got {cell_seed}")
    if not 0 <= index < 2**BATCH_BITS:
        raise ValueError(
            f"batch index of the {stream} stream must be below 2**{BATCH_BITS} (steps x "
            f"data-parallel ranks), got {index}"
        )
    return ((cell_seed << BATCH_BITS | index) << 1) | (stream == "eval")
