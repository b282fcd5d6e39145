"""The efficiency benchmark (``python -m eval bench``) on tiny CPU sweeps: what it writes, that the
reference check really runs, that failures are recorded and the sweep goes on, and its formulas.
No test asserts a speed."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from helpers import needs_cxx

import eval.bench.cell as bench_cell
from eval.bench import run as bench
from eval.bench.config import BenchConfig, backend_instances
from eval.bench.measure import MAX_RUNS, CudaClock, is_oom, peak_memory_mb, time_runs
from eval.bench.report import all_pairs, fit_exponent, goal_line, sparsity_realization
from eval.harness.config import ConfigError, load_config
from zoo.backends import Backend, Capabilities

SMALL = {"local": {"window_size": 8}, "block_local": {"block_size": 16}}


def write_config(tmp_path, **settings) -> str:
    config = {
        "variants": ["local", "block_local"],
        "backends": ["blocked", "sdpa"],
        "peers": ["sdpa_dense"],
        "lengths": [64, 128],
        "passes": ["fwd"],
        "causal": [False],
        "heads": 2,
        "head_dim": 16,
        "warmup": 1,
        "repeats": 3,
        "check_max_len": 128,
        "params": SMALL,
        "out": str(tmp_path / "out"),
        "threads": 2,
        "plots": False,  # a second a figure; drawn where a test looks at them
    }
    config.update(settings)
    path = tmp_path / "bench.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def read_cells(tmp_path) -> tuple[dict, list[dict]]:
    data = json.loads((tmp_path / "out" / "bench.json").read_text())
    return data["header"], data["cells"]


def test_main_writes_json_markdown_and_plots_with_checked_cells(tmp_path, capsys):
    # The flex peer compiles a kernel per cell (seconds each on a CPU with a cold cache); its cells
    # are checked in test_flex_peer_draws_a_mask_per_head_for_a_pattern_per_head.
    path = write_config(tmp_path, plots=True)
    assert bench.main([path]) == 0
    out = tmp_path / "out"
    assert (out / "bench.md").exists() and (out / "time-fwd-noncausal.png").exists()
    assert "## Plots" in (out / "bench.md").read_text()
    header, cells = read_cells(tmp_path)
    for key in ("device", "device_type", "torch", "triton", "cuda", "config", "command"):
        assert key in header
    assert header["config"]["lengths"] == [64, 128]
    # 2 lengths x (the dense peer + 2 variants x 2 backends)
    assert len(cells) == 2 * (1 + 2 * 2)
    for cell in cells:
        assert set(cell) == set(bench_cell.CELL_FIELDS)
        assert cell["status"] == "ok", cell["reason"]
        assert cell["checked"] is True and cell["max_error"] < 1e-4
        assert cell["time_ms"] > 0 and len(cell["times_ms"]) == 3
        assert cell["peak_memory_mb"] > 0  # CPU: from the profiler's allocation events
        assert 0 < cell["allowed_pairs"] <= cell["all_pairs"] == cell["n"] ** 2
        assert cell["useful_tflops"] > 0 and cell["sparsity_realization"] > 0
    local = next(c for c in cells if c["variant"] == "local" and c["backend"] == "blocked")
    assert local["block_size"] == 64 and 0 < local["block_density"] <= 1
    for field in bench_cell.CELL_FIELDS:
        assert field in bench_cell.__doc__
    text = (out / "bench.md").read_text()
    assert "## Goals" in text and "## Fitted exponents" in text and "O(n·w·d)" in text
    assert capsys.readouterr().out.count("[10/10]") == 1  # one progress line per cell


def test_plots_false_draws_no_figure(tmp_path):
    """``plots=false`` (a GPU session's stages, which keep bench.json only): the report without
    figures, its cells as with them."""
    path = write_config(tmp_path, variants=["local"], backends=["sdpa"], peers=[], lengths=[64])
    assert bench.main([path]) == 0
    out = tmp_path / "out"
    assert not list(out.glob("*.png"))
    assert "## Plots" not in (out / "bench.md").read_text()
    assert [c["status"] for c in read_cells(tmp_path)[1]] == ["ok"]


def test_a_sweep_stopped_within_a_point_keeps_its_measured_cells(tmp_path, monkeypatch):
    """bench.json is rewritten after every cell: a GPU session's stage stopped at its limit (a
    signal, here the KeyboardInterrupt SIGINT raises) within a point keeps the cells it measured
    there, not only those of whole points."""
    import eval.bench.sweep as sweep

    path = write_config(tmp_path, variants=["local"], lengths=[64])
    run = sweep.Runner.run
    calls = []

    def stop_at_the_third(self, impl, point):
        calls.append(impl.name)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return run(self, impl, point)

    monkeypatch.setattr(sweep.Runner, "run", stop_at_the_third)
    with pytest.raises(KeyboardInterrupt):
        bench.main([path])
    data = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert data["complete"] is False
    assert [c["backend"] for c in data["cells"]] == calls[:2]  # one point: 3 cells, 2 measured
    assert all(c["status"] == "ok" for c in data["cells"])


def test_a_backend_that_cannot_run_a_call_is_recorded_and_the_sweep_goes_on(tmp_path):
    path = write_config(
        tmp_path, variants=["local"], backends=["flex", "blocked"], passes=["fwd+bwd"],
        peers=["flex_standard"], lengths=[64],
    )  # fmt: skip
    assert bench.main([path]) == 0
    _, cells = read_cells(tmp_path)
    by_backend = {c["backend"]: c for c in cells}
    for name in ("flex", "flex_standard"):
        assert by_backend[name]["status"] == "unsupported"
        assert "no backward pass on cpu" in by_backend[name]["reason"].lower()
        assert by_backend[name]["time_ms"] is None
    assert by_backend["blocked"]["status"] == "ok" and by_backend["blocked"]["checked"]


@needs_cxx
def test_flex_peer_draws_a_mask_per_head_for_a_pattern_per_head(tmp_path):
    """BigBird's random blocks differ per head: the create_block_mask peer must build its mask
    for every head (one mask from head 0's table fails the check against the reference)."""
    path = write_config(
        tmp_path, variants=["bigbird"], backends=["sdpa"], peers=["flex_standard"],
        lengths=[160], check_max_len=256, params={"bigbird": {"block_size": 8, "random_blocks": 2}},
    )  # fmt: skip
    assert bench.main([path]) == 0
    _, cells = read_cells(tmp_path)
    (flex,) = [c for c in cells if c["backend"] == "flex_standard"]
    assert flex["status"] == "ok" and flex["checked"] and flex["max_error"] < 1e-4, flex
    assert flex["mask_build_ms"] >= 0 and flex["block_size"] == 128


class Zeros(Backend):
    """A deliberately wrong backend: every output is zero."""

    name = "zeros"
    capabilities = Capabilities(
        devices=("cpu",), backward=("cpu",), dtypes=(torch.float32,), patterns="any"
    )

    def forward(self, call):
        return torch.zeros_like(call.v), None


class OutOfMemoryAt128(Backend):
    """Runs out of memory from n = 128 on."""

    name = "oomer"
    capabilities = Zeros.capabilities

    def forward(self, call):
        if call.q_len >= 128:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 8 GiB")
        return torch.nn.functional.scaled_dot_product_attention(call.q, call.k, call.v), None


def test_a_wrong_backend_fails_the_check_and_is_not_timed(tmp_path):
    path = write_config(tmp_path, variants=["local"], backends=["zeros", "blocked"], peers=[])
    config = load_config(BenchConfig, path, [])
    bench.run_bench(config, path, extra_backends={"zeros": Zeros()})
    _, cells = read_cells(tmp_path)
    wrong = [c for c in cells if c["backend"] == "zeros"]
    assert len(wrong) == 2
    for cell in wrong:
        assert cell["status"] == "mismatch" and cell["checked"]
        assert cell["max_error"] > cell["tolerance"] and "reference" in cell["reason"]
        assert cell["time_ms"] is None and cell["times_ms"] is None
    assert all(c["status"] == "ok" for c in cells if c["backend"] == "blocked")


def test_out_of_memory_is_recorded_and_longer_lengths_are_skipped(tmp_path):
    path = write_config(
        tmp_path, variants=["full"], backends=["oomer"], peers=[], lengths=[64, 128, 256]
    )
    config = load_config(BenchConfig, path, [])
    bench.run_bench(config, path, extra_backends={"oomer": OutOfMemoryAt128()})
    _, cells = read_cells(tmp_path)
    assert [c["status"] for c in cells] == ["ok", "oom", "skipped"]
    assert "out of memory" in cells[1]["reason"] and "n=128" in cells[2]["reason"]


def test_a_backend_out_of_memory_does_not_skip_the_peer_of_its_name():
    """xformers is both a zoo backend and a peer (bench.yaml): the backend's out of memory
    skipped the peer of its name at that length and every longer one, and the peer never ran.
    Each kind is a series of its own."""
    from eval.bench.cell import Settings
    from eval.bench.impls import Point, Prepared
    from eval.bench.sweep import Runner

    class Impl:
        variant, params = "full", {}

        def __init__(self, kind, oom):
            self.name, self.kind, self.oom, self.ran = "xformers", kind, oom, []

        def setup(self, point):
            self.ran.append(point.n)
            if self.oom:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 8 GiB")
            return Prepared(lambda q, k, v: q.clone(), self.name, False, None, None, 1.0)

    backend, peer = Impl("zoo", oom=True), Impl("peer", oom=False)
    runner = Runner(Settings(0, 1))
    statuses = []
    for n in (64, 128):
        q = torch.randn(1, 1, n, 8)
        point = Point(n, False, False, q, q, q, q, False)
        statuses += [runner.run(impl, point)["status"] for impl in (backend, peer)]
    assert statuses == ["oom", "ok", "skipped", "ok"]
    assert peer.ran == [64, 128] and backend.ran == [64]


def test_fitted_exponents_and_realization_on_synthetic_numbers():
    ns = [1024 * 2**i for i in range(6)]
    assert fit_exponent(ns, [3e-7 * n**2 for n in ns]) == pytest.approx(2.0)
    assert fit_exponent(ns, [5e-3 * n for n in ns]) == pytest.approx(1.0)
    # only the 3 largest lengths count: a constant overhead at small n does not bend the fit
    values = [1.0, 1.0, 1.0, *(2e-3 * n for n in ns[3:])]
    assert fit_exponent(ns, values) == pytest.approx(1.0)
    assert fit_exponent([1024], [1.0]) is None
    assert fit_exponent(ns, [None] * len(ns)) is None
    # 4x faster than dense while computing a tenth of the pairs: 40% of the ideal speed-up
    assert sparsity_realization(8.0, 2.0, 1000, 100) == pytest.approx(0.4)
    assert sparsity_realization(None, 2.0, 1000, 100) is None
    assert all_pairs(4, causal=False) == 16 and all_pairs(4, causal=True) == 10
    assert bench_cell.useful_tflops(10**6, 1, 2, 64, False, 1.0) == pytest.approx(0.512)
    assert bench_cell.useful_tflops(10**6, 1, 2, 64, True, 1.0) == pytest.approx(0.512 * 3.5)
    assert "met by 0.3" in goal_line("x", 0.7, "<=", 1.0)
    assert "missed by 0.2" in goal_line("x", 0.5, ">=", 0.7)


def test_cuda_clock_and_peak_memory_logic_with_a_fake_cuda_module():
    class Event:
        clock = 0.0

        def __init__(self, enable_timing):
            assert enable_timing

        def record(self):
            Event.clock += 1.5
            self.at = Event.clock

        def elapsed_time(self, other):
            return other.at - self.at

    synced = []
    fake = SimpleNamespace(Event=Event, synchronize=lambda device: synced.append(device))
    clock = CudaClock(torch.device("cuda"), cuda=fake)
    for _ in range(3):
        clock.start()
        clock.stop()
    assert clock.durations_ms() == [1.5, 1.5, 1.5] and synced

    memory = {"now": 100 * 2**20, "peak": 0}
    fake = SimpleNamespace(
        synchronize=lambda device: None,
        memory_allocated=lambda device: memory["now"],
        max_memory_allocated=lambda device: memory["peak"],
        reset_peak_memory_stats=lambda device: memory.update(peak=memory["now"]),
    )
    assert peak_memory_mb(lambda: memory.update(peak=164 * 2**20), torch.device("cuda"), fake) == 64
    assert peak_memory_mb(lambda: None, torch.device("meta"), fake) is None


def test_cpu_peak_memory_follows_the_allocations():
    """Two live tensors of 8 MiB, then one freed and one of 4 MiB: the peak is 16 MiB; a product
    counts its inputs and its (n, n) output."""

    def run():
        a = torch.empty(2**21)  # 8 MiB
        b = torch.empty(2**21)
        del a
        c = torch.empty(2**20)  # 4 MiB
        return b, c

    assert peak_memory_mb(run, torch.device("cpu")) == 16
    for n in (256, 1024):  # two (n, 64) inputs and the (n, n) product, float32
        peak = peak_memory_mb(
            lambda n=n: torch.randn(n, 64) @ torch.randn(64, n), torch.device("cpu")
        )
        assert peak == (2 * n * 64 + n * n) * 4 / 2**20


def test_min_time_adds_runs_to_fast_cells_only():
    """repeats runs at least; more while they took under min_time_ms; never past MAX_RUNS."""
    cpu = torch.device("cpu")
    calls = []

    def sleeper(ms: float):
        return lambda: (calls.append(1), time.sleep(ms / 1e3))

    assert len(time_runs(sleeper(0), cpu, 0, 3, None)) == 3
    calls.clear()
    start = time.perf_counter()
    fast = time_runs(sleeper(1), cpu, 1, 3, None, min_time_ms=40)
    elapsed_ms = (time.perf_counter() - start) * 1e3
    # Runs go on until 40 ms of wall time have passed (what a busy machine spends between runs
    # counts too, so the runs' own durations may add up to less): more than the 3 repeats.
    assert elapsed_ms >= 40 and len(fast) > 3 and len(calls) == len(fast) + 1
    assert len(time_runs(sleeper(30), cpu, 0, 3, None, min_time_ms=40)) == 3
    assert len(time_runs(lambda: None, cpu, 0, 3, None, min_time_ms=1e9)) == MAX_RUNS


def test_out_of_memory_errors_are_recognised():
    assert is_oom(torch.cuda.OutOfMemoryError("CUDA out of memory"))
    assert is_oom(RuntimeError("CUDA error: out of memory"))
    assert is_oom(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to ..."))
    assert not is_oom(RuntimeError("shape mismatch")) and not is_oom(ValueError("out of memory"))


@pytest.mark.parametrize(
    "override,expected",
    [
        ("repeatz=3", ["unknown key 'repeatz'", "did you mean 'repeats'"]),
        ("variants=[locall]", ["variants[0]", "unknown variant 'locall'", "'local'"]),
        ("backends=[blocky]", ["backends[0]", "unknown backend 'blocky'", "'blocked'"]),
        ("peers=[flash]", ["peers[0]", "unknown peer 'flash'"]),
        ("params={local: {window: 3}}", ["params: local", "no parameter 'window'"]),
        ("dtype=fp8", ["dtype must be auto or one of"]),
        ("variants=[]", ["variants must name at least one variant"]),
        ("passes=[]", ["passes must list fwd, fwd+bwd or both"]),
        ("causal=[]", ["causal must list false, true or both"]),
        (
            "backend_instances={b16: {backend: blockd}}",
            ["backend_instances.b16.backend", "'blocked'"],
        ),
        (
            "backend_instances={b16: {backend: blocked, waist: 1}}",
            ["backend_instances.b16", "waist"],
        ),
        # a misspelt dtype raised a bare AttributeError (exit 1)
        (
            "backend_instances={b16: {backend: blocked, compute_dtype: bfloat}}",
            ["backend_instances.b16.compute_dtype", "'bfloat'", "float32, bfloat16, float16"],
        ),
        # a repeated value measured its cells twice, and bench-report refused the run's JSON
        ("lengths=[64,128,64]", ["lengths lists 64 more than once"]),
        ("passes=[fwd,fwd]", ["passes lists 'fwd' more than once"]),
    ],
)
def test_bad_configs_are_errors_that_name_the_file_and_key(tmp_path, capsys, override, expected):
    path = write_config(tmp_path)
    assert bench.main([path, override]) == 2
    error = capsys.readouterr().err
    assert path in error
    for text in expected:
        assert text in error
    assert not (tmp_path / "out").exists()


def test_no_backend_and_no_peer_is_an_error(tmp_path, capsys):
    """An empty sweep reported nothing and exited 0."""
    path = write_config(tmp_path, backends=[])
    assert bench.main([path, "peers=[]"]) == 2
    assert "backends and peers are both empty" in capsys.readouterr().err


def test_unknown_key_in_the_file_names_the_file(tmp_path, capsys):
    path = write_config(tmp_path, warm_up=3)
    assert bench.main([path]) == 2
    error = capsys.readouterr().err
    assert path in error and "'warm_up'" in error and "'warmup'" in error


def test_backend_instances_are_built_with_their_options(tmp_path):
    """A backend built with options runs under its own name beside the registered one."""
    path = write_config(tmp_path)
    config = load_config(BenchConfig, path, [
        "backends=[blocked, blocked_bf16]",
        "backend_instances={blocked_bf16: {backend: blocked, compute_dtype: bfloat16}}",
    ])  # fmt: skip
    built = backend_instances(config, path)
    assert built["blocked_bf16"].compute_dtype == torch.bfloat16
    assert bench.check_config(config, path, built)
    for name in (
        "bench_goals_moba_gpu.yaml",
        "bench_goals_realization_gpu.yaml",
        "bench_blocks_gpu.yaml",
    ):
        shipped = str(bench.CONFIGS / name)
        config = load_config(BenchConfig, shipped, [])
        built = backend_instances(config, shipped)
        assert bench.check_config(config, shipped, built)
    assert built["flex64"].block_size == 64  # bench_blocks_gpu: flex's blocks as the pattern's


def test_a_compiled_call_instance_times_its_calls_under_torch_compile(tmp_path, monkeypatch):
    """``compiled_call: true``: each of its cells' zoo calls goes through torch.compile (here a
    spy that returns the call as it is: what is checked is the wrapping), beside the same
    backend's plain cells; a value that is not a bool is refused with the key."""
    import eval.bench.impls as impls

    compiled = []

    def spy(fn):
        compiled.append(fn)
        return fn

    monkeypatch.setattr(impls.torch, "compile", spy)
    path = write_config(tmp_path, variants=["local"], lengths=[64], peers=[],
                        backends=["sdpa", "sdpa_compiled"],
                        backend_instances={"sdpa_compiled": {"backend": "sdpa",
                                                             "compiled_call": True}})  # fmt: skip
    assert bench.main([path]) == 0
    _, cells = read_cells(tmp_path)
    assert [c["backend"] for c in cells] == ["sdpa", "sdpa_compiled"]
    assert all(c["status"] == "ok" and c["checked"] for c in cells)
    assert len(compiled) == 1  # the compiled cell's call, once
    config = load_config(BenchConfig, path, ["backend_instances={x: {backend: sdpa, "
                                             "compiled_call: 1}}"])  # fmt: skip
    with pytest.raises(ConfigError, match=r"backend_instances.x.compiled_call: true or false"):
        backend_instances(config, path)


def test_shipped_configs_load_and_check():
    for name in ("bench.yaml", "bench_cpu.yaml", "bench_grid.yaml", "bench_grid_cpu.yaml"):
        path = str(bench.CONFIGS / name)
        config = load_config(BenchConfig, path, [])
        assert bench.check_config(config, path)
    gpu = load_config(BenchConfig, str(bench.CONFIGS / "bench.yaml"), [])
    assert gpu.lengths == [1024 * 2**i for i in range(7)] and gpu.repeats >= 30
    assert math.log2(gpu.lengths[-1]) == 16


def synthetic_cell(variant, backend, n, ms, **fields):
    cell = dict.fromkeys(bench_cell.CELL_FIELDS)
    cell.update(variant=variant, backend=backend, n=n, time_ms=ms, status="ok", causal=False)
    cell.update({"pass": "fwd+bwd", "kind": "zoo", "resolved": backend, "sparse": True})
    cell.update(fields)
    return cell


def test_goals_are_computed_from_the_cells():
    from eval.bench.report import exponents, goals

    cells = []
    for n in (1024, 2048, 4096):
        dense = synthetic_cell("full", "sdpa_dense", n, 1e-6 * n * n, kind="peer")
        auto = synthetic_cell(
            "local", "auto", n, 4e-4 * n, allowed_pairs=n * 64, all_pairs=n * n,
            peak_memory_mb=1e-3 * n, mask_build_ms=2.0, resolved="flex",
        )  # fmt: skip
        cells += [dense, auto, synthetic_cell("local", "flex_standard", n, 5e-4 * n, kind="peer")]
        bench.report.realize(auto, dense)
    lines = goals(cells, exponents(cells), "cuda")
    text = "\n".join(lines)
    assert "n=4096: time / flex_standard: 0.8 (goal <= 1): met by 0.2" in text
    # (1e-6 n^2 / 4e-4 n) / (n / 64) = 0.16 at every n
    assert "sparsity realization: 0.16 (goal >= 0.7): missed by 0.54" in text
    assert "memory exponent over n=[1024, 2048, 4096]: 1 (goal <= 1.1): met" in text
    assert "mask build: 2 ms (goal < 10 ms): met by 8 ms" in text


def test_cpu_goals_hold_blocked_to_realization_flex_and_exponents():
    from eval.bench.report import exponents, goals

    cells = []
    for n in (2048, 4096, 8192):
        for pass_, ms, realized in (("fwd", 10.0, 0.6), ("fwd+bwd", 40.0, 0.3)):
            cells.append(synthetic_cell(
                "local", "blocked", n, ms * n / 8192, sparsity_realization=realized,
                peak_memory_mb=(n / 8192) ** 1.3, **{"pass": pass_},
            ))  # fmt: skip
        cells.append(synthetic_cell("local", "flex", n, 8.0, **{"pass": "fwd", "kind": "zoo"}))
        cells.append(
            synthetic_cell("local", "flex_standard", n, 12.5, **{"pass": "fwd", "kind": "peer"})
        )
    text = "\n".join(goals(cells, exponents(cells), "cpu"))
    name = "local, blocked, non-causal"
    assert f"{name}, fwd, n=8192: realization: 0.6 (goal >= 0.5): met by 0.1" in text
    assert f"{name}, fwd+bwd, n=8192: realization: 0.3 (goal >= 0.4): missed by 0.1" in text
    assert f"{name}, fwd, n=8192: time / compiled flex: 1.25 (goal <= 1): missed" in text
    assert f"{name}, fwd: time exponent over n=[2048, 4096, 8192]: 1 (goal <= 1.15): met" in text
    assert f"{name}, fwd+bwd: memory exponent over n=[2048, 4096, 8192]: 1.3 (goal <= 1.1)" in text


def test_a_variant_chosen_by_content_reports_its_pairs_and_its_choice(tmp_path):
    """moba's allowed pairs come from the point's own inputs, its choice has its own column, and
    the peer that needs a fixed mask_mod says why it cannot run."""
    path = write_config(
        tmp_path, variants=["moba"], backends=["blocked"], peers=["sdpa_dense", "flex_standard"],
        lengths=[128], causal=[True], params={"moba": {"block_size": 16, "top_k": 2}},
    )  # fmt: skip
    assert bench.main([path]) == 0
    _, cells = read_cells(tmp_path)
    moba = next(c for c in cells if c["backend"] == "blocked")
    assert moba["status"] == "ok" and moba["checked"] and moba["select_ms"] > 0
    # At most 2 blocks of 16 per query, causal: fewer pairs than 32 per query.
    assert 0 < moba["allowed_pairs"] <= 32 * 128
    peer = next(c for c in cells if c["backend"] == "flex_standard")
    assert peer["status"] == "unsupported" and "chosen by content" in peer["reason"]
    assert "select ms" in (tmp_path / "out" / "bench.md").read_text()


def test_realization_tables_hold_one_row_per_variant_and_backend_per_length():
    from eval.bench.markdown import realization_tables

    def cell(variant, backend, pass_, causal, n, value):
        return {
            "variant": variant,
            "backend": backend,
            "resolved": backend,
            "pass": pass_,
            "causal": causal,
            "n": n,
            "sparsity_realization": value,
        }

    cells = [
        cell("local", "blocked", "fwd", False, 1024, 0.5),
        cell("local", "blocked", "fwd", True, 1024, 0.25),
        cell("local", "flex", "fwd", False, 1024, 0.125),
        cell("local", "blocked", "fwd", False, 2048, None),  # no dense peer at 2048
    ]
    text = realization_tables(cells)
    assert "### Sparsity realization at n = 1024" in text and "n = 2048" not in text
    rows = [line for line in text.splitlines() if line.startswith("| local")]
    assert [r.split("|")[2].strip() for r in rows] == ["blocked", "flex"]
    assert [c.strip() for c in rows[0].split("|")[3:5]] == ["0.5", "0.25"]
    assert [c.strip() for c in rows[1].split("|")[3:5]] == ["0.125", "-"]


def test_a_peer_named_as_a_zoo_backend_is_its_own_series():
    """The H100's 16K run timed xformers as a zoo backend and bare as a peer at the same points:
    bench-report merges it (the key holds the kind) and the report keeps the two apart."""
    from eval.bench.merge import merge_cells
    from eval.bench.report import series

    path = Path(__file__).resolve().parents[2] / "eval/results/bench-gpu-h100/16k/bench.json"
    data = json.loads(path.read_text())
    cells = merge_cells([path], [data])
    assert len(cells) == len(data["cells"])
    names = {key[1] for key in series(cells) if key[0] == "local"}
    assert {"xformers", "xformers (peer)"} <= names
    zoo_times = [c["time_ms"] for c in series(cells)[("local", "xformers", "fwd+bwd", False)]]
    assert zoo_times and all(t is not None for t in zoo_times)


@pytest.mark.parametrize("module", ["compiles", "decode", "overhead", "profile", "run"])
def test_every_bench_json_is_written_whole_or_not_at_all(tmp_path, monkeypatch, module):
    """A stage cut at its limit by a signal in the middle of a write keeps the file's last whole
    version: bench.json was written so, compiles.json, bench-decode.json, overhead.json and
    profile.json were written in place (found by review). Each writes through write_whole."""
    import importlib
    import inspect

    source = inspect.getsource(importlib.import_module(f"eval.bench.{module}"))
    assert '.json").write_text(' not in source and ".json').write_text(" not in source
    path = tmp_path / "data.json"
    bench.write_whole(path, {"cells": [1]})

    def cut(self, text):  # the signal arrives while the new version is being written
        raise KeyboardInterrupt

    monkeypatch.setattr(type(path), "write_text", cut)
    with pytest.raises(KeyboardInterrupt):
        bench.write_whole(path, {"cells": [1, 2]})
    monkeypatch.undo()
    assert json.loads(path.read_text()) == {"cells": [1]}
