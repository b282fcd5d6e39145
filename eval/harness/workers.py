"""Cells trained side by side: ``workers: N`` runs a sweep's cells in N processes at once, each
with the config's ``threads``, so that a 2-core CPU trains two small models at a time (one
thread each) instead of one. The harness's models are too small for two threads to speed one up
(eval/harness/run.py, ``threads``), so a sweep's wall time on such a machine halves.

Each worker is ``python -m eval run CONFIG ... --shard K/N``: it takes every N-th cell not yet
done, from the K-th on, and appends its records to the one results file under a lock; the
parent waits for all of them and writes the report. Results do not depend on the number of
workers (every cell's seeds are its own). With several GPUs each worker has its own
(``CUDA_VISIBLE_DEVICES``); on one GPU, workers share it; under torchrun, keep 1. Beyond one
machine: ``launcher: ray`` (ray_launcher.py).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path


def parse_shard(text: str) -> tuple[int, int]:
    """``"K/N"`` -> (K, N) with 0 <= K < N; a ValueError naming the value otherwise."""
    try:
        index, count = (int(part) for part in text.split("/"))
    except ValueError:
        index, count = -1, 0
    if not 0 <= index < count:
        raise ValueError(f"--shard must be K/N with 0 <= K < N (e.g. 0/2), got {text!r}")
    return index, count


def run_in_processes(config: str, overrides: list[str], workers: int, gpus: int = 0) -> int:
    """Run the sweep in ``workers`` processes; returns the worst exit status. With ``gpus``,
    worker k sees GPU k mod gpus alone (``CUDA_VISIBLE_DEVICES``): a machine's GPUs shared out,
    not every worker on the first."""
    command = [sys.executable, "-m", "eval", "run", config, *overrides]
    processes = [
        subprocess.Popen(
            [*command, "--shard", f"{k}/{workers}", "--no-report", "--no-progress"],
            env=worker_environment(k, gpus),
        )
        for k in range(workers)
    ]
    try:
        return max(p.wait() for p in processes)
    finally:
        for p in processes:  # an interrupted parent stops its workers
            if p.poll() is None:
                p.terminate()


def worker_environment(k: int, gpus: int) -> dict[str, str]:
    """Worker k's environment: this one, with its own GPU where there are GPUs to share out
    (CUDA_VISIBLE_DEVICES indexes the GPUs this process was given, if it was given a list)."""
    env = dict(os.environ)
    if gpus:
        visible = env.get("CUDA_VISIBLE_DEVICES")
        ids = visible.split(",") if visible else [str(i) for i in range(gpus)]
        env["CUDA_VISIBLE_DEVICES"] = ids[k % len(ids)]
    return env


def append_record(path: Path, line: str) -> None:
    """Append one line to ``path`` whole, even with other workers appending to it, on a line of
    its own: after a line that a crash cut short (no newline at its end), a new one starts, so
    the cut line alone is lost, not the record after it."""
    with path.open("a") as f, _locked(f):
        if f.tell() and not _ends_a_line(path):
            f.write("\n")
        f.write(line)
        f.flush()


def _ends_a_line(path: Path) -> bool:
    with path.open("rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"


@contextlib.contextmanager
def _locked(f):
    try:
        import fcntl
    except ImportError:  # no POSIX locks (Windows): one worker per results file
        yield
        return
    fcntl.flock(f.fileno(), fcntl.LOCK_EX)
    try:
        yield
    finally:
        fcntl.flock(f.fileno(), fcntl.LOCK_UN)
