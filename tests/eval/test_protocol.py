"""The published protocol: a learning-rate list gives one cell per value, the report keeps the
best per cell (and names it), and a cell whose training did not converge is marked."""

from __future__ import annotations

import pytest

from eval.harness.config import ConfigError, load_config
from eval.harness.convergence import AT_MARGINAL, CONVERGED, STILL_FALLING, UNKNOWN, training_state
from eval.harness.report import rows, summary_table, sweep_table
from eval.harness.run import RunConfig, cells, check_names
from eval.harness.selection import choose
from eval.harness.train import loss_curve, marginal


def record(variant="local", lr=1e-3, seed=0, accuracy=0.5, curve=None, status="ok", best_of=None):
    cell = {
        "task": "mqar", "train_len": 64, "variant": variant, "encoding": "learned",
        "seed": seed, "key": f"{variant}-{lr}-{seed}", "test_lengths": [64],
        "variant_params": {}, "causal": True, "train": {"lr": lr, "steps": 100},
    }  # fmt: skip
    out = {"cell": cell, "status": status, "train_seconds": 1.0, "steps_per_second": 100.0}
    if best_of is not None:
        out["best_of"] = best_of
    if status == "ok":
        out.update(
            accuracy={"64": accuracy},
            loss_curve=curve or [3.0, 2.0, 1.0, 0.5, 0.3, 0.2, 0.2, 0.2, 0.2, 0.2],
            marginal_loss=3.4,
            chance_accuracy=0.03,
        )
    else:
        out["reason"] = "RuntimeError: boom"
    return out


def test_a_learning_rate_list_gives_one_cell_per_value():
    config = load_config(RunConfig, None, ["variants=[full, local]", "train.lr=[0.0001, 0.01]"])
    check_names(config, "test")
    made = cells(config)
    assert [(c["variant"], c["train"]["lr"]) for c in made] == [
        ("full", 1e-4), ("full", 1e-2), ("local", 1e-4), ("local", 1e-2),
    ]  # fmt: skip
    assert len({c["key"] for c in made}) == 4
    # A single value keeps the cell it always had (same key as before lists existed).
    one = cells(load_config(RunConfig, None, ["train.lr=0.001"]))
    assert [c["train"]["lr"] for c in one] == [0.001]
    # task_settings may sweep their own rates.
    per_task = cells(
        load_config(RunConfig, None, ["task_settings={mqar: {train: {lr: [0.1, 0.2, 0.3]}}}"])
    )
    assert [c["train"]["lr"] for c in per_task] == [0.1, 0.2, 0.3]


@pytest.mark.parametrize(
    ("override", "words"),
    [("train.lr=[]", ["train.lr", "[]"]), ("train.lr=[0.1, -1]", ["train.lr", "-1"]),
     ("best_of=[steps]", ["best_of[0]", "steps"])],
)  # fmt: skip
def test_bad_sweeps_are_named(override, words):
    with pytest.raises(ConfigError) as error:
        check_names(load_config(RunConfig, None, [override]), "test.yaml")
    assert all(w in str(error.value) for w in words), error.value


def test_the_best_learning_rate_is_chosen_per_cell_and_the_rest_kept():
    records = [
        record("local", 1e-4, accuracy=0.2),
        record("local", 1e-3, accuracy=0.7),
        record("local", 1e-2, accuracy=0.4),
        record("full", 1e-4, accuracy=0.9),
        record("full", 1e-3, accuracy=0.9),  # a tie: the smaller rate
        record("full", 1e-2, status="failed"),
    ]
    sweeps = {s.variant: s for s in choose(records)}
    assert sweeps["local"].chosen_lr == 1e-3 and sweeps["full"].chosen_lr == 1e-4
    assert sweeps["full"].scores[1e-2] is None
    assert [r["cell"]["train"]["lr"] for r in sweeps["local"].chosen] == [1e-3]
    table = sweep_table(list(sweeps.values()))
    assert "**0.700**" in table and "0.200" in table and "0.400" in table
    summary = summary_table(rows([r for s in sweeps.values() for r in s.chosen]))
    assert "0.001" in summary and "0.700" in summary and "0.400" not in summary


def test_seeds_are_averaged_unless_best_of_names_them():
    averaged = [record("local", lr, seed, acc) for lr, seed, acc in
                [(1e-3, 0, 0.9), (1e-3, 1, 0.1), (1e-2, 0, 0.6), (1e-2, 1, 0.6)]]  # fmt: skip
    (sweep,) = choose(averaged)
    assert sweep.chosen_lr == 1e-2 and sweep.scores[1e-3] == pytest.approx(0.5)
    assert len(sweep.chosen) == 2
    best_seed = [{**r, "best_of": ["lr", "seed"]} for r in averaged]
    (sweep,) = choose(best_seed)
    assert (sweep.chosen_lr, sweep.chosen_seed) == (1e-3, 0) and len(sweep.chosen) == 1


def test_one_rule_chooses_for_every_record_the_configs_or_the_latest_runs():
    """A run again with best_of [lr, seed] trained nothing, and its report still averaged the
    seeds (each record keeps the rule it was trained under); with a third seed trained under
    the new rule, one cell became two sweeps of one setting, the best seed of one of them
    named (seed 2 at 0.884 where seed 0 had 0.947)."""
    old = [record("local", 1e-2, seed, acc) for seed, acc in ((0, 0.947), (1, 0.803))]
    (sweep,) = choose(old, best_of=["lr", "seed"])  # the config's rule, given by the run
    assert (sweep.chosen_seed, sweep.scores[1e-2]) == (0, 0.947)
    mixed = [*old, record("local", 1e-2, 2, 0.884, best_of=["lr", "seed"])]
    (sweep,) = choose(mixed)  # no rule given: the last record's
    assert (sweep.chosen_seed, sweep.scores[1e-2]) == (0, 0.947)
    (sweep,) = choose(mixed, best_of=["lr"])
    assert sweep.chosen_seed is None and sweep.scores[1e-2] == pytest.approx(
        (0.947 + 0.803 + 0.884) / 3
    )


def test_max_steps_without_until_learned_is_refused():
    """It was dropped from the cell without a word: a finished sweep ran nothing."""
    with pytest.raises(ConfigError, match="max_steps is the budget of until: learned"):
        check_names(load_config(RunConfig, None, ["train.max_steps=10"]), "test")


def test_a_learning_rate_written_1e_3_is_a_number():
    """YAML 1.1 reads 1e-3 (no dot) as a string: it was refused as 'must be float'."""
    config = load_config(RunConfig, None, ["train.lr=[1e-3, 2.5E-2]"])
    assert config.train.lr == [0.001, 0.025]
    with pytest.raises(ConfigError, match="lr must be"):
        load_config(RunConfig, None, ["train.lr=fast"])


def test_every_candidate_failing_shows_the_failures():
    (sweep,) = choose([record(lr=1e-3, status="failed"), record(lr=1e-2, status="failed")])
    assert sweep.chosen_lr is None and len(sweep.chosen) == 2
    assert "0/2 ok" in summary_table(rows(sweep.chosen))


@pytest.mark.parametrize(
    ("curve", "state"),
    [
        ([3.4, 2.0, 1.0, 0.5, 0.31, 0.3, 0.3, 0.3, 0.3, 0.3], CONVERGED),
        ([3.4, 3.0, 2.6, 2.2, 1.9, 1.6, 1.4, 1.2, 1.0, 0.8], STILL_FALLING),
        ([3.4, 3.4, 3.39, 3.38, 3.38, 3.37, 3.37, 3.36, 3.36, 3.35], AT_MARGINAL),
        # near zero, a large relative drop is noise, not learning left to do
        ([1.0, 0.1, 0.01, 0.005, 0.004, 0.004, 0.003, 0.003, 0.002, 0.001], CONVERGED),
    ],
)
def test_training_is_marked_by_its_loss_curve(curve, state):
    assert training_state(record(curve=curve)) == state


def test_records_without_a_curve_are_unknown_and_the_report_says_so():
    old = record()
    del old["loss_curve"]
    assert training_state(old) == UNKNOWN
    assert training_state(record(status="failed")) == UNKNOWN
    falling = record(curve=[3.4, 3.0, 2.6, 2.2, 1.9, 1.6, 1.4, 1.2, 1.0, 0.8])
    assert "not converged: still falling" in summary_table(rows([falling]))


def test_loss_curve_and_marginal():
    assert loss_curve([float(i) for i in range(40)]) == [i * 2 + 0.5 for i in range(20)]
    assert loss_curve([1.0, 2.0, 3.0]) == [1.0, 2.0, 3.0]
    import math

    import torch

    uniform = marginal(torch.tensor([5, 5, 5, 5]))
    assert uniform["marginal_loss"] == pytest.approx(math.log(4), abs=1e-5)
    assert uniform["chance_accuracy"] == 0.25
    skewed = marginal(torch.tensor([0, 30, 10]))
    assert skewed["chance_accuracy"] == 0.75
