"""``python -m eval COMMAND`` (or ``zoo-eval COMMAND``): the commands of the harness
(eval/harness), the benchmark (eval/bench) and the demo.

run CONFIG.yaml [key=value ...]   train and evaluate a sweep (eval/configs/quick.yaml: minutes)
report RESULTS.jsonl              markdown, CSV and plots from a sweep's results
findings [NAME ...]               published findings beside the harness's, with verdicts
bench [CONFIG.yaml] [key=value]   time and memory of every variant and backend, with peers
bench-decode [CONFIG.yaml] [k=v]  one generation step against a cache, 1K to 64K tokens
bench-cp [CONFIG.yaml] [k=v]      context parallelism: bytes per rank and time, N processes
bench-profile CONFIG.yaml [k=v]   kernels, kernel time and host gaps of each cell (torch.profiler)
bench-compiles [CONFIG] [k=v]     compiles that distinct lengths cost through the flex backend
bench-overhead [CONFIG] [k=v]     the host time and operations a call adds around the kernel
goals OUT [OUT ...] [k=v]         which goals of the GPU campaign (gpu_session.sh all) hold
bench-report BENCH.json [...]     one report from a sweep run in pieces (out=DIR), or re-rendered
attention-map CHECKPOINT          one head's weights in a trained model (save_checkpoints=true)
auto-table BENCH.json [...]       the table behind backend="auto", from benchmark results
demo                              every variant forward and backward once, with its cost

python -m eval COMMAND --help: that command's options. With no command or an unknown one, this
text goes to stderr and the exit status is 2; --help, -h or help print it and exit 0.
"""

from __future__ import annotations

import importlib
import os
import sys

COMMANDS = {
    "run": "eval.harness.run",
    "report": "eval.harness.report",
    "findings": "eval.findings.report",
    "bench": "eval.bench.run",
    "bench-decode": "eval.bench.decode",
    "bench-report": "eval.bench.merge",
    "bench-cp": "eval.bench.context_parallel",
    "bench-profile": "eval.bench.profile",
    "bench-compiles": "eval.bench.compiles",
    "bench-overhead": "eval.bench.overhead",
    "goals": "eval.bench.goals",
    "attention-map": "eval.harness.attention_map",
    "auto-table": "eval.bench.auto_table",
    "demo": "eval.demo",
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in (*COMMANDS, "-h", "--help", "help"):
        if argv:
            print(f"python -m eval: unknown command {argv[0]!r}", file=sys.stderr)
        print(__doc__, file=sys.stderr)
        return 2
    try:
        if argv[0] in COMMANDS:
            status = importlib.import_module(COMMANDS[argv[0]]).main(argv[1:]) or 0
        else:  # --help, -h, help
            print(__doc__)
            status = 0
        sys.stdout.flush()
    except BrokenPipeError:  # the reader went away (``| head``): exit quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    return status


if __name__ == "__main__":
    sys.exit(main())
