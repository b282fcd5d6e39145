"""``python -m eval goals`` (eval/bench/goals.py) on small hand-written stage outputs: each goal
held, not held and not measured, and the summary's first lines."""

from __future__ import annotations

import json
import re

import pytest

from eval.bench import goals

W256, W1024 = {"window_size": 256}, {"window_size": 1024}
MOBA, TWIN = {"block_size": 512, "top_k": 3}, {"block_size": 512, "neighbors": 1}
H100 = "NVIDIA H100 80GB HBM3"


def cell(variant, backend, n, ms, *, causal=False, pass_="fwd", params=None, status="ok",
         pairs=None, realization=None, reason=None):  # fmt: skip
    return {
        "variant": variant, "backend": backend, "kind": "zoo" if backend == "auto" else "peer",
        "resolved": "flex", "n": n, "causal": causal, "pass": pass_, "params": params or {},
        "status": status, "reason": reason, "time_ms": ms if status == "ok" else None,
        "allowed_pairs": pairs, "all_pairs": n * n, "sparsity_realization": realization,
    }  # fmt: skip


def bench(folder, name, cells, **config):
    base = {
        "variants": ["local"],
        "backends": ["auto"],
        "peers": ["sdpa_dense", "flex_standard"],
        "lengths": [8192],
        "passes": ["fwd"],
        "causal": [False],
        "params": {"local": W256},
    }
    base.update(config)
    header = {"device": H100, "config": base, "variants": base["variants"]}
    (folder / f"bench-{name}.json").write_text(json.dumps({"header": header, "cells": cells}))


def realization(folder, value=0.7, twin_ms=1.0):
    bench(folder, "realization", [
        cell("full", "sdpa_dense", 65536, 100.0),
        cell("local", "auto", 65536, 1.0, params=W1024, realization=value),
        cell("local", "flex_standard", 65536, twin_ms, params=W1024),
    ], lengths=[65536], params={"local": W1024})  # fmt: skip


def verdicts(folder, **options) -> dict[str, str]:
    text, _ = goals.summarise([folder], **options)
    found = dict(re.findall(r"^- goal \((\w)\) [^:]*: (held|not held|not measured);", text, re.M))
    assert list(found) == list("abcde"), text
    return found


def test_goal_a_held_not_held_and_partial(tmp_path):
    realization(tmp_path)
    bench(tmp_path, "goals", [cell("local", "auto", 8192, 1.02, params=W256),
                              cell("local", "flex_standard", 8192, 1.0, params=W256)])  # fmt: skip
    assert verdicts(tmp_path)["a"] == "held"
    bench(tmp_path, "goals", [cell("local", "auto", 8192, 1.3, params=W256),
                              cell("local", "flex_standard", 8192, 1.0, params=W256)])  # fmt: skip
    goal = goals.goal_a(goals.load_runs([tmp_path], []))
    assert goal.verdict == "not held" and "local (window_size=256) 1.3 at 8K non-causal fwd" in (
        goal.summary
    )
    # A second length asked for and not run: not measured, unless a measured cell already fails.
    bench(tmp_path, "goals", [cell("local", "auto", 8192, 1.0, params=W256),
                              cell("local", "flex_standard", 8192, 1.0, params=W256)],
          lengths=[8192, 16384])  # fmt: skip
    assert verdicts(tmp_path)["a"] == "not measured"
    (tmp_path / "bench-realization.json").unlink()  # its grid then comes from its YAML
    bench(tmp_path, "goals", [cell("local", "auto", 8192, 1.0, params=W256),
                              cell("local", "flex_standard", 8192, 1.0, params=W256)])  # fmt: skip
    assert verdicts(tmp_path)["a"] == "not measured"


def test_goal_a_counts_a_failed_twin_for_auto_and_a_failed_auto_against_it(tmp_path):
    realization(tmp_path)
    bench(tmp_path, "goals", [cell("local", "auto", 8192, 1.0, params=W256),
                              cell("local", "flex_standard", 8192, None, params=W256,
                                   status="oom", reason="64 GiB")])  # fmt: skip
    assert verdicts(tmp_path)["a"] == "held"
    bench(tmp_path, "goals", [cell("local", "auto", 8192, None, params=W256, status="error",
                                   reason="boom"),
                              cell("local", "flex_standard", 8192, 1.0, params=W256)])  # fmt: skip
    assert verdicts(tmp_path)["a"] == "not held"
    # no twin, or one that failed other than out of memory: nothing to compare, not measured
    # (before: held)
    bench(tmp_path, "goals", [cell("local", "auto", 8192, 1.0, params=W256)])
    assert verdicts(tmp_path)["a"] != "held"
    bench(tmp_path, "goals", [cell("local", "auto", 8192, 1.0, params=W256),
                              cell("local", "flex_standard", 8192, None, params=W256,
                                   status="error", reason="boom")])  # fmt: skip
    assert verdicts(tmp_path)["a"] != "held"


def moba_run(folder, moba_ms, twin_pairs=1536 * 16384, lengths=(16384,), blocked_ms=None):
    cells = []
    for n in lengths:
        cells += [
            cell("moba", "auto", n, moba_ms, params=MOBA, pairs=1536 * n),
            cell("block_local", "auto", n, 1.0, params=TWIN, pairs=twin_pairs * n // 16384),
        ]
        if blocked_ms is not None:
            cells.append(cell("moba", "blocked", n, blocked_ms, params=MOBA, pairs=1536 * n))
    bench(folder, "moba", cells, variants=["moba", "block_local"], peers=["sdpa_dense"],
          lengths=list(lengths), params={"moba": MOBA, "block_local": TWIN})  # fmt: skip


def test_goal_b_compares_time_per_pair_with_the_nearest_fixed_pattern(tmp_path):
    moba_run(tmp_path, 1.5, lengths=(16384, 65536), blocked_ms=0.75)
    assert verdicts(tmp_path)["b"] == "held"
    goal = goals.goal_b(goals.load_runs([tmp_path], []))
    assert "MoBA on blocked 0.75 ms" in "\n".join(goal.details)  # beside auto's, for its table
    moba_run(tmp_path, 1.5, twin_pairs=1536 * 16384 * 2, lengths=(16384, 65536))
    goal = goals.goal_b(goals.load_runs([tmp_path], []))  # twice the pairs in 1 ms: 3x per pair
    assert goal.verdict == "not held" and "per pair / its block_local twin's: 3 at" in goal.summary
    moba_run(tmp_path, 1.0, twin_pairs=1536 * 16384 // 3, lengths=(16384, 65536))
    assert verdicts(tmp_path)["b"] == "not measured"  # no fixed pattern within 2x of its pairs
    moba_run(tmp_path, 1.0)  # 64K not run
    assert verdicts(tmp_path)["b"] == "not measured"


def decode_run(folder, auto_ms, sdpa_ms=1.0, device=H100, one_kernel_ms=None):
    config = {"variants": ["sliding_window"], "lengths": [4096], "batch": 1, "heads": 2,
              "kv_heads": 1, "head_dim": 64, "warmup": 0, "repeats": 2,
              "params": {"sliding_window": {"window_size": 256}}}  # fmt: skip
    header = {"device": device, "shape": "B=1, H=2, H_kv=1, D=64, bfloat16", "config": config}
    if one_kernel_ms is not None:
        header["one_kernel_ms"] = one_kernel_ms
    cells = [
        {"impl": "zoo:sliding_window", "variant": "sliding_window", "n": 4096, "ms": auto_ms},
        {"impl": "sdpa_dense", "variant": "sliding_window", "n": 4096, "ms": sdpa_ms},
    ]
    (folder / "bench-decode.json").write_text(json.dumps({"header": header, "cells": cells}))


def test_goal_c_floor_from_the_keys_read_and_the_sdpa_step(tmp_path):
    # 257 keys and values per key/value head, 64 bf16 numbers each: 65792 bytes, 19.6 ns at
    # 3.35 TB/s; the step within 2x of that, and under SDPA's.
    decode_run(tmp_path, 3.5e-5)
    assert verdicts(tmp_path)["c"] == "held"
    decode_run(tmp_path, 5e-5)
    assert verdicts(tmp_path)["c"] == "not held"
    decode_run(tmp_path, 3.5e-5, sdpa_ms=3e-5)
    assert verdicts(tmp_path)["c"] == "not held"
    decode_run(tmp_path, 3.5e-5, device="Some GPU")  # no bandwidth known
    assert verdicts(tmp_path)["c"] == "not measured"
    assert verdicts(tmp_path, bandwidth=3.35)["c"] == "held"
    # The machine's one-kernel step (5 us) is told beside the floor, not judged.
    decode_run(tmp_path, 0.0101, one_kernel_ms=0.005)
    goal = goals.goal_c([tmp_path], None, [])
    assert goal.verdict == "not held"
    assert "2.01x the floor plus one kernel's step (5 us)" in "\n".join(goal.details)


def test_goal_c_judges_the_faster_of_the_eager_and_the_compiled_step(tmp_path):
    """A second file of compiled steps (CUDA graphs over a static cache) beside the eager one:
    the faster is judged, and the figures say which and give the other's time."""
    decode_run(tmp_path, 0.5, sdpa_ms=0.1)  # eager: 0.5 ms, 5x SDPA
    assert verdicts(tmp_path)["c"] == "not held"
    data = json.loads((tmp_path / "bench-decode.json").read_text())
    data["cells"] = [
        {"impl": "zoo:sliding_window+compile", "variant": "sliding_window", "n": 4096,
         "ms": 3.5e-5},
        {"impl": "sdpa_dense", "variant": "sliding_window", "n": 4096, "ms": 0.2},
    ]  # fmt: skip
    (tmp_path / "bench-decode-compiled.json").write_text(json.dumps(data))
    goal = goals.goal_c([tmp_path], None, [])
    assert goal.verdict == "held", goal.details
    row = next(line for line in goal.details if "| sliding_window | 4096 |" in line)
    assert "step 3.5e-05 ms (compiled; eager 0.5 ms)" in row and "sdpa_dense 0.1 ms" in row
    data["cells"][0].update(ms=None, status="failed", reason="RuntimeError: no graph")
    (tmp_path / "bench-decode-compiled.json").write_text(json.dumps(data))
    row = next(line for line in goals.goal_c([tmp_path], None, []).details if "| sliding" in line)
    assert "step 0.5 ms (eager; compiled failed: RuntimeError: no graph)" in row
    data["cells"][0]["ms"] = 0.6  # slower than the eager step: the eager one is judged
    (tmp_path / "bench-decode-compiled.json").write_text(json.dumps(data))
    row = next(line for line in goals.goal_c([tmp_path], None, []).details if "| sliding" in line)
    assert "step 0.5 ms (eager; compiled 0.6 ms)" in row


def test_keys_read_by_a_decoding_step():
    assert goals.keys_read("sliding_window", {"window_size": 256}, 5000, 4, 2) == (257.0, 0)
    assert goals.keys_read("causal", {}, 99, 2, 2) == (100.0, 0)
    # MoBA: its own block so far (2000 % 512 + 1), two whole earlier blocks, three block means.
    assert goals.keys_read("moba", MOBA, 2000, 2, 1) == (465 + 1024, 3)
    # Where bench-decode measured what the query heads chose (their union), that is read.
    assert goals.keys_read("moba", MOBA, 2000, 2, 1, measured=2500.0) == (2500.0, 3)


def test_goal_c_reads_moba_s_measured_keys(tmp_path):
    """MoBA's floor from the keys its step's choice read (bench-decode's keys_read, the union
    over the query heads of a key/value head), not one head's top_k - 1 blocks."""
    decode_run(tmp_path, 1.0)
    data = json.loads((tmp_path / "bench-decode.json").read_text())
    data["header"]["config"].update(variants=["moba"], params={"moba": MOBA})
    for c in data["cells"]:
        c["variant"], c["impl"] = "moba", c["impl"].replace("sliding_window", "moba")
    data["cells"][0]["keys_read"] = 3000.0
    (tmp_path / "bench-decode.json").write_text(json.dumps(data))
    row = next(line for line in goals.goal_c([tmp_path], None, []).details if "| moba |" in line)
    assert "3000 keys" in row


@pytest.mark.parametrize(
    "compiles, measured, expected",
    [(2, 20, "held"), (3, 3, "not held"), (1, 5, "not measured")],
)
def test_goal_d(tmp_path, compiles, measured, expected):
    data = {"header": {"device": H100, "call": "local", "config": {"backend": "flex"}},
            "compiles": compiles, "measured": measured, "compiled_at": [1000]}  # fmt: skip
    (tmp_path / "compiles.json").write_text(json.dumps(data))
    assert verdicts(tmp_path)["d"] == expected


def test_goal_e_from_the_cell_or_from_the_dense_peer(tmp_path):
    realization(tmp_path, 0.7)
    assert verdicts(tmp_path)["e"] == "held"
    realization(tmp_path, 0.5)
    assert verdicts(tmp_path)["e"] == "not held"
    # No realization field: (dense / time) x (pairs / all pairs) = 100 x 0.005 = 0.5.
    bench(tmp_path, "realization", [
        cell("full", "sdpa_dense", 65536, 100.0),
        cell("local", "auto", 65536, 1.0, params=W1024, pairs=65536 * 65536 // 200),
    ], lengths=[65536], params={"local": W1024})  # fmt: skip
    goal = goals.goal_e(goals.load_runs([tmp_path], []))
    assert goal.verdict == "not held" and "lowest 0.5 at 64K non-causal fwd" in goal.summary


def test_a_folder_that_does_not_exist_is_refused(tmp_path, capsys):
    """It was made, and summarised as one where nothing was measured (exit 0)."""
    assert goals.main([str(tmp_path), str(tmp_path / "typo")]) == 2
    assert f"no such OUT folder: {tmp_path / 'typo'}" in capsys.readouterr().err
    assert not (tmp_path / "typo").exists()


def test_summary_first_lines_tests_stages_and_unreadable_files(tmp_path):
    (tmp_path / "gpu-tests.txt").write_text("....F\n= 1 failed, 41 passed, 3 skipped in 9.1s =\n")
    (tmp_path / "stages.tsv").write_text(
        "stage\tlimit_s\twall_s\texit\tstatus\ntests\t90.000\t9.500\t1\tfailed\n"
    )
    (tmp_path / "bench-goals.json").write_text('{"header": ')  # cut short mid-write
    assert goals.main([str(tmp_path)]) == 0
    lines = (tmp_path / "summary.md").read_text().splitlines()
    assert lines[0] == "# GPU campaign: which goals hold"
    assert lines[2] == "- GPU tests: 1 failed, 41 passed, 3 skipped (stage failed)"
    assert all(line.endswith("not measured") or "not measured;" in line for line in lines[3:8])
    text = "\n".join(lines)
    assert "| tests | 90.000 | 9.500 | 1 | failed |" in text and "unreadable" in text
    data = json.loads((tmp_path / "summary.json").read_text())
    assert {g["verdict"] for g in data["goals"].values()} == {"not measured"}


def test_profile_twins_in_the_summary(tmp_path):
    def prof(backend, kind, step):
        return {"variant": "local", "params": W256, "backend": backend, "kind": kind, "n": 16384,
                "causal": False, "pass": "fwd", "resolved": "flex", "status": "ok", "steps": 3,
                "step_ms": step, "kernel_ms": 0.5, "gap_ms": 0.1, "lead_ms": 0.1, "kernels": 2,
                "top": []}  # fmt: skip

    cells = [prof("auto", "zoo", 1.2), prof("flex_standard", "peer", 1.0)]
    (tmp_path / "profile.json").write_text(json.dumps({"header": {"device": H100}, "cells": cells}))
    text, _ = goals.summarise([tmp_path])
    assert "| local | 16K non-causal fwd | auto->flex | 1.200 |" in text


def test_the_tests_line_names_failures_and_counts_a_stopped_run(tmp_path):
    """With -v, a run stopped before pytest's summary still says what ended and how (xdist's
    lines and plain ones; a teardown ERROR after a PASSED counts as the ERROR), and failures are
    named, from the lines or from -rfE's summary."""
    stopped = "\n".join([
        "bringing up nodes...",
        "[gw0] [  1%] PASSED tests/a.py::test_one[x]",
        "[gw1] [  2%] FAILED tests/a.py::test_two[y-z]",
        "tests/b.py::test_three PASSED [  3%]",
        "tests/b.py::test_three ERROR [  3%]",
        "[gw2] [  4%] SKIPPED tests/c.py::test_four",
        "KeyboardInterrupt",
    ])  # fmt: skip
    (tmp_path / "gpu-tests.txt").write_text(stopped)
    line = goals.tests_line([tmp_path], [{"stage": "tests", "status": "killed after its limit"}])
    assert line == (
        "- GPU tests: no pytest summary (interrupted) (stage killed after its limit); the tests "
        "that ended: 1 passed, 1 failed, 1 error, 1 skipped; failed: tests/a.py::test_two[y-z], "
        "tests/b.py::test_three"
    )
    finished = "....F\nFAILED tests/d.py::test_five - Error\n= 1 failed, 4 passed in 2s =\n"
    (tmp_path / "gpu-tests.txt").write_text(finished)
    assert goals.tests_line([tmp_path], []) == (
        "- GPU tests: 1 failed, 4 passed; failed: tests/d.py::test_five"
    )


def test_the_host_time_around_the_kernel_in_the_first_lines(tmp_path):
    text, data = goals.summarise([tmp_path])
    assert "- host time a call adds around its kernel: not measured" in text.splitlines()
    cells = [
        {"variant": v, "backend": b, "n": 8192, "added_us": us, "zoo_us": us + 1, "stub_us": 1}
        for v, b, us in (("local", "flex", 9.5), ("causal", "flex", 12.25), ("full", "sdpa", 7))
    ]
    (tmp_path / "overhead.json").write_text(
        json.dumps({"header": {"device": H100}, "cells": cells})
    )
    text, data = goals.summarise([tmp_path])
    line = f"- host time a call adds around its kernel ({H100}): flex 9.5-12.2 us over 2 cells; "
    assert line + "sdpa 7-7 us over 1 cells" in text.splitlines()
    assert data["overhead"].startswith("host time")


def test_the_host_time_line_counts_a_cell_that_raised_as_failed(tmp_path):
    """bench-overhead records a cell that raises with its status and reason and no times: the
    line counts it as failed (the summary raised KeyError: 'added_us' and was not written)."""
    cells = [
        {"variant": "local", "backend": "flex", "n": 8192, "added_us": 9.5, "zoo_us": 10.5,
         "stub_us": 1},
        {"variant": "moba", "backend": "flex", "n": 8192, "status": "error", "reason": "boom"},
        {"variant": "moba", "backend": "sdpa", "n": 8192, "status": "error", "reason": "boom"},
    ]  # fmt: skip
    (tmp_path / "overhead.json").write_text(
        json.dumps({"header": {"device": H100}, "cells": cells})
    )
    assert goals.overhead_line([tmp_path], []) == (
        f"- host time a call adds around its kernel ({H100}): flex 9.5-9.5 us over 1 cells "
        "(1 failed: see overhead.json); sdpa not measured (1 failed: see overhead.json)"
    )


def test_the_tests_line_tells_how_the_stage_of_its_own_folder_ended(tmp_path):
    """`gpu_session.sh tests` in one OUT (gpu-tests.txt, no stages.tsv) and `all` in another
    (its tests stage skipped), read together: the counts are not told as a skipped stage's."""
    run, tests = tmp_path / "all", tmp_path / "tests"
    run.mkdir(), tests.mkdir()
    (run / "stages.tsv").write_text(
        "stage\tlimit_s\twall_s\texit\tstatus\ntests\t0.000\t0.000\t-\tskipped: no time left\n"
    )
    (tests / "gpu-tests.txt").write_text("= 12 failed, 264 passed, 2 skipped in 398.1s =\n")
    stages = goals.read_stages([run, tests])
    assert goals.tests_line([run, tests], stages) == (
        "- GPU tests: 12 failed, 264 passed, 2 skipped"
    )
    assert goals.tests_line([run], stages) == "- GPU tests: not run (stage skipped: no time left)"


def test_goal_c_names_a_decode_compiled_stage_that_did_not_end_well(tmp_path):
    """Goal (c) reads bench-decode-compiled.json too: its stage cut short is named on the goal's
    line, as decode's is (it was left out)."""
    decode_run(tmp_path, 3.5e-5)
    (tmp_path / "stages.tsv").write_text(
        "stage\tlimit_s\twall_s\texit\tstatus\ndecode\t46.2\t40.1\t0\tok\n"
        "decode_compiled\t38.5\t42.2\t124\tstopped at its limit\n"
    )
    text, _ = goals.summarise([tmp_path])
    line = next(line for line in text.splitlines() if line.startswith("- goal (c)"))
    assert line.endswith("[stage decode_compiled stopped at its limit]"), line


def test_goal_a_counts_a_twin_skipped_after_its_out_of_memory_as_failed(tmp_path):
    """The sweep skips the longer lengths of a series after its out-of-memory ('skipped'): that
    twin failed as the one that ran out of memory did, and auto's cell passes (it was not
    measured, so goal (a) could not hold where flex_standard fails from some length on)."""
    realization(tmp_path)
    bench(tmp_path, "goals", [
        cell("local", "auto", 8192, 1.0, params=W256),
        cell("local", "flex_standard", 8192, None, params=W256, status="oom", reason="64 GiB"),
        cell("local", "auto", 16384, 1.0, params=W256),
        cell("local", "flex_standard", 16384, None, params=W256, status="skipped",
             reason="skipped after out of memory at n=8192"),
    ], lengths=[8192, 16384])  # fmt: skip
    assert verdicts(tmp_path)["a"] == "held"


def test_goal_c_a_step_judged_in_one_folder_is_not_hidden_by_one_unjudged_in_another(tmp_path):
    """Two OUTs: the first from a device of unknown bandwidth (its step cannot be judged), the
    second from an H100 whose step holds. The second's step counts (it was dropped: the first
    folder's unjudged step stayed, and the goal was not measured)."""
    unknown, h100 = tmp_path / "unknown", tmp_path / "h100"
    unknown.mkdir(), h100.mkdir()
    decode_run(unknown, 3.5e-5, device="Some GPU")
    decode_run(h100, 3.5e-5)
    assert goals.goal_c([h100], None, []).verdict == "held"
    assert goals.goal_c([unknown, h100], None, []).verdict == "held"
    decode_run(h100, 5e-5)  # over 2x its floor: a failure wins in either order
    assert goals.goal_c([unknown, h100], None, []).verdict == "not held"
    assert goals.goal_c([h100, unknown], None, []).verdict == "not held"


def test_goal_c_a_step_that_failed_is_not_held_and_its_reason_shown(tmp_path):
    """A step on auto that ran and failed (out of memory), SDPA timed beside it: not held, its
    reason in the table and the variant named in the summary (it read as not measured, the
    reason nowhere, where goal (a) fails a failed auto cell)."""
    decode_run(tmp_path, 3.5e-5)
    data = json.loads((tmp_path / "bench-decode.json").read_text())
    data["cells"][0].update(ms=None, status="oom", reason="OutOfMemoryError: CUDA out of memory")
    (tmp_path / "bench-decode.json").write_text(json.dumps(data))
    goal = goals.goal_c([tmp_path], None, [])
    assert goal.verdict == "not held", goal.summary
    assert "sliding_window step failed at n = 4096" in goal.summary
    assert "(1 of 1 steps measured" in goal.summary
    row = next(line for line in goal.details if "| sliding_window | 4096 |" in line)
    assert "eager failed: OutOfMemoryError: CUDA out of memory" in row
    # Its compiled form timed within the goal: that one is judged, the eager failure named.
    data["cells"].append({"impl": "zoo:sliding_window+compile", "variant": "sliding_window",
                          "n": 4096, "ms": 3.5e-5})  # fmt: skip
    (tmp_path / "bench-decode.json").write_text(json.dumps(data))
    assert goals.goal_c([tmp_path], None, []).verdict == "held"


def test_goal_e_a_failed_auto_cell_is_not_held_and_its_reason_shown(tmp_path):
    """The auto cell of local (1024 each side) at 64K ran out of memory beside dense SDPA: not
    held, as goal (a) calls the same cell, its reason in the table (it read as not measured, 'no
    ... cell with a dense peer', though the peer ran)."""
    bench(tmp_path, "realization", [
        cell("full", "sdpa_dense", 65536, 100.0),
        cell("local", "auto", 65536, None, params=W1024, status="oom", reason="CUDA out of memory"),
        cell("local", "flex_standard", 65536, 1.0, params=W1024),
    ], lengths=[65536], params={"local": W1024})  # fmt: skip
    goal = goals.goal_e(goals.load_runs([tmp_path], []))
    assert goal.verdict == "not held", goal.summary
    assert "lowest 0 at 64K non-causal fwd (1 of 1 cells measured)" in goal.summary
    assert "| 64K non-causal fwd | 0.000 | auto oom: CUDA out of memory |" in goal.details


def test_goal_b_compares_with_the_twin_the_config_names_only(tmp_path):
    """Beside the MoBA run, the realization stage's local (1024 each side) at 64K, whose pairs
    are nearer MoBA's than block_local's: MoBA is still judged against block_local with the
    config's parameters (it was judged against local, and the verdict changed with the folder's
    other files); block_local with other parameters is no twin either."""
    n = 65536  # pairs per query at 64K causal: MoBA 1268, block_local 764, local 1017
    bench(tmp_path, "moba", [
        cell("moba", "auto", n, 4.0, causal=True, params=MOBA, pairs=1268 * n),
        cell("block_local", "auto", n, 1.0, causal=True, params=TWIN, pairs=764 * n),
    ], variants=["moba", "block_local"], peers=["sdpa_dense"], lengths=[n], causal=[True],
          params={"moba": MOBA, "block_local": TWIN})  # fmt: skip
    goal = goals.goal_b(goals.load_runs([tmp_path], []))
    row = next(line for line in goal.details if "| 64K causal fwd |" in line)
    assert "block_local (block_size=512, neighbors=1)" in row and "2.41" in row, row
    other = {"block_size": 256, "neighbors": 2}
    bench(tmp_path, "realization", [
        cell("local", "auto", n, 3.0, causal=True, params=W1024, pairs=1017 * n),
        cell("block_local", "auto", n, 3.0, causal=True, params=other, pairs=1200 * n),
    ], lengths=[n], causal=[True], params={"local": W1024})  # fmt: skip
    goal = goals.goal_b(goals.load_runs([tmp_path], []))
    assert next(line for line in goal.details if "| 64K causal fwd |" in line) == row
    assert goal.verdict == "not held"  # 16K not run, and the 64K cell over 2x


def test_goal_d_counts_the_compiles_of_the_flex_backend_only(tmp_path):
    """The goal is flex's: a count through another backend (sdpa, which compiles nothing) held
    it."""
    data = {"header": {"device": H100, "call": "local", "config": {"backend": "sdpa"}},
            "compiles": 0, "measured": 20, "compiled_at": []}  # fmt: skip
    (tmp_path / "compiles.json").write_text(json.dumps(data))
    goal = goals.goal_d([tmp_path], [])
    assert goal.verdict == "not measured" and "counted on sdpa, not flex" in goal.summary
