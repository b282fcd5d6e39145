"""``launcher: ray``: every cell of a sweep a Ray task, on one machine or a cluster.

Each cell declares what it needs (``resources``: one GPU by default where the cluster has GPUs,
``threads`` CPUs) and Ray schedules it; the harness neither shards nor pins. The driver alone
writes: each task returns its record, appended whole to the one ``results.jsonl`` as the cell
ends (no node writes to shared disk), and the report comes at the end as with the local
launcher. Resume is the local launcher's: the cells already recorded ok are skipped, whichever
launcher ran them.

Faults. A task whose worker process dies (killed, out of memory, a node lost) runs again, up to
``max_retries`` times, and is recorded once; a cell that fails for its own reason (a backend that
cannot run it) returns a failed record, as locally, and is not retried. Ctrl-C cancels the tasks
still running or waiting; the file holds whole records only.

A cell over several processes (``resources: {processes: N}``, by default N = gpus where a cell
asks for 2 or more GPUs: data or context parallelism) runs ``torchrun`` inside its task, on the
GPUs (or CPUs) Ray gave it, with the harness's own torch.distributed path; its record comes back
through a file of the task's own. Ray Train's ``TorchTrainer`` would do the same through its own
reporting and checkpoint layer, a second way to train a cell; ``torchrun`` is the way the
harness already trains one, and that path is tested.

``ray`` is an optional extra (``pip install -e .[ray]``); ``import zoo`` and ``import eval``
never import it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from . import distributed
from .config import ConfigError
from .workers import append_record

# A task reports its cell's step to the driver at most this often (seconds).
REPORT_EVERY = 1.0
# The test hook for a worker that dies mid-cell: a cell whose key is in this variable (keys
# separated by commas) kills its worker process once, as it starts (tests/eval/test_ray.py).
KILL_ONCE = "ZOO_RAY_KILL_ONCE"


def run_on_ray(
    config, source: str, overrides: list[str], sweep: list[dict[str, Any]], done: set[str],
    results: Path, run_cell: Callable, show_progress: bool = True,
    check_cells: Callable | None = None,
) -> int:  # fmt: skip
    """Run the cells of ``sweep`` not in ``done`` as Ray tasks, each record appended to
    ``results``; 0 when every cell got a record, 130 on Ctrl-C. ``run_cell(cell, config,
    context, progress)`` trains one cell and ``check_cells(cells, source, world)`` refuses, with
    a ConfigError, cells that cannot train over ``world`` processes, here before any task starts
    (``eval.harness.run``'s, handed over so that this module does not import the one that calls
    it)."""
    ray = _import_ray()
    address = config.ray_address or os.environ.get("RAY_ADDRESS", "")
    _check_reachable(address)
    _init(ray, address)
    results.parent.mkdir(parents=True, exist_ok=True)
    todo = [c for c in sweep if c["key"] not in done]
    print(f"{source}: {len(todo)} cells to run on Ray, {len(sweep) - len(todo)} done in {results}",
          flush=True)  # fmt: skip
    needs = _resources(config, ray.cluster_resources())
    if check_cells is not None:  # the driver now knows each task's processes
        check_cells(todo, source, needs["processes"])
    progress = _progress_actor().remote() if todo else None
    task = ray.remote(_train_cell).options(
        num_cpus=needs["cpus"], num_gpus=needs["gpus"], max_retries=config.max_retries,
        retry_exceptions=False,
    )  # fmt: skip
    kill_once = os.environ.get(KILL_ONCE, "").split(",")
    trainer = (run_cell, source, overrides, needs["processes"], progress, kill_once, results.parent)
    running = {task.remote(cell, config, *trainer): cell for cell in todo}
    bar = _bar(len(todo), show_progress)
    failed, started = 0, time.time()
    try:
        while running:
            ready, _ = ray.wait(list(running), num_returns=1, timeout=REPORT_EVERY)
            for ref in ready:
                cell = running.pop(ref)
                record = _record_of(ray, ref, cell, config)
                append_record(results, json.dumps(record) + "\n")
                failed += record["status"] != "ok"
                _show(bar, record, cell)
            _status(bar, ray, progress, running, failed, started)
    except KeyboardInterrupt:
        print(f"interrupted: {len(running)} cells cancelled; {results} holds whole records only",
              file=sys.stderr, flush=True)  # fmt: skip
        _cancel(ray, list(running), local=not address)
        return 130
    finally:
        if bar is not None:
            bar.close()
    return 0


def _cancel(ray, refs: list, local: bool) -> None:
    """Stop the sweep's tasks: a local cluster goes down with them; on a cluster each task is
    asked to stop (a forced cancel raced with replies of tasks just done and crashed Ray 2.60's
    driver: "Tried to complete task that was not pending")."""
    if local:
        ray.shutdown()
        return
    for ref in refs:
        ray.cancel(ref)


def _import_ray():
    try:
        import ray
    except ImportError as error:
        raise ConfigError(
            f"launcher=ray needs Ray, which is not installed here ({error}); install the extra: "
            "pip install -e '.[ray]'"
        ) from error
    return ray


def _check_reachable(address: str, timeout: float = 3.0) -> None:
    """Fail within seconds, naming the address, where nothing answers at HOST:PORT (Ray itself
    retries a missing cluster for a minute or more)."""
    if not address or address == "auto":
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            return
    except (OSError, ValueError) as error:
        raise ConfigError(
            f"no Ray cluster answers at ray_address={address!r} ({error}); give the address that "
            "`ray start --head` printed, as HOST:PORT, or leave ray_address and RAY_ADDRESS "
            "unset to start a local Ray cluster"
        ) from error


def _init(ray, address: str) -> None:
    if ray.is_initialized():
        return
    if not address:  # a local cluster in this process; the packages are installed here
        ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False)
        return
    # On a cluster the nodes get this checkout's zoo and eval with the job.
    root = Path(__file__).resolve().parents[2]
    ray.init(
        address=address, log_to_driver=False, configure_logging=False,
        runtime_env={"py_modules": [str(root / "zoo"), str(root / "eval")]},
    )  # fmt: skip


def _resources(config, cluster: dict[str, float]) -> dict[str, float]:
    """What one cell asks Ray for (see ``RunConfig.resources``)."""
    asked = config.resources
    on_gpus = config.device != "cpu" and cluster.get("GPU", 0) > 0
    gpus = float(asked.get("gpus", 1 if on_gpus else 0))
    processes = int(asked.get("processes", gpus if gpus >= 2 else 1))
    cpus = float(asked.get("cpus", max(config.threads, 1) * processes))
    return {"gpus": gpus, "cpus": cpus, "processes": processes}


def _train_cell(
    cell: dict[str, Any], config, run_cell: Callable, source: str, overrides: list[str],
    processes: int, progress, kill_once: list[str], out: Path,
) -> dict[str, Any]:  # fmt: skip
    """A Ray task: one cell's record (in a worker process Ray chose, with the devices it gave)."""
    if cell["key"] in kill_once:
        _die_once(out / f".killed-{cell['key']}")
    if processes > 1:
        return _under_torchrun(cell, source, overrides, processes)
    context = distributed.Context(0, 1, distributed.pick_device(config.device))
    with distributed.thread_count(config.threads):
        return run_cell(cell, config, context, _Steps(progress, cell["key"]))


def _die_once(marker: Path) -> None:
    if not marker.exists():
        marker.touch()
        os.kill(os.getpid(), signal.SIGKILL)


def _under_torchrun(
    cell: dict[str, Any], source: str, overrides: list[str], processes: int
) -> dict[str, Any]:
    """The cell trained by ``processes`` ranks (``torchrun --standalone``), its record read
    back from the file rank 0 wrote."""
    with tempfile.TemporaryDirectory() as folder:
        record_file = Path(folder) / "record.jsonl"
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={processes}", "-m", "eval", "run", source, *overrides,
            "--no-progress", "--no-report", "--cell", cell["key"], str(record_file),
        ]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        lines = record_file.read_text().splitlines() if record_file.exists() else []
        if done.returncode != 0 or not lines:
            raise RuntimeError(
                f"torchrun over {processes} processes ended with status {done.returncode}: "
                f"{done.stderr[-2000:]}"
            )
        return json.loads(lines[-1])


def _record_of(ray, ref, cell: dict[str, Any], config) -> dict[str, Any]:
    """The task's record, or a failed one naming why Ray could not give one (its worker died
    more than max_retries times, or the task could not run)."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayError as error:
        return {
            "cell": cell,
            "best_of": config.best_of,
            "status": "failed",
            "reason": f"{type(error).__name__} on Ray after {config.max_retries} retries: "
            f"{str(error).splitlines()[0] if str(error) else ''}",
        }


class _Steps:
    """The training loop's progress object inside a task: reports the cell's step to the
    driver's progress actor, at most every REPORT_EVERY seconds."""

    def __init__(self, actor, key: str) -> None:
        self.actor, self.key, self.step, self.sent = actor, key, 0, 0.0

    def update(self, n: int = 1) -> None:
        self.step += n
        if self.actor is not None and time.time() - self.sent >= REPORT_EVERY:
            self.sent = time.time()
            self.actor.report.remote(self.key, self.step)

    def set_postfix(self, *args, **kwargs) -> None:
        pass

    def set_description(self, *args, **kwargs) -> None:
        pass


def _progress_actor():
    import ray

    @ray.remote(num_cpus=0)
    class Progress:
        """The running cells' steps, as their tasks report them."""

        def __init__(self) -> None:
            self.steps: dict[str, int] = {}

        def report(self, key: str, step: int) -> None:
            self.steps[key] = step

        def snapshot(self) -> dict[str, int]:
            return dict(self.steps)

    return Progress


def _bar(total: int, enabled: bool):
    if not enabled or total == 0:
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="cell", dynamic_ncols=True, file=sys.stderr)


def _show(bar, record: dict[str, Any], cell: dict[str, Any]) -> None:
    label = f"{cell['task']} L={cell['train_len']} {cell['variant']}+{cell['encoding']} " \
        f"seed {cell['seed']}"  # fmt: skip
    if bar is None:
        print(f"{label}: {record['status']} {record.get('accuracy', record.get('reason'))}",
              flush=True)  # fmt: skip
    else:
        bar.update(1)


def _status(bar, ray, progress, running: dict, failed: int, started: float) -> None:
    """The bar's line: done, running (with their steps where tasks reported them), failed."""
    if bar is None or progress is None:
        return
    try:
        steps = ray.get(progress.snapshot.remote(), timeout=REPORT_EVERY)
    except ray.exceptions.RayError:
        steps = {}
    shown = [f"{steps[c['key']]}" for c in running.values() if c["key"] in steps]
    bar.set_postfix(running=len(running), failed=failed,
                    steps=",".join(shown[:4]) or "-", refresh=False)  # fmt: skip
    bar.refresh()
