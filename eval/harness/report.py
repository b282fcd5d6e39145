"""``python -m eval report RESULTS.jsonl [--out DIR]``: tables and plots from a sweep's results.

Writes ``report.md``: per cell of the protocol, the best of its learning-rate sweep
(eval/harness/selection.py), whether its training converged (eval/harness/convergence.py) and its
verdict, what it learned of what its pattern reaches (eval/harness/verdict.py: learned, cannot,
not learned, with the command that trains a "not learned" cell further);
accuracy per task, variant, encoding and test length, averaged over seeds, with time and memory;
the sweep's every learning rate; accuracy per gap bucket where the task records gaps, as MQAR
does. Also ``results.csv`` (one row per cell and test length, every learning rate, the chosen
ones marked) and PNG plots: accuracy against test length per variant; accuracy against cost
(attention pairs per sequence at the train length, one head and one layer, counted from the
pattern, with training seconds per 1000 steps on the machine below it); and, for sweeps that
generate, greedy generation beside teacher-forced accuracy (generation.png).
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import warnings
from collections import defaultdict
from pathlib import Path
from typing import Any

from zoo.views.tables import markdown_table

from .convergence import CONVERGED, UNKNOWN, training_state
from .learned import record_verdict
from .needs import VERDICT_SLICE
from .plots import plot_accuracy_vs_cost, plot_accuracy_vs_length, plot_checks, plot_generation
from .selection import IDENTITY, Sweep, choose, latest, setting_of
from .slices import slice_table
from .verdict import MIN_EXAMPLES, NOT_LEARNED, REACHABLE

CSV_FIELDS = [
    "task", "train_len", "test_len", "variant", "encoding", "setting", "seed", "lr", "key",
    "status", "chosen", "training", "verdict", "steps_taken", "accuracy", "generation_accuracy",
    "chance_accuracy", "train_seconds", "steps_per_second", "peak_memory_mb",
    "eval_ms_per_sequence", "reason",
]  # fmt: skip


def read_results(path: str | Path) -> list[dict[str, Any]]:
    """The records of a results file. A line that is not JSON (cut short by a crash while it was
    written: its cell ran again, as ``run.finished_keys`` decides) is left out with a warning."""
    records = []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as error:
                warnings.warn(f"{path}:{number}: not a JSON line, left out ({error})", stacklevel=2)
    return records


def rows(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One flat row per cell and test length, from each cell's latest record (a failed cell gives
    one row with its reason). ``setting`` names the cell's settings but its learning rate, which
    has its own column."""
    out = []
    for r in latest(records):
        c = r["cell"]
        base = {k: c[k] for k in IDENTITY}
        base.update(
            setting=setting_of(c, leave_out=("lr",)),
            key=c["key"],
            status=r["status"],
            reason=r.get("reason", ""),
            lr=c.get("train", {}).get("lr"),
            variant_params=c.get("variant_params", {}),
            causal=c.get("causal", False),
            chance_accuracy=r.get("chance_accuracy"),
            training=training_state(r),
            device=r.get("environment", {}).get("device"),
            head_dim=c["model"]["dim"] // c["model"]["heads"] if "model" in c else None,
        )
        for key in ("train_seconds", "steps_per_second", "peak_memory_mb"):
            base[key] = r.get(key)
        base["steps"] = c.get("train", {}).get("steps")
        if r["status"] == "ok":  # records from before until: learned trained the fixed budget
            base["steps_taken"] = r.get("steps_taken", base["steps"])
        lengths = r.get("accuracy", {}) or {str(n): None for n in c["test_lengths"]}
        for length, accuracy in lengths.items():
            ms = r.get("eval_ms_per_sequence", {}).get(length)
            generated = (r.get("generation_accuracy") or {}).get(length)
            out.append({
                **base,
                "test_len": int(length),
                "accuracy": accuracy,
                "generation_accuracy": generated,
                "eval_ms_per_sequence": ms,
                "verdict": record_verdict(r, length).verdict if r["status"] == "ok" else None,
            })  # fmt: skip
    return out


def mean(values: list[float | None]) -> float | None:
    """The mean of the values that are not None; None when there are none."""
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def fmt(value: float | None, digits: int = 3) -> str:
    """A table cell: the value to ``digits`` places, or "-" for None."""
    return "-" if value is None else f"{value:.{digits}f}"


def summary_table(flat: list[dict[str, Any]]) -> str:
    """Accuracy and costs averaged over seeds, per task, length, variant, encoding and setting
    (the setting column appears when a results file holds more than one), with the learning rate
    and whether training converged (``eval.harness.convergence``)."""
    groups: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for row in flat:
        key = (
            row["task"],
            row["train_len"],
            row["variant"],
            row["encoding"],
            row["setting"],
            row["test_len"],
        )
        groups[key].append(row)
    several = len({(k[:4], k[4]) for k in groups}) > len({k[:4] for k in groups})
    generated = any(row.get("generation_accuracy") is not None for row in flat)
    # a steps column where a cell trained other than its steps (train.until: learned)
    stepped = any(row.get("steps_taken") not in (None, row.get("steps")) for row in flat)
    table = []
    for (task, train_len, variant, encoding, setting, test_len), members in sorted(groups.items()):
        ok = [m for m in members if m["status"] == "ok"]
        failed = [m for m in members if m["status"] != "ok"]
        status = f"{len(ok)}/{len(members)} ok" + (
            f" ({failed[0]['reason'][:60]})" if failed else ""
        )
        rates = sorted({m["lr"] for m in members if m["lr"] is not None})
        table.append([
            task, train_len, test_len, variant, encoding, *([setting] if several else []),
            ", ".join(f"{lr:g}" for lr in rates),
            fmt(mean([m["accuracy"] for m in ok])),
            *([fmt(mean([m.get("generation_accuracy") for m in ok]))] if generated else []),
            _training(ok),
            _verdict(ok),
            *([", ".join(str(s) for s in sorted({m["steps_taken"] for m in ok}))]
              if stepped else []),
            fmt(mean([m["train_seconds"] for m in ok]), 1),
            fmt(mean([m["steps_per_second"] for m in ok]), 1),
            fmt(mean([m["peak_memory_mb"] for m in ok]), 0),
            status,
        ])  # fmt: skip
    headers = [
        "task",
        "train len",
        "test len",
        "variant",
        "encoding",
        *(["setting"] if several else []),
        "lr",
        "accuracy",
        *(["greedy generation"] if generated else []),
        "training",
        "verdict",
        *(["steps"] if stepped else []),
        "train s",
        "steps/s",
        "peak MB",
        "cells",
    ]
    return markdown_table(headers, table)


def _training(ok: list[dict[str, Any]]) -> str:
    """``converged``, or what kept the seeds that did not (``not converged: still falling``)."""
    states = {m["training"] for m in ok}
    if not states:
        return "-"
    if states <= {CONVERGED}:
        return CONVERGED
    if states <= {UNKNOWN}:
        return "not recorded"
    reasons = sorted(states - {CONVERGED, UNKNOWN})
    return "not converged: " + ", ".join(reasons)


def _verdict(ok: list[dict[str, Any]]) -> str:
    """The seeds' verdict (eval/harness/verdict.py), or each where they differ."""
    verdicts = sorted({m["verdict"] for m in ok if m.get("verdict")})
    if not verdicts:
        return "-"
    return verdicts[0] if len(verdicts) == 1 else "mixed: " + ", ".join(verdicts)


def reach_table(records: list[dict[str, Any]]) -> str | None:
    """Per chosen cell and test length, its verdict and, on the task's verdict slice, each
    value's accuracy with its reach where the pattern does not reach every answer (out, partly,
    content: chosen by content; eval/harness/verdict.py); None when no record has such a slice."""
    rows_: list[list[Any]] = []
    names: dict[str, set[str]] = defaultdict(set)
    entries = []
    for r in records:
        if r.get("status") != "ok":
            continue
        cell = r["cell"]
        name = VERDICT_SLICE.get(cell["task"])
        for length, slices in (r.get("slices") or {}).items():
            if name is None or name not in slices:
                continue
            said = record_verdict(r, length)
            names[cell["task"]].update(slices[name])
            entries.append((cell, int(length), name, slices[name], said))
    if not entries:
        return None
    tables = []
    for task in sorted(names):
        values = sorted(names[task], key=float)
        name = VERDICT_SLICE[task]
        rows_ = []
        for cell, length, _, accuracies, said in sorted(
            (e for e in entries if e[0]["task"] == task),
            key=lambda e: (e[1], e[0]["variant"], e[0]["encoding"], e[0]["seed"]),
        ):
            marks = {s.value: s.reach for s in said.slices}
            counts = {s.value: s.count for s in said.slices}
            cells = []
            for v in values:
                if v not in accuracies:
                    cells.append("")
                    continue
                mark = _REACH_MARK.get(marks.get(v, ""), "")
                count = counts.get(v)
                few = f" (n={count})" if count is not None and count < MIN_EXAMPLES else ""
                cells.append(f"{accuracies[v]:.3f}{mark}{few}")
            rows_.append([
                task, length, cell["variant"], cell["encoding"], cell["seed"], said.verdict, *cells
            ])  # fmt: skip
        headers = ["task", "test len", "variant", "encoding", "seed", "verdict",
                   *(f"{name} {v}" for v in values)]  # fmt: skip
        tables.append(markdown_table(headers, rows_))
    return "\n\n".join(tables)


VERDICTS = (
    "Verdicts (eval/harness/verdict.py): *learned*, every slice well above chance; *cannot*, what "
    "it fails lies out of the pattern's reach through the model's depth; *not learned*, a slice "
    "within reach short of learned, whatever the loss does. Each value of the task's slice: its "
    "accuracy, marked where its answers are out of reach (out), some of them (partly), or chosen "
    "by content (content), and with its answers where too few to judge (n=).\n\n"
)

# How the reach table marks a slice value whose answers are not all known to be reachable.
_REACH_MARK = {"out of reach": " out", "partly": " partly", "content-dependent": " content",
               "unknown": " ?", REACHABLE: ""}  # fmt: skip


def not_learned_lines(records: list[dict[str, Any]], command: str = "<its config>") -> str:
    """A line per chosen cell that is "not learned" at its train length, and the command that
    trains such cells further (``train.until=learned``, four times their steps as the budget)."""
    lines, budget = [], 0
    for r in records:
        said = record_verdict(r)
        if r.get("status") != "ok" or said.verdict != NOT_LEARNED:
            continue
        cell = r["cell"]
        train = cell.get("train", {})
        budget = max(budget, 4 * max(train.get("steps", 0), train.get("max_steps", 0)))
        lines.append(
            f"- {cell['task']} L={cell['train_len']} {cell['variant']}+{cell['encoding']} seed "
            f"{cell['seed']} (lr {train.get('lr')}), {r.get('steps_taken', train.get('steps'))} "
            f"steps: {said.reason}"
        )
    if not lines:
        return ""
    return (
        "**Not learned** (a slice within the pattern's reach short of learned, whatever the loss "
        "does: not a result). Train further with "
        f"`python -m eval run {command} train.until=learned train.max_steps={budget}`:\n\n"
        + "\n".join(lines)
        + "\n"
    )


def sweep_table(sweeps: list[Sweep]) -> str | None:
    """Accuracy at the train length for every learning rate of each sweep, the chosen one in
    bold; None when no sweep has more than one learning rate."""
    if not any(len(s.scores) > 1 for s in sweeps):
        return None
    rates = sorted({lr for s in sweeps for lr in s.scores}, key=lambda lr: lr or 0.0)
    several = len({(s.task, s.train_len, s.variant, s.encoding) for s in sweeps}) < len(sweeps)
    table = []
    for s in sweeps:
        cells = []
        for lr in rates:
            text = "" if lr not in s.scores else fmt(s.scores[lr])
            cells.append(f"**{text}**" if lr == s.chosen_lr else text)
        best_seed = [] if s.chosen_seed is None else [f"seed {s.chosen_seed}"]
        table.append([
            s.task, s.train_len, s.variant, s.encoding, *([s.setting] if several else []),
            *cells, " ".join([f"{s.chosen_lr:g}" if s.chosen_lr else "-", *best_seed]),
        ])  # fmt: skip
    headers = [
        "task", "train len", "variant", "encoding", *(["setting"] if several else []),
        *(f"lr {lr:g}" if lr else "lr -" for lr in rates), "chosen",
    ]  # fmt: skip
    return markdown_table(headers, table)


def chance_line(records: list[dict[str, Any]]) -> str:
    """Per task, the accuracy of always answering the most frequent training target."""
    chance: dict[str, list[float]] = defaultdict(list)
    for r in records:
        if r.get("chance_accuracy") is not None:
            chance[r["cell"]["task"]].append(r["chance_accuracy"])
    if not chance:
        return ""
    parts = [f"{task} {statistics.fmean(v):.3f}" for task, v in sorted(chance.items())]
    return f"Chance (always the most frequent training target): {', '.join(parts)}.\n\n"


def write_report(
    results: str | Path, out: str | Path | None = None, best_of: list[str] | None = None
) -> str:
    """Write report.md, results.csv and the plots next to the results; returns the markdown.
    ``best_of``: the choice's rule, the run's config's (else the last record's, see
    ``eval.harness.selection``)."""
    results = Path(results)
    out = Path(out) if out is not None else results.parent
    out.mkdir(parents=True, exist_ok=True)
    records = read_results(results)
    sweeps = choose(records, best_of)
    chosen = [r for sweep in sweeps for r in sweep.chosen]
    chosen_keys = {r["cell"]["key"] for r in chosen}
    with (out / "results.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows({**row, "chosen": row["key"] in chosen_keys} for row in rows(records))
    flat = rows(chosen)
    about = next((r["about"] for r in reversed(records) if r.get("about")), "")
    about = f"{about.strip()}\n\n" if about else ""
    text = f"# Results: {results}\n\n{about}{chance_line(chosen)}{summary_table(flat)}\n"
    unlearned = not_learned_lines(chosen)
    if unlearned:
        text += f"\n{unlearned}"
    swept = sweep_table(sweeps)
    if swept is not None:
        text += (
            "\n## Learning-rate sweep (accuracy at the train length; the chosen one in bold)\n\n"
            f"{swept}\n"
        )
    gaps = slice_table(chosen, "gap")
    if gaps is not None:  # MQAR: recall by distance from key to query
        text += f"\n## Accuracy per gap bucket (key to query distance)\n\n{gaps}\n"
    reached = reach_table(chosen)
    if reached is not None:
        text += f"\n## What each cell learned, by what its pattern reaches\n\n{VERDICTS}{reached}\n"
    if any(r["status"] == "ok" for r in flat):
        plot_accuracy_vs_length(flat, out / "accuracy_vs_length.png")
        plot_accuracy_vs_cost(flat, out / "accuracy_vs_cost.png")
        text += (
            "\n![accuracy against test length](accuracy_vs_length.png)\n"
            "![accuracy against cost](accuracy_vs_cost.png)\n"
        )
        if plot_generation(flat, out / "generation.png") is not None:
            text += "![greedy generation beside teacher-forced accuracy](generation.png)\n"
    if plot_checks(chosen, out / "training.png") is not None:
        text += "![loss and accuracy per slice during training](training.png)\n"
    (out / "report.md").write_text(text)
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m eval report", description=__doc__.splitlines()[0]
    )
    parser.add_argument("results", help="a results.jsonl written by python -m eval run")
    parser.add_argument(
        "--out", default=None, help="directory for the report (default: next to results)"
    )
    args = parser.parse_args(argv)
    results = Path(args.results)
    if results.is_dir() and (results / "results.jsonl").is_file():  # the run's out folder
        results = results / "results.jsonl"
    if not results.is_file():
        parser.error(f"results: no such file: {args.results} (the results.jsonl of a run)")
    print(write_report(results, args.out))
    return 0
