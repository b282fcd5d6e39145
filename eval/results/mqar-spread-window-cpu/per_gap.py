"""Accuracy per exact key-to-query gap and per query position of one trained MQAR cell, read
from a checkpoint the harness saved (``save_checkpoints=true``):

    python eval/results/mqar-spread-window-cpu/per_gap.py OUT/checkpoints/KEY.pt [SEQUENCES]

The harness reports gaps in power-of-two buckets; this splits them by exact gap, by query
position and by both, on 4096 fresh sequences drawn with seed 12345."""

from __future__ import annotations

import sys
from collections import defaultdict

import torch

from eval.harness.train import build_model
from eval.tasks import get_task


def main(path: str, sequences: int = 4096) -> None:
    saved = torch.load(path, weights_only=False)
    cell = saved["cell"]
    task = get_task(cell["task"], seq_len=cell["train_len"], **cell["task_params"])
    model = build_model(cell, task)
    model.load_state_dict(saved["model"])
    model.eval()
    batch = task.sample(sequences, 12345)
    with torch.no_grad():
        right = model(batch.inputs, batch.padding_mask).argmax(-1) == batch.targets
    gaps, keys = batch.meta["query_distance"], batch.meta["pair_positions"]
    rows = torch.arange(sequences)[:, None].expand_as(gaps)
    hit = right[rows, keys + gaps]  # each query's answer
    for name, by in (("gap", gaps), ("query position", keys + gaps)):
        tally: dict[int, list[int]] = defaultdict(lambda: [0, 0])
        for value, ok in zip(by.flatten().tolist(), hit.flatten().tolist(), strict=True):
            tally[value][0] += ok
            tally[value][1] += 1
        print(f"| {name} | " + " | ".join(str(v) for v in sorted(tally)) + " |")
        print("|---|" + "---|" * len(tally))
        print(
            "| accuracy (answers) | "
            + " | ".join(f"{a / n:.2f} ({n})" for _, (a, n) in sorted(tally.items()))
            + " |\n"
        )
    # where the misses lie: accuracy per (gap, query position) at the query region's first
    # positions, for the gaps a window of 15 reaches in one layer and the first beyond
    places = sorted(set((keys + gaps).flatten().tolist()))[:7]
    print("| gap \\ query position | " + " | ".join(map(str, places)) + " |")
    print("|---|" + "---|" * len(places))
    for gap in range(2, 19, 2):
        cells = []
        for place in places:
            chosen = (gaps == gap) & (keys + gaps == place)
            count = int(chosen.sum())
            cells.append(f"{hit[chosen].float().mean():.2f} ({count})" if count else "-")
        print(f"| {gap} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1], *(int(a) for a in sys.argv[2:]))
