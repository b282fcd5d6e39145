"""``python -m eval.bench.derived_states``: the time to build block states derived from
``allowed`` (``zoo.patterns.derived``, a pattern that defines nothing else) against a family's
formulas, for a band of 256 keys on each side, blocks of 128, at 4K, 16K and 64K tokens; the two
must agree block for block."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

import zoo
from zoo.layout.frames import build_frame
from zoo.patterns.derived import derived_block_state


@dataclass(frozen=True)
class OnlyAllowed(zoo.Pattern):
    """``Local(w)`` without its formulas."""

    w: int = 256

    def allowed(self, q_pos, kv_pos):
        return (q_pos - kv_pos).abs() <= self.w


def main(argv: list[str] | None = None) -> int:
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| tokens | derived ms | formulas ms |")
    print("|---|---|---|")
    for n in (4096, 16384, 65536):
        frame = build_frame(1, n, n, 128, 128, torch.device("cpu"))
        q, k = frame.q.spans().column(), frame.k.spans().row()
        start = time.perf_counter()
        derived = derived_block_state(OnlyAllowed(), q, k)
        middle = time.perf_counter()
        formulas = zoo.patterns.Local(256).block_state(q, k)
        end = time.perf_counter()
        if not torch.equal(derived, formulas):
            raise SystemExit(f"derived block states differ from Local's formulas at {n} tokens")
        print(f"| {n} | {(middle - start) * 1e3:.0f} | {(end - middle) * 1e3:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
