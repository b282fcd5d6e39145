"""``python -m eval bench-report``: a tiny CPU sweep run in two pieces (the second without the dense
peer, and one length beyond the first's) merged into one report, and the merges it refuses."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from test_bench import write_config

from eval.__main__ import main as eval_main
from eval.bench import merge as bench_merge
from eval.bench import run as bench
from eval.bench.merge import DERIVED, cell_key


@pytest.fixture(scope="module")
def pieces(tmp_path_factory):
    """Piece a: local with the dense peer at n = 64, 128; piece b: block_local without it at
    n = 64, 256. Returns the two bench.json paths."""
    root = tmp_path_factory.mktemp("pieces")
    path = write_config(root, backends=["blocked"], plots=True)  # re-rendered reports draw
    split = {
        "a": ["variants=[local]", "lengths=[64,128]"],
        "b": ["variants=[block_local]", "lengths=[64,256]", "peers=[]"],
    }
    for name, overrides in split.items():
        assert bench.main([path, f"out={root / name}", *overrides]) == 0
    return root / "a" / "bench.json", root / "b" / "bench.json"


def read(path) -> dict:
    return json.loads(path.read_text())


def copy_with(path, tmp_path, change, name: str = "edited") -> str:
    """A copy of a bench.json at tmp_path / NAME.json, edited by ``change(data)``."""
    data = read(path)
    change(data)
    copy = tmp_path / f"{name}.json"
    copy.write_text(json.dumps(data))
    return str(copy)


def test_merged_cells_are_the_union_with_realization_from_the_other_piece(pieces, tmp_path, capsys):
    a, b = pieces
    out = tmp_path / "merged"
    assert eval_main(["bench-report", str(a), str(b), f"out={out}"]) == 0
    merged = read(out / "bench.json")
    by_key = {cell_key(c): c for c in merged["cells"]}
    originals = {cell_key(c): c for p in pieces for c in read(p)["cells"]}
    assert by_key.keys() == originals.keys() and len(merged["cells"]) == 4 + 2
    for key, cell in by_key.items():
        measured = {k: v for k, v in cell.items() if k not in DERIVED}
        assert measured == {k: v for k, v in originals[key].items() if k not in DERIVED}
    assert [c["n"] for c in merged["cells"]] == sorted(c["n"] for c in merged["cells"])
    b_at = {c["n"]: c for c in read(b)["cells"]}
    assert all(c["sparsity_realization"] is None for c in b_at.values())  # b has no dense peer
    block_local = {c["n"]: c for c in merged["cells"] if c["variant"] == "block_local"}
    dense_64 = next(c for c in merged["cells"] if c["backend"] == "sdpa_dense" and c["n"] == 64)
    assert block_local[64]["dense_time_ms"] == dense_64["time_ms"]
    expected = (dense_64["time_ms"] / b_at[64]["time_ms"]) * (
        b_at[64]["allowed_pairs"] / b_at[64]["all_pairs"]
    )
    assert block_local[64]["sparsity_realization"] == pytest.approx(expected)
    assert block_local[256]["sparsity_realization"] is None  # no piece has the dense peer at 256
    header = merged["header"]
    assert merged["complete"] is True and header["device"] == read(a)["header"]["device"]
    assert [p["file"] for p in header["pieces"]] == [str(a), str(b)]
    assert header["pieces"][1]["config"]["peers"] == [] and "peers" not in header["config"]
    walls = [read(p)["header"]["wall_seconds"] for p in pieces]
    assert header["wall_seconds"] == pytest.approx(sum(walls), abs=0.1)
    assert header["argv"] == [str(a), str(b), f"out={out}"]
    text = (out / "bench.md").read_text()
    assert "merged from 2 pieces" in text and str(b) in text and "## Goals" in text
    assert (out / "time-fwd-noncausal.png").exists()
    assert "## Fitted exponents" in capsys.readouterr().out


def test_an_interrupted_piece_counts_and_the_report_says_so(pieces, tmp_path, capsys):
    def interrupt(data):
        data.update(complete=False, cells=data["cells"][:1])
        for key in ("wall_seconds", "finished", "load_average_end", "exponents", "goals"):
            data.pop(key, None)
            data["header"].pop(key, None)

    cut = copy_with(pieces[1], tmp_path, interrupt)
    assert bench_merge.main([str(pieces[0]), cut, f"out={tmp_path}"]) == 0
    merged = read(tmp_path / "bench.json")
    assert merged["complete"] is False and len(merged["cells"]) == 4 + 1
    assert f"note: {cut} is incomplete" in capsys.readouterr().out
    assert "**incomplete**" in (tmp_path / "bench.md").read_text()


@pytest.mark.parametrize(
    "name,value",
    [("device", "Some GPU"), ("torch", "0.0.1"), ("dtype", "bfloat16"),
     ("config.heads", 16), ("config.repeats", 50), ("config.min_time_s", 0.5)],
)  # fmt: skip
def test_pieces_that_are_not_comparable_are_refused(pieces, tmp_path, capsys, name, value):
    def change(data):
        target = data["header"]
        *parents, last = name.split(".")
        for parent in parents:
            target = target[parent]
        target[last] = value

    other = copy_with(pieces[1], tmp_path, change)
    assert bench_merge.main([str(pieces[0]), other, f"out={tmp_path / 'out'}"]) == 2
    error = capsys.readouterr().err
    assert f"{other}: header field {name} is {value!r}" in error and str(pieces[0]) in error
    assert not (tmp_path / "out").exists()


def test_a_piece_written_before_min_time_s_merges_with_one_that_ran_without_it(pieces, tmp_path):
    """A header without config.min_time_s (files from before it) ran with 0: as a default run."""
    old = copy_with(pieces[1], tmp_path, lambda data: data["header"]["config"].pop("min_time_s"))
    assert bench_merge.main([str(pieces[0]), old, f"out={tmp_path / 'out'}"]) == 0


def test_a_cell_in_two_pieces_is_refused_unless_identical(pieces, tmp_path, capsys):
    a = str(pieces[0])
    same = copy_with(pieces[0], tmp_path, lambda data: None)
    assert bench_merge.main([a, same, f"out={tmp_path / 'same'}"]) == 0
    assert len(read(tmp_path / "same" / "bench.json")["cells"]) == 4

    def retime(data):
        data["cells"][0]["time_ms"] *= 2

    other = copy_with(pieces[0], tmp_path, retime)
    assert bench_merge.main([a, other, f"out={tmp_path / 'out'}"]) == 2
    error = capsys.readouterr().err
    assert f"in both {a} and {other}" in error and "backend=sdpa_dense" in error and "n=64" in error


def test_one_file_re_renders_to_the_same_report(pieces, tmp_path):
    shutil.copytree(pieces[0].parent, tmp_path / "a")
    assert bench_merge.main([str(tmp_path / "a" / "bench.json")]) == 0  # out: its own folder
    assert read(tmp_path / "a" / "bench.json") == read(pieces[0])
    original = (pieces[0].parent / "bench.md").read_text()
    assert (tmp_path / "a" / "bench.md").read_text() == original


def test_a_merged_report_merges_again_with_its_pieces_kept(pieces, tmp_path):
    a, b = pieces

    def only(n):
        return lambda data: data.update(cells=[c for c in data["cells"] if c["n"] == n])

    b64, b256 = (copy_with(b, tmp_path, only(n), f"b{n}") for n in (64, 256))
    assert bench_merge.main([str(a), b64, f"out={tmp_path / 'first'}"]) == 0
    first = str(tmp_path / "first" / "bench.json")
    assert bench_merge.main([first, b256, f"out={tmp_path / 'again'}"]) == 0
    assert bench_merge.main([str(a), str(b), f"out={tmp_path / 'once'}"]) == 0
    again, once = read(tmp_path / "again" / "bench.json"), read(tmp_path / "once" / "bench.json")
    assert [p["file"] for p in again["header"]["pieces"]] == [str(a), b64, b256]
    assert again["cells"] == once["cells"] and again["goals"] == once["goals"]
    # a piece given again beside the merged file that holds it counts once (before, its wall
    # time was summed twice and it was listed twice)
    assert bench_merge.main([first, str(a), f"out={tmp_path / 'twice'}"]) == 0
    twice = read(tmp_path / "twice" / "bench.json")["header"]
    assert [p["file"] for p in twice["pieces"]] == [str(a), b64]
    assert twice["wall_seconds"] == read(Path(first))["header"]["wall_seconds"]


@pytest.mark.parametrize(
    "args,expected",
    [(["out=x"], "no bench.json given"), (["a.json", "b.json"], "out=DIR is needed"),
     (["a.json", "outdir=x"], "unknown option 'outdir'"), (["missing.json"], "missing.json"),
     (["a.json", "a.json", "out=x"], "given twice")],
)  # fmt: skip
def test_bad_arguments_are_errors_that_say_what_to_give(
    tmp_path, capsys, monkeypatch, args, expected
):
    monkeypatch.chdir(tmp_path)
    assert bench_merge.main(args) == 2
    assert expected in capsys.readouterr().err
