"""``python -m eval run``'s config checks: what a cell cannot run is refused before training, with
an error that names the key, the value and what was expected (exit status 2, no traceback), and
what does run is not refused."""

from __future__ import annotations

import pytest
from helpers import TINY_SWEEP

from eval.harness.config import ConfigError, load_config
from eval.harness.run import RunConfig, cells, check_cells, check_names, main


@pytest.fixture(autouse=True)
def sweep(tmp_path, monkeypatch) -> None:
    """A config file, sweep.yaml, in the test's working directory."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sweep.yaml").write_text("name: sweep\n")


def checked(*overrides: str, world: int | None = 1) -> RunConfig:
    config = load_config(RunConfig, "sweep.yaml", [*TINY_SWEEP, *overrides])
    check_names(config, "sweep.yaml")
    check_cells(cells(config), "sweep.yaml", world=world)
    return config


def refusal(*overrides: str, world: int | None = 1) -> str:
    with pytest.raises(ConfigError) as error:
        checked(*overrides, world=world)
    return str(error.value)


@pytest.mark.parametrize(
    "overrides, words",
    [
        # trained wrongly: clip_grad_norm_ with max_norm < 0 flips the gradient, 0 zeroes it
        (["train.grad_clip=-1"], ["train.grad_clip", "-1", "> 0"]),
        (["train.grad_clip=0"], ["train.grad_clip", "0", "> 0"]),
        (["train.warmup=-1"], ["train.warmup", "-1", "fraction", "0 to 1"]),
        (["train.warmup=1.5"], ["train.warmup", "1.5", "fraction"]),
        (["task_settings={mqar: {train: {grad_clip: -2}}}"], ["mqar: train.grad_clip", "-2"]),
        # each of these ended in a traceback
        (["model.depth=0"], ["model.depth", "0", ">= 1"]),
        (["train.eval_samples=0"], ["train.eval_samples", "0", ">= 1"]),
        (["task_settings={mqar: {model: 5}}"], ["task_settings: mqar: model", "mapping", "5"]),
        (["task_settings={mqar: {train_lengths: 32}}"], ["mqar: train_lengths", "list", "32"]),
        (["out=/tmp/sweeps/{nam}"], ["out", "{nam}", "{name}"]),
        (["resources={gpus: abc}"], ["resources", "gpus", "abc"]),
        (["device=nonsense"], ["device", "nonsense", "'auto', 'cpu' or 'cuda'"]),
        # each of these passed the checks, then failed every cell (several after training)
        (["backend=nonsense"], ["backend", "nonsense", "sdpa"]),
        (["seeds=[-1]"], ["seeds[0]", "-1", "2047"]),
        (["seeds=[2048]"], ["seeds[0]", "2048", "2047"]),  # above: another seed's batches
        (["train.steps=1048577"], ["train.steps=1048577", "2**20"]),
        (["train.until=learned", "train.max_steps=1048577"], ["train.max_steps=1048577"]),
        (["train.eval_samples=600000", "train.eval_batch_size=1"], ["train.eval_samples=600000"]),
        (["seeds=[0, 1, 0]"], ["seeds", "0", "twice"]),
        (["variants=[full, local, full]"], ["variants", "full", "twice"]),
        (["train.lr=[0.001, 0.001]"], ["train.lr", "0.001", "twice"]),
        (["train.eval_batch_size=0"], ["train.eval_batch_size", "0", ">= 1"]),
        (["task_settings={mqar: {train: {batch_size: 0}}}"], ["mqar: train.batch_size", "0"]),
        (["task_settings={mqar: {train: {steps: 0}}}"], ["mqar: train.steps", "0", ">= 1"]),
        (["train.generation=true"], ["train.generation", "causal=true"]),
        # trained and recorded: the answer was in the next slot (0.37 where chance is 0.09)
        (
            ["tasks=[copy]", "task_params={copy: {feed_answers: true}}", "causal=false"],
            ["copy", "feed_answers=true", "causal=true"],
        ),
        (["variants=[graph]"], ["graph", "edge_index", "mqar"]),
        (
            ["tasks=[pathfinder]", "task_params={}", "train_lengths=[256]", "test_lengths=[]"],
            ["pathfinder", "16 x 16", "use seq_len >= "],
        ),
    ],
)
def test_what_cannot_run_is_refused_naming_the_key_and_the_value(overrides, words):
    message = refusal(*overrides)
    assert message.startswith("sweep.yaml: "), message
    assert all(w in message for w in words), message


def test_a_tasks_settings_are_read_as_the_configs_own():
    """A float written with an exponent is a string to YAML: at the top level the schema reads
    it as a number; under task_settings the checks compared the string and failed with a
    TypeError, or refused dropout 1e-1 as not a number (found by review)."""
    config = checked(
        "task_settings={mqar: {train: {weight_decay: 1e-2, grad_clip: 1e0, warmup: 5e-2}, "
        "model: {dropout: 1e-1}}}"
    )
    (cell, *_) = cells(config)
    assert cell["train"]["weight_decay"] == 0.01 and cell["train"]["grad_clip"] == 1.0
    assert cell["train"]["warmup"] == 0.05 and cell["model"]["dropout"] == 0.1


def test_generation_needs_a_token_head():
    message = refusal(
        "tasks=[listops]", "task_params={listops: {min_length: 4, max_length: 16}}",
        "causal=true", "train.generation=true", "test_lengths=[32]",
    )  # fmt: skip
    assert "train.generation" in message and "listops" in message and "sequence" in message


def test_a_batch_that_leaves_a_rank_without_a_sequence_is_refused():
    """Under torchrun each of the N ranks trains batch_size // N sequences: 2 over 3 is none."""
    message = refusal("train.batch_size=2", world=3)
    assert "train.batch_size=2" in message and "3 processes" in message, message
    checked("train.batch_size=6", world=3)
    checked("train.batch_size=2", world=None)  # Ray's driver: a cell's processes are not known
    # context parallelism splits sequences, not the batch: every rank reads the whole batch
    sharded = ["train.batch_size=2", "train.context_parallel=3", "train_lengths=[48]"]
    checked(*sharded, "test_lengths=[]", world=3)
    message = refusal(*sharded, "test_lengths=[]")
    assert "train.context_parallel=3" in message and "this run has 1" in message, message


def test_what_runs_is_not_refused():
    # exclude knows the module variants (nsa) that variants takes
    config = checked("variants=[nsa, full]", "exclude=[{variant: nsa, encoding: rope}]")
    assert [c["variant"] for c in cells(config)] == ["full"]
    checked("train.grad_clip=.inf", "train.warmup=0", "seeds=[0, 2047]", "backend=sdpa")
    checked("tasks=[graph_hops]", "task_params={}", "variants=[graph]", "causal=true",
            "train.generation=false")  # fmt: skip


@pytest.mark.parametrize(
    "text, overrides, words",
    [
        ("name: sweep\n", ["variants=[local"], ["override", "variants=[local", "YAML"]),
        ("- mqar\n- full\n", ["train.steps=3"], ["sweep.yaml", "mapping", "list"]),
    ],
)
def test_files_and_overrides_that_do_not_parse_are_config_errors(tmp_path, text, overrides, words):
    path = tmp_path / "sweep.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as error:
        load_config(RunConfig, path, overrides)
    assert all(w in str(error.value) for w in words), str(error.value)


def test_a_section_whose_keys_are_all_commented_out_is_an_empty_one(tmp_path):
    path = tmp_path / "sweep.yaml"
    path.write_text("name: sweep\ntrain:\n  # steps: 300\nmodel:\n")
    config = load_config(RunConfig, path, ["train.steps=3", "model.dim=8"])
    assert config.train.steps == 3 and config.model.dim == 8 and config.train.batch_size == 32


@pytest.mark.parametrize(
    "overrides",
    [["--no-progress", "variants=[nope]"], ["variants=[nope]", "--no-report", "train.steps=3"]],
    ids=["override-after-option", "options-between-overrides"],
)
def test_the_command_line_takes_options_between_overrides(capsys, overrides):
    assert main(["sweep.yaml", *overrides]) == 2
    assert "variants[0]: unknown variant 'nope'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "override",
    [
        "device=nonsense",
        "out=/tmp/{nam}",
        "resources={gpus: abc}",
        "variants=[local",
        "model.depth=0",
    ],
)
def test_the_command_line_reports_config_errors_without_a_traceback(tmp_path, capsys, override):
    assert main(["sweep.yaml", *TINY_SWEEP, f"out={tmp_path}/out", override]) == 2
    assert capsys.readouterr().err.startswith("error: ")
    assert not (tmp_path / "out").exists()


def test_the_other_commands_with_a_list_of_arguments_take_options_among_them(monkeypatch):
    """findings and auto-table: options between the names, as run takes them."""
    from eval.bench import auto_table
    from eval.findings import report

    seen = []
    monkeypatch.setattr(report, "write_findings", lambda names, out, gpu: seen.append((names, gpu)))
    assert report.main(["extrapolation", "--gpu", "listops", "--out", "x"]) == 0
    monkeypatch.setattr(
        auto_table, "write_table", lambda files, out: seen.append((files, out)) or []
    )
    assert auto_table.main(["a.json", "--out", "t.json", "b.json"]) == 0
    assert seen == [(["extrapolation", "listops"], True), (["a.json", "b.json"], "t.json")]


def test_the_report_of_a_missing_results_file_says_so(tmp_path, capsys):
    """A missing file ended in a 25-line traceback (FileNotFoundError), the run's folder in an
    IsADirectoryError; the folder now stands for its results.jsonl."""
    from eval.harness.report import main

    with pytest.raises(SystemExit):
        main([str(tmp_path / "results.jsonl")])
    assert "results: no such file" in capsys.readouterr().err
    (tmp_path / "results.jsonl").write_text("")
    assert main([str(tmp_path)]) == 0
