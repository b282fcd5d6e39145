"""The eval harness: a tiny run learns, sweeps resume and survive failing cells, torchrun gives
the same results, the report renders, and bad configs fail with the file and the key."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import TINY_SWEEP, subprocess_timeout

import eval.harness.train
from eval.harness import distributed
from eval.harness.config import ConfigError, load_config
from eval.harness.report import write_report
from eval.harness.run import RunConfig, cells, check_cells, check_names, run

ROOT = Path(__file__).resolve().parents[2]
QUICK = "eval/configs/quick.yaml"
CPU = distributed.Context(0, 1, torch.device("cpu"))
TINY = TINY_SWEEP


def tiny(tmp_path: Path, *extra: str) -> RunConfig:
    config = load_config(RunConfig, None, [*TINY, f"out={tmp_path}", *extra])
    check_names(config, "test")
    check_cells(cells(config), "test")
    return config


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_full_attention_learns_associative_recall(tmp_path):
    config = tiny(
        tmp_path,
        "variants=[full]",
        "task_params={mqar: {vocab_size: 16, num_kv_pairs: 2}}",
        "train={steps: 1200, batch_size: 32, lr: 0.003, eval_samples: 256}",
        "test_lengths=[32]",
    )
    (record,) = read(run(config, "test", CPU, show_progress=False))
    assert record["status"] == "ok", record.get("reason")
    # Values come from 8 symbols (chance 1/8); knowing only which 2 values a sequence holds gives
    # 1/2. Above that the model recalls which value belongs to which key.
    assert record["accuracy"]["32"] >= 0.6, record["accuracy"]


def test_records_hold_what_the_report_needs(tmp_path):
    config = tiny(
        tmp_path,
        "variants=[local, bigbird]",
        "variant_params={local: {window_size: 4}, bigbird: {block_size: 8}}",
    )
    records = read(run(config, "test", CPU, show_progress=False))
    assert [r["cell"]["variant"] for r in records] == ["local", "bigbird"]
    for r in records:
        assert r["status"] == "ok"
        assert set(r["accuracy"]) == {"32", "64"} and all(
            0 <= a <= 1 for a in r["accuracy"].values()
        )
        assert {"gap", "num_kv_pairs"} <= set(r["slices"]["64"])
        assert r["steps_per_second"] > 0 and r["environment"]["torch"] == torch.__version__
        if (ROOT / ".git").exists() and shutil.which("git"):  # the commit it ran at, marked
            # when the tree had changes
            assert re.fullmatch(r"[0-9a-f]{12}(\+changes)?", r["environment"]["commit"])
        assert r["cell"]["variant_params"] and r["cell"]["key"]


def test_routed_variants_train_and_the_report_tables_gaps(tmp_path):
    """moba (a pattern chosen by content) and nsa (a module entry) run as any variant, and the
    report puts MQAR's accuracy per gap bucket side by side."""
    config = tiny(
        tmp_path,
        "variants=[moba, nsa]",
        "causal=true",
        "variant_params={moba: {block_size: 8, top_k: 2}, nsa: {block_length: 8, "
        "block_stride: 8, select_block: 8, select_count: 2, num_local: 1, window: 8}}",
    )
    records = read(run(config, "test", CPU, show_progress=False))
    assert [r["status"] for r in records] == ["ok", "ok"], [r.get("reason") for r in records]
    text = write_report(tmp_path / "results.jsonl")
    assert "## Accuracy per gap bucket" in text
    gap_row = next(
        line for line in text.splitlines() if line.startswith("| mqar | 64 ") and "nsa" in line
    )
    buckets = sorted(records[1]["slices"]["64"]["gap"], key=float)
    assert gap_row.count("|") == 4 + len(buckets) + 1


@pytest.mark.usefixtures("scalar_cpu_code")
def test_a_compiled_model_trains_to_the_eager_loss(tmp_path):
    """train.compile=true compiles the model with fullgraph=True (a graph break would fail the
    cell) and trains to the loss of eager mode."""
    losses = {}
    for compiled in ("false", "true"):
        config = tiny(
            tmp_path / compiled, "variants=[bigbird]", "variant_params={bigbird: {block_size: 8}}",
            "encodings=[rope]", "test_lengths=[32]", f"train={{steps: 3, batch_size: 4, "
            f"eval_samples: 8, eval_batch_size: 4, compile: {compiled}}}",
        )  # fmt: skip
        (record,) = read(run(config, "test", CPU, show_progress=False))
        assert record["status"] == "ok", record.get("reason")
        assert record["steady_steps_per_second"] > 0
        losses[compiled] = record["final_loss"]
    assert losses["true"] == pytest.approx(losses["false"], abs=1e-4)


def test_an_interrupted_sweep_resumes_without_recomputing(tmp_path, monkeypatch):
    config = tiny(
        tmp_path, "variants=[full, local, block_local]", "variant_params={local: {window_size: 4}}"
    )
    real_train, calls = eval.harness.train.train, []

    def interrupt_second_cell(cell, context, *rest):
        calls.append(cell["variant"])
        if calls == ["full", "local"]:
            raise KeyboardInterrupt  # as if killed after the first cell
        return real_train(cell, context, *rest)

    monkeypatch.setattr(eval.harness.train, "train", interrupt_second_cell)
    with pytest.raises(KeyboardInterrupt):
        run(config, "test", CPU, show_progress=False)
    first = (tmp_path / "results.jsonl").read_text()
    assert [r["cell"]["variant"] for r in read(tmp_path / "results.jsonl")] == ["full"]

    calls.clear()
    results = run(config, "test", CPU, show_progress=False)
    assert calls == ["local", "block_local"], "the finished cell must not run again"
    assert results.read_text().startswith(first), "nothing already written may change"
    assert [r["cell"]["variant"] for r in read(results)] == ["full", "local", "block_local"]
    calls.clear()
    run(config, "test", CPU, show_progress=False)
    assert calls == []


def test_a_line_cut_by_a_crash_costs_its_own_record_only(tmp_path):
    """A crash cut the last record short (no newline): the next record starts a line of its own
    and counts as done, the cut cell runs again, and the report leaves the cut line out with a
    warning (before, the next record was glued to the cut line, lost, trained again on every
    resume, and the report raised)."""
    config = tiny(tmp_path, "variants=[full, local]", "variant_params={local: {window_size: 4}}")
    results = run(config, "test", CPU, show_progress=False)
    lines = results.read_text().splitlines()
    results.write_text(lines[0] + "\n" + lines[1][: len(lines[1]) // 2])  # local's, cut
    run(config, "test", CPU, show_progress=False)
    lines = results.read_text().splitlines()
    assert len(lines) == 3 and [json.loads(lines[i])["cell"]["variant"] for i in (0, 2)] == [
        "full", "local"]  # fmt: skip
    before = results.read_text()
    run(config, "test", CPU, show_progress=False)
    assert results.read_text() == before, "every cell is done: nothing runs again"
    with pytest.warns(UserWarning, match=r"results.jsonl:2: not a JSON line, left out"):
        write_report(results)


def test_a_failing_cell_is_recorded_and_the_sweep_goes_on(tmp_path, monkeypatch):
    config = tiny(tmp_path, "variants=[full, local]", "variant_params={local: {window_size: 4}}")
    real_train = eval.harness.train.train

    def out_of_memory_for_full(cell, context, *rest):
        if cell["variant"] == "full":
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 GiB")
        return real_train(cell, context, *rest)

    monkeypatch.setattr(eval.harness.train, "train", out_of_memory_for_full)
    failed, ok = read(run(config, "test", CPU, show_progress=False))
    assert failed["status"] == "failed" and "out of memory" in failed["reason"]
    assert ok["status"] == "ok" and ok["cell"]["variant"] == "local"
    # The next run retries the failed cell only (the memory is there now).
    monkeypatch.setattr(eval.harness.train, "train", real_train)
    *_, retried = read(run(config, "test", CPU, show_progress=False))
    assert retried["cell"]["variant"] == "full" and retried["status"] == "ok"
    assert len(read(tmp_path / "results.jsonl")) == 3


def test_a_backend_that_cannot_train_fails_its_cell_not_the_sweep(tmp_path):
    config = tiny(
        tmp_path, "variants=[local]", "backend=flex", "variant_params={local: {window_size: 4}}"
    )
    (record,) = read(run(config, "test", CPU, show_progress=False))
    assert record["status"] == "failed" and "no backward pass on cpu" in record["reason"]


def test_report_renders_tables_and_plots(tmp_path):
    config = tiny(tmp_path, "variants=[full, local]", "variant_params={local: {window_size: 4}}")
    results = run(config, "test", CPU, show_progress=False)
    text = write_report(results)
    assert "| mqar" in text and "local" in text and "full" in text
    csv_lines = (tmp_path / "results.csv").read_text().splitlines()
    assert len(csv_lines) == 1 + 2 * 2  # header, 2 cells x 2 test lengths
    for name in ("accuracy_vs_length.png", "accuracy_vs_cost.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "report.md").read_text() == text


def test_two_process_torchrun_gives_the_same_results_shape(tmp_path):
    config_file = tmp_path / "tiny.yaml"
    config_file.write_text("name: tiny\n")
    overrides = [*TINY, "variants=[local]", "variant_params={local: {window_size: 4}}"]
    command = ["-m", "eval", "run", "--no-progress", "--no-report", str(config_file), *overrides]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    launchers = {
        "single": [sys.executable],
        "double": [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node=2",
            "--master_port=29533",
        ],
    }
    for name, launcher in launchers.items():
        done = subprocess.run(
            [*launcher, *command, f"out={tmp_path / name}"],
            env=env,
            capture_output=True,
            text=True,
            timeout=subprocess_timeout(300),
        )
        assert done.returncode == 0, done.stderr[-3000:]
    (a,), (b,) = (
        read(tmp_path / "single" / "results.jsonl"),
        read(tmp_path / "double" / "results.jsonl"),
    )
    assert a.keys() == b.keys() and a["cell"] == b["cell"] and a["status"] == b["status"] == "ok"
    assert a["accuracy"].keys() == b["accuracy"].keys() and a["slices"].keys() == b["slices"].keys()
    assert b["environment"]["world_size"] == 2 and a["environment"]["world_size"] == 1


def test_workers_train_the_cells_side_by_side_with_the_same_results(tmp_path):
    """workers: 2 runs the cells in two processes, one results file, the same records as one
    process (each cell's seeds are its own), and the report at the end."""
    overrides = [*TINY, "variants=[local, full, bigbird]", "train.steps=5",
                 "variant_params={local: {window_size: 4}, bigbird: {block_size: 8}}"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    records = {}
    for workers in (1, 2):
        out = tmp_path / f"workers-{workers}"
        done = subprocess.run(
            [sys.executable, "-m", "eval", "run", "--no-progress", str(ROOT / QUICK), *overrides,
             f"workers={workers}", f"out={out}"],
            env=env, capture_output=True, text=True, timeout=subprocess_timeout(300),
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        records[workers] = {r["cell"]["key"]: r for r in read(out / "results.jsonl")}
        assert (out / "report.md").exists()
    assert records[1].keys() == records[2].keys() and len(records[1]) == 3
    for key, one in records[1].items():
        assert records[2][key]["accuracy"] == one["accuracy"]
        assert records[2][key]["loss_curve"] == one["loss_curve"]
    assert "worker 2 of 2" in done.stdout


@pytest.mark.parametrize("text", ["2/2", "1", "a/b", "-1/2", "0/0"])
def test_a_bad_shard_is_named(text):
    from eval.harness.workers import parse_shard

    with pytest.raises(ValueError, match=f"--shard must be K/N .*got {text!r}"):
        parse_shard(text)
    assert parse_shard("1/3") == (1, 3)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["tasks=[mqr]"], r"tasks\[0\]: unknown task 'mqr'; did you mean 'mqar'"),
        (
            ["variants=[full, bigbrid]"],
            r"variants\[1\]: unknown variant 'bigbrid'; did you mean 'bigbird'",
        ),
        (
            ["encodings=[alibii]"],
            r"encodings\[0\]: unknown encoding 'alibii'; did you mean 'alibi'",
        ),
        (["trian.steps=3"], r"unknown key 'trian'; did you mean 'train'"),
        (["train.stepz=3"], r"train: unknown key 'stepz'; did you mean 'steps'"),
        (["train.steps=many"], r"train: steps must be int, got 'many'"),
        (["encodings=[learned]", "encoding_params={learned: {max_len: 40}}"], r"max_len=40 .* 64"),
        (["variant_params={lokal: {window_size: 3}}"], r"variant_params: unknown variant 'lokal'"),
        # an empty list trained nothing, then the report failed on the missing results file
        (["seeds=[]"], r"seeds is an empty list; list at least one"),
        (["variants=[]"], r"variants is an empty list"),
        (["train_lengths=[]"], r"train_lengths is an empty list"),
    ],
)
def test_bad_configs_name_the_file_and_the_key(tmp_path, overrides, message):
    config_file = tmp_path / "sweep.yaml"
    config_file.write_text("name: sweep\n")
    with pytest.raises(ConfigError, match=message) as error:
        config = load_config(RunConfig, config_file, [*TINY, *overrides])
        check_names(config, str(config_file))
        check_cells(cells(config), str(config_file))
    assert str(config_file) in str(error.value) or "sweep.yaml" in str(error.value)


def test_the_command_line_reports_config_errors(tmp_path, capsys):
    from eval.harness.run import main

    assert main([str(ROOT / "eval/configs/quick.yaml"), "variants=[nope]"]) == 2
    assert "quick.yaml: variants[0]: unknown variant 'nope'" in capsys.readouterr().err


def test_attention_map_of_a_trained_checkpoint(tmp_path):
    from matplotlib.image import imread

    from eval.harness.attention_map import attention_map

    config = tiny(
        tmp_path,
        "variants=[local]",
        "variant_params={local: {window_size: 4}}",
        "save_checkpoints=true",
    )
    (record,) = read(run(config, "test", CPU, show_progress=False))
    (checkpoint,) = (tmp_path / "checkpoints").glob("*.pt")
    assert checkpoint.stem == record["cell"]["key"]
    picture = attention_map(checkpoint, tmp_path / "map.png", layer=1, head=1, length=64)
    assert imread(picture).shape[:2] == (600, 600)
    with pytest.raises(ValueError, match=r"layer must be in \[0, 1\], got 2"):
        attention_map(checkpoint, tmp_path / "bad.png", layer=2)


def test_report_keeps_latest_records_and_separates_settings(tmp_path):
    from eval.harness.report import rows, summary_table

    def record(key, status, accuracy, window, steps=20):
        cell = {"task": "copy", "train_len": 32, "variant": "local", "encoding": "rope", "seed": 0,
                "key": key, "test_lengths": [32], "variant_params": {"window_size": window},
                "train": {"steps": steps}}  # fmt: skip
        extra = (
            {"accuracy": {"32": accuracy}} if status == "ok" else {"reason": "RuntimeError: boom"}
        )
        return {
            "cell": cell,
            "status": status,
            "train_seconds": 1.0,
            "steps_per_second": 20.0,
            **extra,
        }

    records = [
        record("a", "failed", None, 4),  # retried below: the latest record counts
        record("a", "ok", 1.0, 4),
        record("b", "ok", 0.0, 16),  # another window: another setting, never averaged with "a"
    ]
    flat = rows(records)
    assert len(flat) == 2 and {r["status"] for r in flat} == {"ok"}
    table = summary_table(flat)
    assert "setting" in table.splitlines()[0]
    assert "| 1.000" in table and "| 0.000" in table and "0.500" not in table
    failed = summary_table(rows([record("c", "failed", None, 4), record("d", "ok", 1.0, 4)]))
    assert "(RuntimeError: boom)" in failed and "1/2 ok" in failed


def test_a_training_pool_is_read_in_shuffled_epochs():
    from eval.harness.train import batches
    from eval.tasks import get_task

    task = get_task("copy", seq_len=16)
    two_ranks = [distributed.Context(r, 2, torch.device("cpu")) for r in (0, 1)]
    drawn = [batches(task, 3, 12, 3, ctx) for ctx in two_ranks]
    first_epoch = torch.cat(
        [drawn[r](s).inputs for s in (0, 1) for r in (0, 1)]
    )  # 2 steps x 2 ranks x 3
    pool = task.sample(12, eval.harness.seeds.sample_seed(3, "train", 0)).inputs
    as_rows = lambda x: sorted(tuple(row.tolist()) for row in x)  # noqa: E731
    assert as_rows(first_epoch) == as_rows(pool), "an epoch covers the pool once, ranks disjoint"
    second = torch.cat([drawn[r](s).inputs for s in (2, 3) for r in (0, 1)])
    assert as_rows(second) == as_rows(pool) and not torch.equal(second, first_epoch)


def test_generation_is_greedy_on_fed_answers(tmp_path):
    """train.generation on copy: greedy (fed back predictions) when the task feeds answers, the
    cache path on fixed inputs otherwise, where it must equal teacher forcing exactly."""
    for feed in ("true", "false"):
        config = tiny(
            tmp_path / feed, "tasks=[copy]", f"task_params={{copy: {{feed_answers: {feed}}}}}",
            "variants=[sliding_window]", "variant_params={sliding_window: {window_size: 8}}",
            "causal=true", "test_lengths=[32]", "train={steps: 3, batch_size: 4, "
            "eval_samples: 8, eval_batch_size: 4, generation: true}",
        )  # fmt: skip
        (record,) = read(run(config, "test", CPU, show_progress=False))
        assert record["status"] == "ok", record.get("reason")
        assert record["generation"] == ("greedy" if feed == "true" else "fixed inputs")
        assert 0 <= record["generation_accuracy"]["32"] <= 1
        if feed == "false":
            assert record["generation_accuracy"] == record["accuracy"]
        report = write_report(tmp_path / feed / "results.jsonl")
        assert "greedy generation" in report.splitlines()[4]  # the summary's header
        assert f"{record['generation_accuracy']['32']:.3f}" in report
        assert (tmp_path / feed / "generation.png").exists()


def test_the_threads_setting_is_applied_during_the_sweep_and_restored(tmp_path, monkeypatch):
    """Two threads per process collapsed under CPU contention (0.17 steps/s against 1.04 with
    one): ``threads`` (default 1) is set with torch.set_num_threads while cells train."""
    assert RunConfig().threads == 1
    seen = []

    def record_threads(cell, context, *rest):
        seen.append(torch.get_num_threads())
        return {"accuracy": {}}

    monkeypatch.setattr(eval.harness.train, "train", record_threads)
    before = torch.get_num_threads()
    for threads, expected in (("2", 2), ("0", before)):  # 0: torch's count as it was
        config = tiny(tmp_path / threads, "variants=[full]", f"threads={threads}")
        (record,) = read(run(config, "test", CPU, show_progress=False))
        assert seen.pop() == expected and record["environment"]["threads"] == expected
        assert torch.get_num_threads() == before
    with pytest.raises(ConfigError, match=r"threads must be >= 0 .* got -1"):
        tiny(tmp_path, "threads=-1")
    with pytest.raises(ConfigError, match=r"threads must be int, got 'two'"):
        tiny(tmp_path, "threads=two")
