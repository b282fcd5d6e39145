"""The findings' verdicts, on tiny synthetic result records: a claim met agrees, one missed
disagrees when training converged and reads "not converged" when it did not, one that reads a
cell which did not learn what its pattern reaches is "not learned" (never "disagrees"), a preset
without results is "not run"; and ``python -m eval findings`` writes the report and its plots."""

from __future__ import annotations

import json

import pytest

from eval.findings import (
    AGREES,
    DISAGREES,
    FINDINGS,
    NOT_CONVERGED,
    NOT_LEARNED,
    NOT_RUN,
    mqar_gap,
)
from eval.findings.report import ROOT, write_findings
from eval.harness.config import load_config
from eval.harness.run import RunConfig, make_cell

CONVERGED_CURVE = [3.4, 2.0, 1.0, 0.5, 0.3, 0.3, 0.3, 0.3, 0.3, 0.3]
FALLING_CURVE = [3.4, 3.0, 2.6, 2.2, 1.9, 1.6, 1.4, 1.2, 1.0, 0.8]
# the preset each task's synthetic cells are made by, as its sweep makes them: the verdicts
# compute what the cell's pattern reaches from the cell
PRESETS = {
    "mqar": "eval/configs/findings/mqar_gap_zoology.yaml",
    "induction": "eval/configs/findings/extrapolation.yaml",
    "listops": "eval/configs/findings/listops.yaml",
}


def record(task, variant, encoding="learned", accuracy=None, gaps=None, train_len=64,
           params=None, curve=CONVERGED_CURVE, lr=1e-3, slices=None):  # fmt: skip
    config = load_config(RunConfig, ROOT / PRESETS[task])
    cell = make_cell(config, task, {}, train_len, config.test_lengths or [train_len], variant,
                     encoding, 0, lr)  # fmt: skip
    if params is not None:
        cell["variant_params"] = params
    cell["key"] = f"{task}-{variant}-{encoding}-{lr}"
    accuracy = accuracy or {str(train_len): 0.5}
    slices = slices or {str(train_len): {"gap": {str(b): a for b, a in (gaps or {}).items()}}}
    return {
        "cell": cell, "status": "ok", "accuracy": accuracy, "slices": slices,
        "loss_curve": curve, "marginal_loss": 3.4, "chance_accuracy": 0.03,
    }  # fmt: skip


WINDOW = {"window_size": [15, 0]}  # reach: 16 in one layer, 31 in two


def mqar(full, window, routed, window_curve=CONVERGED_CURVE):
    """gap bucket -> accuracy for each variant, as records of every preset (gap law, layout)."""
    records = [
        record("mqar", "full", gaps=full),
        record("mqar", "local", gaps=window, params=WINDOW, curve=window_curve),
        record("mqar", "moba", gaps=routed),
    ]
    return {role: records for role in mqar_gap.LAWS}


def judge(chosen):
    """The judgement of the finding whose roles ``chosen`` holds, by its CPU presets."""
    (finding,) = [f for f in FINDINGS.values() if set(f.configs) == set(chosen)]
    return finding.judge(chosen, finding.configs)


def verdicts(judgement):
    return [c.verdict for c in judgement.claims]


def test_mqar_gap_agrees_when_the_window_recalls_only_within_its_reach():
    judged = judge(
        mqar(
            full={2: 1.0, 4: 1.0, 8: 1.0, 16: 1.0, 32: 0.98},
            window={2: 1.0, 4: 1.0, 8: 0.99, 16: 0.95, 32: 0.05},
            routed={2: 1.0, 4: 1.0, 8: 1.0, 16: 0.9, 32: 0.6},
        )
    )
    assert verdicts(judged) == [AGREES] * 12 and judged.verdict == AGREES
    assert "chosen by content" in judged.claims[11].claim  # the spread preset's pairs
    # buckets within the stack's reach (2 x 15 + 1 = 31): 2-16; beyond: 32
    assert "[2, 4, 8, 16]" in judged.claims[1].measured
    assert "[32]" in judged.claims[2].measured
    assert judged.figures and "gap 32" in judged.tables[0]


def test_mqar_gap_is_not_learned_when_the_window_fails_within_its_reach():
    failing = {2: 0.0, 4: 0.06, 8: 0.07, 16: 0.15, 32: 0.03}
    full = {b: 1.0 for b in failing}
    # at chance within its reach: not learned, whether its loss is flat or still falls
    for curve in (CONVERGED_CURVE, FALLING_CURVE):
        judged = judge(mqar(full, failing, full, window_curve=curve))
        assert verdicts(judged)[:4] == [AGREES, NOT_LEARNED, NOT_LEARNED, NOT_LEARNED]
        assert judged.verdict == NOT_LEARNED
        assert judged.not_learned == {}  # judge() alone; evaluate() lists them per preset


def test_mqar_gap_disagrees_or_is_not_converged_when_the_window_recalls_beyond_its_reach():
    learned = {2: 1.0, 4: 1.0, 8: 1.0, 16: 1.0, 32: 0.9}
    converged = judge(mqar(learned, learned, learned))
    assert verdicts(converged)[:4] == [AGREES, AGREES, DISAGREES, DISAGREES]
    assert converged.verdict == DISAGREES
    still = judge(mqar(learned, learned, learned, window_curve=FALLING_CURVE))
    assert verdicts(still)[2] == NOT_CONVERGED


def test_mqar_gap_without_results_is_not_run():
    judged = judge({config: [] for config in mqar_gap.LAWS})
    assert verdicts(judged) == [NOT_RUN] * 3 and judged.verdict == NOT_RUN
    assert "python -m eval run eval/configs/findings/" in judged.claims[0].measured


def curves(**by_encoding):
    names = ("64", "128", "256", "512")
    return {
        "extrapolation": [
            record("induction", "full", encoding=e, accuracy=dict(zip(names, acc, strict=True)))
            for e, acc in by_encoding.items()
        ]
    }


def test_extrapolation_orders_the_encodings():
    published_like = curves(
        sinusoidal=(1.0, 0.59, 0.27, 0.19), learned=(1.0, 0.3, 0.1, 0.1),
        rope=(1.0, 0.84, 0.31, 0.18), alibi=(1.0, 1.0, 0.98, 0.97), t5=(1.0, 0.99, 0.97, 0.95),
    )  # fmt: skip
    judged = judge(published_like)
    assert verdicts(judged) == [AGREES] * 5
    flat = curves(sinusoidal=(1.0,) * 4, learned=(1.0,) * 4, rope=(1.0,) * 4,
                  alibi=(1.0,) * 4, t5=(1.0,) * 4)  # fmt: skip
    assert verdicts(judge(flat)) == [AGREES, DISAGREES, DISAGREES, AGREES, DISAGREES]
    assert judge({"extrapolation": []}).verdict == NOT_RUN


def test_listops_ordering():
    def run(full, local, longformer, bigbird):
        accuracies = {"full": full, "block_local": local, "longformer": longformer,
                      "bigbird": bigbird}  # fmt: skip
        return judge({"listops": [
            record("listops", v, accuracy={"128": a}, train_len=128)
            for v, a in accuracies.items()
        ]})  # fmt: skip

    assert verdicts(run(0.37, 0.05, 0.36, 0.36)) == [AGREES] * 3
    same = run(0.2, 0.2, 0.2, 0.2)
    assert verdicts(same) == [DISAGREES, DISAGREES, AGREES]
    assert same.figures[0][1] == "listops_curves.png"


def test_listops_where_no_variant_learned_the_expression_is_not_learned_never_disagrees():
    """The committed CPU run: every variant 0.36-0.38 at every nesting depth, the constant
    guess 0.155. Full attention, Longformer and BigBird reach the whole expression and did not
    learn it; local's blocks cannot reach it."""
    depths = {str(d): 0.37 for d in range(3, 10)}
    judged = judge({"listops": [
        record("listops", v, accuracy={"128": 0.37}, train_len=128,
               slices={"128": {"depth": depths}})
        for v in ("full", "block_local", "longformer", "bigbird")
    ]})  # fmt: skip
    assert verdicts(judged) == [NOT_LEARNED] * 3 and judged.verdict == NOT_LEARNED
    assert "every one" in judged.tables[0] and "none" in judged.tables[0]
    assert "not learned" in judged.tables[0] and "cannot" in judged.tables[0]


def test_extrapolation_misses_at_trained_distances_are_not_learned_at_that_length():
    """ALiBi and T5 at 8x: missing answers at distances seen in training is not learning that
    length, not the bias failing to extrapolate; missing only the distances never trained on,
    with the trained ones learned, disagrees. Rotary's fall at 8x is read alike: a fall at the
    trained distances is not learned (it says nothing of rotary's reach), a fall beyond them
    agrees."""
    lengths = ("64", "128", "256", "512")

    def encodings(at_512):
        out = []
        for e, acc in dict(sinusoidal=(1.0, 0.59, 0.27, 0.19), learned=(1.0, 0.3, 0.1, 0.1),
                           rope=(1.0, 0.84, 0.31, 0.18), alibi=(1.0, 0.9, 0.5, 0.3),
                           t5=(1.0, 0.9, 0.5, 0.3)).items():  # fmt: skip
            r = record(
                "induction", "full", encoding=e, accuracy=dict(zip(lengths, acc, strict=True))
            )
            r["slices"] = {"64": {"distance": {b: 1.0 for b in ("2", "4", "8", "16", "32")}},
                           "512": {"distance": at_512}}  # fmt: skip
            out.append(r)
        return {"extrapolation": out}

    missed_near = {"8": 0.05, "16": 0.07, "32": 0.06, "64": 0.1, "128": 0.3, "256": 0.4}
    judged = judge(encodings(missed_near))
    assert verdicts(judged) == [AGREES, AGREES, NOT_LEARNED, NOT_LEARNED, AGREES]
    assert "distances seen in training (< 64)" in judged.claims[3].measured
    assert "at 512, distances seen in training (< 64): rope 0.06" in judged.claims[2].measured
    missed_far = {"8": 1.0, "16": 1.0, "32": 0.98, "64": 0.1, "128": 0.05, "256": 0.04}
    assert verdicts(judge(encodings(missed_far)))[2:4] == [AGREES, DISAGREES]


def test_extrapolation_at_2x_reads_the_distance_encodings_on_their_trained_distances():
    """The order at 2x and rotary's lead there: a distance encoding that misses trained
    distances at 2x is not learned there, whatever the order; absolute positions, whose query
    position is new at 2x at every distance, are read on their numbers."""
    lengths = ("64", "128", "256", "512")
    accuracy = dict(sinusoidal=(1.0, 0.59, 0.27, 0.19), learned=(1.0, 0.3, 0.1, 0.1),
                    rope=(1.0, 0.84, 0.31, 0.18), alibi=(1.0, 1.0, 0.98, 0.97),
                    t5=(1.0, 0.99, 0.97, 0.95))  # fmt: skip
    learned = {b: 1.0 for b in ("2", "4", "8", "16", "32")}

    def run(at_128):
        out = []
        for e, acc in accuracy.items():
            r = record(
                "induction", "full", encoding=e, accuracy=dict(zip(lengths, acc, strict=True))
            )
            r["slices"] = {"64": {"distance": learned}, "128": {"distance": at_128.get(e, learned)}}
            out.append(r)
        return judge({"extrapolation": out})

    assert verdicts(run({})) == [AGREES] * 5
    missed = {"2": 0.1, "4": 0.05, "8": 0.05, "16": 0.07, "32": 0.06, "64": 0.5}
    assert verdicts(run({"t5": missed}))[4] == NOT_LEARNED
    assert verdicts(run({"rope": missed}))[2] == NOT_LEARNED
    assert verdicts(run({"sinusoidal": missed, "learned": missed})) == [AGREES] * 5


def test_the_findings_report_is_written_with_its_plots(tmp_path):
    root = tmp_path / "repo"
    for finding in FINDINGS.values():
        for config in finding.configs.values():
            (root / config).parent.mkdir(parents=True, exist_ok=True)
            (root / config).write_text((ROOT / config).read_text())
    data = mqar(
        full={2: 1.0, 32: 1.0}, window={2: 1.0, 32: 0.0}, routed={2: 1.0, 32: 0.8}
    )  # fmt: skip
    for role, records in data.items():
        path = root / FINDINGS["mqar-gap"].results_path(FINDINGS["mqar-gap"].configs[role], root)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    text = write_findings(list(FINDINGS), tmp_path / "out", root)
    assert "## Multi-query associative recall per gap: agrees" in text
    assert "## The ListOps ordering: not run" in text
    assert (tmp_path / "out" / "mqar_gap.png").stat().st_size > 0
    assert (tmp_path / "out" / "report.md").read_text() == text


@pytest.mark.parametrize("name", list(FINDINGS))
def test_every_finding_names_presets_that_exist_and_load(name):
    from eval.harness.config import load_config
    from eval.harness.run import RunConfig, cells, check_names

    finding = FINDINGS[name]
    assert set(finding.configs) == set(finding.gpu_configs), "every preset has its GPU twin"
    for config in [*finding.configs.values(), *finding.gpu_configs.values()]:
        run = load_config(RunConfig, ROOT / config)
        check_names(run, config)
        made = cells(run)
        assert len({c["train"]["lr"] for c in made}) == 4, "the published sweep of 4 rates"


def test_extrapolation_splits_failures_by_trained_distance():
    from eval.findings.extrapolation import by_distance

    r = record("induction", "full", encoding="t5")
    r["slices"]["512"] = {"distance": {"2": 1.0, "32": 0.8, "64": 0.1, "256": 0.0}}
    # buckets [2, 3] and [32, 63] lie below the train length 64; [64, 127] and [256, 511] beyond
    assert by_distance([r], 512, 64) == (pytest.approx(0.9), pytest.approx(0.05))
    assert by_distance([r], 512, 32) == (pytest.approx(1.0), pytest.approx(0.3))


def test_a_claim_over_several_cells_disagrees_when_a_converged_cell_fails():
    from eval.findings.base import verdict_all

    converged = [record("mqar", "full")]
    learning = [record("mqar", "local", curve=FALLING_CURVE)]
    assert verdict_all([(True, converged), (True, learning)]) == AGREES
    assert verdict_all([(False, converged), (False, learning)]) == DISAGREES
    assert verdict_all([(True, converged), (False, learning)]) == NOT_CONVERGED


def test_extrapolation_claims_whose_lengths_were_not_tested_are_not_run():
    """Tested at 1x and 2x only: the claims at 4x and 8x are not run, naming the length, never
    disagree; the order at 2x is judged."""
    judged = judge({"extrapolation": [
        record("induction", "full", encoding=e, accuracy={"64": 1.0, "128": a})
        for e, a in dict(sinusoidal=0.5, learned=0.4, rope=0.8, alibi=0.95, t5=0.9).items()
    ]})  # fmt: skip
    assert verdicts(judged) == [AGREES, NOT_RUN, NOT_RUN, NOT_RUN, AGREES]
    assert "no test length at 8x the train length" in judged.claims[3].measured
    assert "no test length at 4x the train length" in judged.claims[1].measured


def test_extrapolation_biases_not_learned_at_the_train_length_are_not_learned():
    """A bias that did not learn at the train length cannot keep its accuracy: not learned,
    even where its trained distances at 8x are learned."""
    lengths = ("64", "128", "256", "512")
    out = []
    for e, acc in dict(sinusoidal=(1.0, 0.59, 0.27, 0.19), learned=(1.0, 0.3, 0.1, 0.1),
                       rope=(1.0, 0.84, 0.31, 0.18), alibi=(0.3, 0.3, 0.3, 0.3),
                       t5=(1.0, 0.99, 0.97, 0.95)).items():  # fmt: skip
        r = record("induction", "full", encoding=e, accuracy=dict(zip(lengths, acc, strict=True)))
        near = 0.1 if e == "alibi" else 1.0  # alibi misses at the train length only
        buckets = ("2", "4", "8", "16", "32")
        r["slices"] = {"64": {"distance": dict.fromkeys(buckets, near)},
                       "512": {"distance": dict.fromkeys(buckets, 1.0)}}  # fmt: skip
        out.append(r)
    assert verdicts(judge({"extrapolation": out}))[3] == NOT_LEARNED


def test_mqar_gap_window_recalls_within_reach_in_every_bucket_not_on_average():
    """A bucket within reach at 0.707 among three at 1.0 (mean 0.93): the window's claim does not
    hold, whatever the mean."""
    judged = judge(
        mqar(
            full={2: 1.0, 4: 1.0, 8: 1.0, 16: 1.0, 32: 0.98},
            window={2: 1.0, 4: 1.0, 8: 0.707, 16: 1.0, 32: 0.05},
            routed={2: 1.0, 4: 1.0, 8: 1.0, 16: 0.9, 32: 0.6},
        )
    )
    assert verdicts(judged)[1] == DISAGREES
    assert "lowest of buckets [2, 4, 8, 16]: 0.707" in judged.claims[1].measured


def test_a_finding_whose_gpu_twins_ran_in_part_reads_not_run_for_the_rest(tmp_path):
    """The GPU twins of two of the MQAR presets have results, the spread one's not: its claims
    read not run with the command that runs it, the others are judged."""
    finding = FINDINGS["mqar-gap"]
    data = mqar(
        full={2: 1.0, 4: 1.0, 8: 1.0, 16: 1.0, 32: 1.0},
        window={2: 1.0, 4: 1.0, 8: 1.0, 16: 1.0, 32: 0.02},
        routed={2: 1.0, 4: 1.0, 8: 1.0, 16: 1.0, 32: 0.9},
    )
    for role, config in finding.gpu_configs.items():
        (tmp_path / config).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / config).write_text((ROOT / config).read_text())
        if role != "spread":
            path = tmp_path / finding.results_path(config, tmp_path)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("".join(json.dumps(r) + "\n" for r in data[role]))
    judged = finding.evaluate(tmp_path, gpu=True)
    assert verdicts(judged) == [AGREES] * 8 + [NOT_RUN] and judged.verdict == NOT_RUN
    assert "python -m eval run eval/configs/findings/mqar_gap_spread_gpu.yaml" in (
        judged.claims[-1].measured
    )
