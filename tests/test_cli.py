"""The zoo command line: each command runs; bad input exits 2 with a sentence, no traceback."""

from __future__ import annotations

import os
import sys
import textwrap

import pytest
import torch

import zoo
from eval.__main__ import COMMANDS
from eval.__main__ import main as eval_main
from zoo.__main__ import main


def test_show_table_and_list(tmp_path, capsys):
    out = tmp_path / "bigbird.png"
    assert main(["show", "bigbird", "--seq-len", "128", "--out", str(out), "block_size=16"]) == 0
    assert out.read_bytes()[:4] == b"\x89PNG"
    assert main(["table", "--seq-len", "64", "--layers", "2"]) == 0
    assert "| `full`" in capsys.readouterr().out
    assert main(["list"]) == 0
    assert "| `bigbird`" in capsys.readouterr().out


def test_encoding_draws_a_learned_table_longer_than_its_default(tmp_path):
    """The command has no max_len: a table of positions is built --length long (the error had
    advised raising a max_len it cannot be given)."""
    out = tmp_path / "learned.png"
    assert main(["encoding", "learned", "--length", "3000", "--out", str(out)]) == 0
    assert out.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(
    "argv,message",
    [
        (["show", "bigbrid"], "did you mean 'bigbird'"),
        (["show", "local", "--out", "/no/such/folder/x.png"], "does not exist"),
        # A PNG was written under the name x.jpg, which image viewers then failed to open:
        (["show", "local", "--out", "x.jpg"], "'x.jpg' does not end in .png"),
        (["gallery", "--out", "variants"], "pass a name such as 'variants.png'"),
        (["show", "local", "window=3"], "no parameter 'window'"),
        (["show", "local", "causal=true"], "causal is zoo show's --causal flag"),
        # A word naming an argument the command passes itself gave Python's "draw_pattern() got
        # multiple values for argument 'seq_len'", which names no option:
        (["show", "local", "seq_len=3"], "seq_len is zoo show's --seq-len option"),
        (["show", "local", "path=x.png"], "path is zoo show's --out option"),
        (["attention-map", "local", "seq_len=3"], "seq_len is zoo attention-map's --seq-len"),
        (["check", "local", "lengths=3"], "lengths is zoo check's --lengths option"),
        (["attention-map", "local", "--seq-len", "32", "seed=abc"], "seed must be an int"),
        (["attention-map", "local", "--seq-len", "32", "backend=nosuch"], "unknown backend"),
        (["gallery", "--seq-len", "37"], "the gallery cannot draw 'axial_2d' at seq_len=37"),
        # matplotlib's FileNotFoundError traceback (exit 1) before the path was checked:
        (["encoding", "sinusoidal", "--out", "/no/such/folder/p.png"], "does not exist"),
        (["encoding", "sinusoidal", "--out", "p.svg"], "'p.svg' does not end in .png"),
        (["table", "--seq-len", "1"], "does not fit seq_len=1"),
    ],
)
def test_bad_input_exits_2_with_a_sentence(argv, message, capsys, tmp_path, monkeypatch):
    """Also before any output; a bad backend passed silently (exit 0), ``causal=``, a seed that
    is no int and a gallery length with no grid gave messages that named nothing."""
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert message in err and out == ""


@pytest.mark.parametrize(
    "argv,message",
    [
        (["table", "--seq-len", "0"], "argument --seq-len: must be a positive int, got 0"),
        (["table", "--seq-len", "-4"], "argument --seq-len: must be a positive int, got -4"),
        (["table", "--layers", "0"], "argument --layers: must be a positive int, got 0"),
        (["table", "--seq-len", "many"], "argument --seq-len: must be a positive int, got 'many'"),
        (["show", "local", "--seq-len", "0"], "argument --seq-len: must be a positive int, got 0"),
        (["attention-map", "local", "--seq-len", "0"], "argument --seq-len: must be a positive"),
        (["encoding", "sinusoidal", "--length", "0"], "argument --length: must be a positive int"),
        (["encoding", "sinusoidal", "--dim", "0"], "argument --dim: must be a positive int, got 0"),
        (["check", "local", "--lengths", "40,0"], "argument --lengths: must be comma-separated"),
        (["show", "local", "=3"], "parameter '=3' must look like key=value"),
    ],
)
def test_bad_numbers_exit_2_before_any_output(argv, message, capsys):
    """``zoo table --seq-len 0`` printed the table's header line before its error: arguments are
    checked by argparse, which names the option, the value and what it expects, and exits 2."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and message in err


def test_stray_words_are_rejected():
    with pytest.raises(SystemExit) as exit_:
        main(["table", "window_size=3"])
    assert exit_.value.code == 2


def test_check_all_checks_every_variant_graph_included(capsys):
    """``zoo check --all``, what a contributor runs before a pull request, exited 1 on ``graph``
    (its pairs come with the call's graph): it checks graph on an example graph, moba on a random
    input, every variant with its defaults, in a few seconds on one thread."""
    threads = torch.get_num_threads()
    assert main(["check", "--all"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    for name in zoo.list_variants():
        assert f"ok: {name}: three views agree at " in out
    assert "ok: graph: three views agree at 4 shapes" in out  # q_len = kv_len only
    assert torch.get_num_threads() == threads, "the thread count is restored"


def test_the_console_script_imports_a_module_from_the_working_directory(
    tmp_path, monkeypatch, capsys
):
    """The docs' ``zoo check my_patterns:BandAndFirst w=16``, run from the folder of
    my_patterns.py: the console script's sys.path lacks the working directory (``python -m zoo``
    has it), so the import failed."""
    (tmp_path / "cli_band_patterns.py").write_text(
        textwrap.dedent(
            """
            from zoo.patterns import Local


            def band(w=3):
                return Local(w)
            """
        )
    )
    monkeypatch.chdir(tmp_path)
    here = str(tmp_path)
    kept = [p for p in sys.path if not (isinstance(p, str) and os.path.abspath(p or ".") == here)]
    monkeypatch.setattr(sys, "path", kept)
    monkeypatch.delitem(sys.modules, "cli_band_patterns", raising=False)
    assert main(["check", "cli_band_patterns:band", "w=4", "--lengths", "40"]) == 0
    assert capsys.readouterr().out == "ok: cli_band_patterns:band: three views agree at 4 shapes\n"
    assert sys.path == kept, "the working directory is taken off sys.path again"
    monkeypatch.delitem(sys.modules, "cli_band_patterns", raising=False)


def test_the_demo_shows_every_variant(capsys):
    """``python -m eval demo`` crashed on graph (no graph given) and on moba (no fixed mask)."""
    from eval.demo import main as demo

    assert demo(["--seq-len", "100", "--repeats", "1", "--heads", "1", "--head-dim", "8"]) == 0
    rows = {line.split("|")[1].strip() for line in capsys.readouterr().out.splitlines()[3:]}
    assert rows == set(zoo.list_variants())


@pytest.mark.parametrize("word", ["--help", "-h", "help"])
def test_eval_help_exits_0(word, capsys):
    assert eval_main([word]) == 0
    out, err = capsys.readouterr()
    assert "bench-decode" in out and "demo" in out and err == ""


@pytest.mark.parametrize("argv", [[], ["nope"]])
def test_eval_without_a_known_command_exits_2(argv, capsys):
    assert eval_main(argv) == 2
    assert "python -m eval COMMAND" in capsys.readouterr().err


@pytest.mark.parametrize("command", list(COMMANDS))
def test_each_eval_command_has_help(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        eval_main([command, "--help"])
    assert exit_.value.code in (0, None)
    assert "usage:" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["--help"], ["check", "--help"], ["table", "-h"]])
def test_zoo_help_exits_0(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 0
    assert "usage: zoo" in capsys.readouterr().out


def test_zoo_readme_fills_a_stale_table_and_names_a_missing_page(tmp_path, monkeypatch, capsys):
    page = tmp_path / "page.md"
    page.write_text("intro\n<!-- encodings:start -->\nstale\n<!-- encodings:end -->\n")
    monkeypatch.chdir(tmp_path)
    assert main(["readme", "page.md"]) == 0
    assert "page.md: updated" in capsys.readouterr().out
    assert "| `rope`" in page.read_text() and "stale" not in page.read_text()
    assert main(["readme", "page.md"]) == 0
    assert "already up to date" in capsys.readouterr().out
    assert main(["readme", "missing.md"]) == 2
    assert "missing.md is not a file" in capsys.readouterr().err


@pytest.mark.parametrize(
    "later,message", [("missing.md", "missing.md is not a file"), ("bad.md", "'nonsense'")]
)
def test_zoo_readme_changes_no_page_when_a_later_one_is_bad(
    later, message, tmp_path, monkeypatch, capsys
):
    """``zoo readme page.md missing.md`` rewrote page.md and printed "page.md: updated" before
    failing on missing.md: bad input must fail before any output, with no page changed."""
    stale = "intro\n<!-- encodings:start -->\nstale\n<!-- encodings:end -->\n"
    (tmp_path / "page.md").write_text(stale)
    (tmp_path / "bad.md").write_text("<!-- nonsense:start -->\nx\n<!-- nonsense:end -->\n")
    monkeypatch.chdir(tmp_path)
    assert main(["readme", "page.md", later]) == 2
    out, err = capsys.readouterr()
    assert out == "" and message in err
    assert (tmp_path / "page.md").read_text() == stale


def test_zoo_readme_outside_the_repository_says_it_found_no_page(tmp_path, monkeypatch, capsys):
    """``zoo readme`` run from a folder with no README.md or docs/ pages (not the repository's
    root) filled nothing, printed nothing and exited 0, as if every page were up to date."""
    monkeypatch.chdir(tmp_path)
    assert main(["readme"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "has a generated table" in err and "repository's root" in err


def test_check_all_at_a_prime_length_skips_the_grids_and_passes(capsys):
    """``zoo check --all --lengths 37`` exited 1: the 2-D variants fit no grid of 37 tokens,
    which is no disagreement. They are listed as skipped with the reason; the rest are checked.
    A NAME that fits none of its lengths still fails: nothing was checked."""
    assert main(["check", "--all", "--lengths", "37"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    assert "ok: local: three views agree at " in out
    assert "skipped: neighborhood_2d: pattern 'neighborhood_2d' fits none of the lengths" in out
    assert main(["check", "neighborhood_2d", "--lengths", "37"]) == 1
    assert "fits none of the lengths checked" in capsys.readouterr().err
