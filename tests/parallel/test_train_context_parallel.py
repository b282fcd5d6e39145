"""The harness under context parallelism (``train.context_parallel: 2`` with torchrun, one
sequence over 2 gloo processes) trains to the same losses and accuracy as one process."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import subprocess_timeout

import zoo
from eval.harness.context_parallel import check
from eval.harness.distributed import Context
from eval.tasks import get_task

CONFIG = """\
name: cp
tasks: [copy]
variants: [sliding_window]
variant_params: {sliding_window: {window_size: 16}}
encodings: [rope]
train_lengths: [64]
seeds: [0]
model: {dim: 32, depth: 2, heads: 2, mlp_dim: 0}
train: {steps: 4, batch_size: 4, lr: 0.003, eval_samples: 8, eval_batch_size: 8}
threads: 1
device: cpu
"""


def _record(launch: list[str], overrides: list[str], out: Path, cwd: Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [*launch, "-m", "eval", "run", "cp.yaml", *overrides, f"out={out}", "--no-progress"],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=subprocess_timeout(120),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads((out / "results.jsonl").read_text().splitlines()[-1])
    assert record["status"] == "ok", record.get("error")
    return record


def test_two_processes_on_one_sequence_train_as_one(tmp_path):
    (tmp_path / "cp.yaml").write_text(CONFIG)
    repo = Path(__file__).resolve().parents[2]
    os.environ["PYTHONPATH"] = f"{repo}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    one = _record([sys.executable], [], tmp_path / "one", tmp_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
              f"--master-port={port}"]  # fmt: skip
    two = _record(launch, ["train.context_parallel=2"], tmp_path / "two", tmp_path)
    assert two["cell"]["train"]["context_parallel"] == 2
    assert two["loss_curve"] == pytest.approx(one["loss_curve"], abs=1e-4)
    assert two["accuracy"] == one["accuracy"]


@pytest.mark.parametrize(
    "change, words",
    [
        ({"train_len": 63}, "not a multiple of 2"),
        ({"task": "listops"}, "per-token"),
        ({"encoding": "learned"}, "adds a table"),
        # NSA's branches attend within each rank's shard: it trained on wrong attention
        ({"variant": "nsa"}, "variant 'nsa' is a module of its own .* does not shard"),
    ],
)
def test_a_cell_that_cannot_train_sharded_says_what_to_change(change, words):
    cell = {"train": {"context_parallel": 2}, "train_len": 64, "task": "copy", "encoding": "rope",
            "variant": "local"}  # fmt: skip
    cell.update(change)
    task = SimpleNamespace(head="sequence" if cell["task"] == "listops" else "token")
    kind = "embed" if cell["encoding"] == "learned" else "rotate"
    with pytest.raises(ValueError, match=words):
        check(cell, Context(0, 2, torch.device("cpu")), task, kind)


def test_the_number_of_processes_must_be_the_number_of_shards():
    cell = {"train": {"context_parallel": 2}, "train_len": 64, "task": "copy", "encoding": "rope",
            "variant": "local"}  # fmt: skip
    with pytest.raises(ValueError, match="--nproc-per-node 2"):
        check(cell, Context(0, 1, torch.device("cpu")), get_task("copy", seq_len=64), "rotate")


def test_use_context_parallel_refuses_a_module_that_does_not_shard():
    """NSA has no cp_group: use_context_parallel skipped it, and each rank attended within its
    own shard as if it were the whole sequence (rank 1 off by 0.57 from the whole's rows)."""
    model = torch.nn.Sequential(zoo.create_attention("local", dim=16, num_heads=2),
                                zoo.create_attention("nsa", dim=16, num_heads=2))  # fmt: skip
    with pytest.raises(
        ValueError,
        match=r"use_context_parallel: 1 is a NativeSparseAttention, "
        r"which does not shard over processes: its compressed",
    ):
        zoo.parallel.use_context_parallel(model, group=object())
    assert model[0].cp_group is None, "nothing is set when one is refused"
    assert zoo.parallel.use_context_parallel(model, group=None) is model
