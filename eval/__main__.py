"""``python -m eval COMMAND`` (or ``zoo-eval COMMAND``): the harness's commands.

run CONFIG.yaml [key=value ...]   train and evaluate a sweep (eval/configs/quick.yaml: minutes)
report RESULTS.jsonl              markdown, CSV and plots from a sweep's results
bench [CONFIG.yaml] [key=value]   time and memory of every variant and backend, with peers
bench-report BENCH.json [...]     one report from a sweep run in pieces (out=DIR), or re-rendered
attention-map CHECKPOINT          one head's weights in a trained model (save_checkpoints=true)
auto-table BENCH.json [...]       the table behind backend="auto", from benchmark results
demo                              every variant forward and backward once, with its cost
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "run": "eval.run",
    "report": "eval.report",
    "bench": "eval.bench",
    "bench-report": "eval.bench_merge",
    "attention-map": "eval.attention_map",
    "auto-table": "eval.auto_table",
    "demo": "eval.demo",
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        print(__doc__, file=sys.stderr)
        return 2
    return importlib.import_module(COMMANDS[argv[0]]).main(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())
