"""``launcher: ray``: the same records as the local launcher, a killed task retried and recorded
once, resume across launchers, Ctrl-C leaving whole records, a bad address named within
seconds, and Ray never imported by ``import zoo`` or ``import eval``.

One local Ray cluster of 2 CPUs serves the module (its start costs seconds); the sweeps are the
harness's tiny ones (seconds a cell)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import TINY_SWEEP, subprocess_timeout

from eval.harness import ray_launcher
from eval.harness.config import ConfigError
from eval.harness.run import main, resolve_workers
from eval.harness.workers import worker_environment

ray = pytest.importorskip("ray", reason="Ray is an optional extra: pip install -e '.[ray]'")
pytestmark = pytest.mark.ray

ROOT = Path(__file__).resolve().parents[2]
QUICK = str(ROOT / "eval/configs/quick.yaml")
TINY = [
    *TINY_SWEEP,
    "variants=[local, full, bigbird]",
    "variant_params={local: {window_size: 4}, bigbird: {block_size: 8}}",
]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


def records(out: Path) -> dict[str, dict]:
    lines = (out / "results.jsonl").read_text().splitlines()
    return {r["cell"]["key"]: r for r in map(json.loads, lines)}


def sweep(out: Path, *extra: str) -> int:
    return main(["--no-progress", QUICK, *TINY, f"out={out}", *extra])


def test_ray_writes_the_records_of_one_process_and_of_workers(cluster, tmp_path):
    assert sweep(tmp_path / "ray", "launcher=ray") == 0
    assert sweep(tmp_path / "one") == 0
    done = subprocess.run(
        [sys.executable, "-m", "eval", "run", QUICK, *TINY, f"out={tmp_path / 'two'}",
         "workers=2", "--no-progress", "--no-report"],
        env=ENV, capture_output=True, text=True, timeout=subprocess_timeout(300),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    on_ray, one, two = (records(tmp_path / name) for name in ("ray", "one", "two"))
    assert on_ray.keys() == one.keys() == two.keys() and len(on_ray) == 3
    for key, record in on_ray.items():
        assert record["status"] == "ok", record.get("reason")
        for other in (one[key], two[key]):
            assert record["cell"] == other["cell"]  # the seeds and settings
            assert record["accuracy"] == other["accuracy"]
            assert record["loss_curve"] == other["loss_curve"]
    assert (tmp_path / "ray" / "report.md").exists()


def _keys(tmp_path: Path, *extra: str) -> set[str]:
    """The cell keys of a sweep, from its config alone."""
    from eval.harness.config import load_config
    from eval.harness.run import RunConfig, cells

    return {c["key"] for c in cells(load_config(RunConfig, QUICK, [*TINY, *extra]))}


def test_a_task_whose_worker_dies_is_retried_and_recorded_once(cluster, tmp_path, monkeypatch):
    assert sweep(tmp_path / "plain", "variants=[full]") == 0
    (key,) = records(tmp_path / "plain")
    assert {key} == _keys(tmp_path, "variants=[full]")
    monkeypatch.setenv(ray_launcher.KILL_ONCE, key)
    out = tmp_path / "killed"
    assert sweep(out, "launcher=ray", "variants=[full]") == 0
    assert (out / f".killed-{key}").exists()  # its worker was killed once
    lines = (out / "results.jsonl").read_text().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["status"] == "ok"
    assert json.loads(lines[0])["accuracy"] == records(tmp_path / "plain")[key]["accuracy"]


def test_a_death_past_max_retries_is_recorded_failed_once(cluster, tmp_path, monkeypatch):
    """With no retry the first death is final: one failed record that says so."""
    key = next(iter(_keys(tmp_path, "variants=[full]")))
    out = tmp_path / "dead-once"
    monkeypatch.setenv(ray_launcher.KILL_ONCE, key)
    assert sweep(out, "launcher=ray", "variants=[full]", "max_retries=0") == 0
    (record,) = records(out).values()
    assert record["status"] == "failed" and "after 0 retries" in record["reason"]


def test_a_sweep_resumes_under_either_launcher(cluster, tmp_path):
    out = tmp_path / "resume"
    assert sweep(out, "variants=[local]") == 0  # the local launcher runs one cell
    assert sweep(out, "launcher=ray") == 0  # Ray runs the other two
    assert sweep(out) == 0  # nothing left for the local launcher
    lines = (out / "results.jsonl").read_text().splitlines()
    assert len(lines) == 3 and len(records(out)) == 3
    # and the other way round: Ray first, the local launcher after
    other = tmp_path / "resume-2"
    assert sweep(other, "launcher=ray", "variants=[full]") == 0
    assert sweep(other) == 0
    assert len((other / "results.jsonl").read_text().splitlines()) == 3


def test_a_cell_over_two_processes_runs_under_torchrun_in_its_task(cluster, tmp_path):
    out = tmp_path / "ddp"
    assert sweep(out, "launcher=ray", "variants=[full]", "resources={processes: 2, cpus: 2}") == 0
    (record,) = records(out).values()
    assert record["status"] == "ok", record.get("reason")
    assert record["environment"]["world_size"] == 2


def test_a_cell_that_cannot_split_over_its_task_s_processes_is_refused_at_launch(
    cluster, tmp_path, capsys
):
    """A batch of 3 over a task's 2 processes: refused by the driver before any task starts (it
    was a failed record per cell, after scheduling), naming the batch and the processes."""
    out = tmp_path / "odd"
    extra = ("launcher=ray", "variants=[full]", "resources={processes: 2, cpus: 2}")
    assert sweep(out, *extra, "train.batch_size=3") == 2
    assert "train.batch_size=3 does not split over the 2 processes" in capsys.readouterr().err
    assert not (out / "results.jsonl").exists() or not (out / "results.jsonl").read_text()


def _default_interrupt() -> None:
    """In the child, before it starts: Ctrl-C's default action, as a terminal gives it. An
    ignored signal stays ignored across exec, and the pytest-xdist worker that runs this test
    under the whole suite had SIGINT ignored: the sweep then ran to its end (exit status 0)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_cancels_the_tasks_and_leaves_whole_records(tmp_path):
    out = tmp_path / "interrupted"
    slow = ["train={steps: 100, batch_size: 8, eval_samples: 16, eval_batch_size: 8}",
            "seeds=[0, 1, 2, 3, 4, 5, 6, 7]"]  # fmt: skip  # more cells than most machines' cores
    process = subprocess.Popen(
        [sys.executable, "-m", "eval", "run", QUICK, *TINY, *slow, f"out={out}",
         "launcher=ray", "--no-progress", "--no-report"],
        env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=_default_interrupt,
    )  # fmt: skip
    deadline = time.time() + subprocess_timeout(120)
    results = out / "results.jsonl"
    while time.time() < deadline and not (results.exists() and results.read_text().strip()):
        time.sleep(0.5)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=subprocess_timeout(60))
    assert process.returncode == 130, stderr[-3000:]
    assert "cells cancelled" in stderr
    kept = [json.loads(line) for line in results.read_text().splitlines()]  # every line whole
    assert 1 <= len(kept) < 24


def test_a_bad_address_fails_within_seconds_and_names_it(tmp_path):
    start = time.time()
    done = subprocess.run(
        [sys.executable, "-m", "eval", "run", QUICK, *TINY, f"out={tmp_path}", "launcher=ray",
         "ray_address=127.0.0.1:9"],
        env=ENV, capture_output=True, text=True, timeout=subprocess_timeout(60),
    )  # fmt: skip
    assert done.returncode == 2
    assert "no Ray cluster answers at ray_address='127.0.0.1:9'" in done.stderr
    assert time.time() - start < 20  # Python and torch's imports included


def test_without_ray_installed_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError
    with pytest.raises(ConfigError, match=r"pip install -e '\.\[ray\]'"):
        ray_launcher._import_ray()


def test_import_zoo_and_eval_never_import_ray():
    done = subprocess.run(
        [sys.executable, "-c", "import sys, zoo, eval, eval.harness.run, eval.harness.ray_launcher;"
         " assert 'ray' not in sys.modules, 'ray imported'"],
        env=ENV, capture_output=True, text=True, timeout=subprocess_timeout(60),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]


def test_local_workers_get_a_gpu_each_and_auto_counts_them(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert [worker_environment(k, 4)["CUDA_VISIBLE_DEVICES"] for k in range(5)] == list("01230")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,7")
    assert [worker_environment(k, 2)["CUDA_VISIBLE_DEVICES"] for k in range(3)] == list("575")
    assert worker_environment(0, 0)["CUDA_VISIBLE_DEVICES"] == "5,7"  # no GPUs to share out
    monkeypatch.setattr("eval.harness.run.gpu_count", lambda: 8)
    assert resolve_workers("auto") == 8 and resolve_workers(3) == 3
    monkeypatch.setattr("eval.harness.run.gpu_count", lambda: 0)
    assert resolve_workers("auto") == (os.cpu_count() or 1)
