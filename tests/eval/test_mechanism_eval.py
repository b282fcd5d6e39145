"""Mechanisms in the harness and the benchmark: named in a config like any variant."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from test_harness import CPU, TINY, tiny

from eval.bench import run as bench
from eval.harness.config import ConfigError, load_config
from eval.harness.run import RunConfig, cells, check_cells, check_names, run


def test_a_mechanism_trains_in_the_harness(tmp_path):
    config = tiny(
        tmp_path,
        "variants=[performer, linformer]",
        "variant_params={linformer: {max_len: 64, proj_len: 16}}",
    )
    records = [
        json.loads(line) for line in run(config, "test", CPU, False).read_text().splitlines()
    ]
    assert [r["cell"]["variant"] for r in records] == ["performer", "linformer"]
    for record in records:
        assert record["status"] == "ok", record.get("reason")
        assert set(record["accuracy"]) == {"32", "64"}


def test_exclude_leaves_out_the_combinations_a_mechanism_refuses(tmp_path):
    overrides = ["variants=[full, linear]", "encodings=[rope, alibi]"]
    with pytest.raises(ConfigError, match=r"full / linear|linear / alibi.*pos='alibi' adds a bias"):
        tiny(tmp_path, *overrides)
    config = tiny(tmp_path, *overrides, "exclude=[{variant: linear, encoding: alibi}]")
    pairs = [(c["variant"], c["encoding"]) for c in cells(config)]
    assert pairs == [("full", "rope"), ("full", "alibi"), ("linear", "rope")]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "exclude=[{variant: linaer}]",
            r"exclude\[0\]: unknown variant 'linaer'; did you mean 'linear'",
        ),
        (
            "exclude=[{varient: linear}]",
            r"exclude\[0\]: a mapping of task, variant and/or encoding",
        ),
        (
            "variants=[perfomer]",
            r"variants\[0\]: unknown variant 'perfomer'; did you mean 'performer'",
        ),
    ],
)
def test_bad_exclude_and_mechanism_names_are_config_errors(tmp_path, override, message):
    with pytest.raises(ConfigError, match=message):
        config = load_config(RunConfig, None, [*TINY, override])
        check_names(config, "sweep.yaml")
        check_cells(cells(config), "sweep.yaml")


@pytest.mark.usefixtures("scalar_cpu_code")
def test_the_benchmark_times_mechanisms_on_auto_and_says_why_elsewhere(tmp_path):
    config = {
        "variants": ["lin*", "nystrom"],  # a glob matches mechanisms too
        "backends": ["auto", "blocked"],
        "peers": ["sdpa_dense"],
        "lengths": [128],
        "passes": ["fwd", "fwd+bwd"],
        "causal": [False, True],
        "heads": 2,
        "head_dim": 16,
        "warmup": 1,
        "repeats": 2,
        "check_max_len": 128,
        "params": {"linformer": {"max_len": 128, "proj_len": 16}, "nystrom": {"num_landmarks": 8}},
        "out": str(tmp_path / "out"),
        "threads": 2,
        "plots": False,
    }
    path = tmp_path / "bench.yaml"
    path.write_text(yaml.safe_dump(config))
    assert bench.main([str(path)]) == 0
    cells_ = json.loads((tmp_path / "out" / "bench.json").read_text())["cells"]
    by = {(c["variant"], c["backend"], c["causal"], c["pass"], c["n"]): c for c in cells_}
    for variant in ("linear", "linformer", "nystrom"):
        ok = by[(variant, "auto", False, "fwd+bwd", 128)]
        assert ok["status"] == "ok" and ok["checked"] and ok["resolved"] == "mechanism"
        assert ok["allowed_pairs"] is None and ok["time_ms"] > 0
        other = by[(variant, "blocked", False, "fwd", 128)]
        assert other["status"] == "unsupported" and "only backend auto" in other["reason"]
    assert by[("linear", "auto", True, "fwd", 128)]["status"] == "ok"
    causal = by[("nystrom", "auto", True, "fwd", 128)]
    assert causal["status"] == "unsupported" and "non-causal only" in causal["reason"]
    assert torch.is_grad_enabled()
