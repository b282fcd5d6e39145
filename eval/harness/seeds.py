"""Which sequences a cell draws: one seed per batch, from the cell's seed, the stream ("train" or
"eval") and the batch's index in it.

torch's CPU generator (a Mersenne Twister) is seeded by the low 32 bits of its seed: seeds that
differ only above them draw the same numbers. A batch's seed is therefore laid out within 32
bits: the stream in the lowest bit, the batch's index in the next ``BATCH_BITS``, the cell seed
above them, so every (cell seed, stream, index) within bounds draws its own batch. Cell seed 0
draws as it did before this layout (``2 * index + eval``).

The evaluation stream's first half is the evaluation's, its second half the checks' during
training (``CHECK_OFFSET``); ``draw_problem`` refuses settings that would need more batches than
their part, before any training.
"""

from __future__ import annotations

from typing import Any

# Batches per stream and cell seed (of the evaluation stream, half the evaluation's, half the
# checks').
BATCH_BITS = 20
SEED_BITS = 31 - BATCH_BITS  # cell seeds from 0 to 2**SEED_BITS - 1 (eval/harness/run.py)
STREAMS = ("train", "eval")
# The evaluation stream's batch indices from which the checks during training draw theirs: past
# every evaluation's, so that training never stops on the sequences the record is scored on.
CHECK_OFFSET = 2 ** (BATCH_BITS - 1)


def sample_seed(cell_seed: int, stream: str, index: int) -> int:
    """The task-sampling seed of batch ``index`` in a stream ("train" or "eval") of a cell seed:
    distinct for every (cell seed, stream, index) within the bounds, so two cell seeds never
    draw the same batch and a train batch never meets an eval one. Out of bounds: ValueError."""
    if stream not in STREAMS:
        raise ValueError(f"stream must be one of {STREAMS}, got {stream!r}")
    if not 0 <= cell_seed < 2**SEED_BITS:
        raise ValueError(f"cell seed must be from 0 to {2**SEED_BITS - 1}, got {cell_seed}")
    if not 0 <= index < 2**BATCH_BITS:
        raise ValueError(
            f"batch index of the {stream} stream must be below 2**{BATCH_BITS}, got {index}"
        )
    return ((cell_seed << BATCH_BITS | index) << 1) | (stream == "eval")


def draw_problem(train: dict[str, Any], ranks: int = 1) -> str | None:
    """What in a cell's train settings would draw more batches than a cell seed has, or None:
    fresh training batches (the budget's steps x ``ranks`` data-parallel processes), a pool's
    epochs (each epoch's order has a seed of its own), the evaluation's batches."""
    name = "max_steps" if train.get("until", "steps") == "learned" else "steps"
    budget, size = train[name], train["batch_size"]
    if train.get("pool"):
        epochs = (budget * size - 1) // train["pool"] + 1  # orders drawn at indices 1 .. epochs
        if epochs >= 2**BATCH_BITS:
            return (
                f"train.{name}={budget} batches of train.batch_size={size} read "
                f"train.pool={train['pool']} in {epochs} epochs, each ordered by a seed of its "
                f"own: at most 2**{BATCH_BITS} - 1 (eval/harness/seeds.py); use a larger pool"
            )
    elif budget * ranks > 2**BATCH_BITS:
        on = f" on {ranks} data-parallel processes" if ranks > 1 else ""
        return (
            f"train.{name}={budget}{on} draws {budget * ranks} training batches, more than the "
            f"2**{BATCH_BITS} a cell seed has (eval/harness/seeds.py)"
        )
    batches = -(-train["eval_samples"] // train["eval_batch_size"])
    if batches > CHECK_OFFSET:
        return (
            f"train.eval_samples={train['eval_samples']} in batches of "
            f"train.eval_batch_size={train['eval_batch_size']} makes {batches} batches, more "
            f"than the evaluation's 2**{BATCH_BITS - 1} (the rest of its stream is the checks')"
        )
    return None
