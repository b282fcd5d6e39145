"""The zoo command line: each command runs; bad input exits 2 with a sentence, no traceback."""

from __future__ import annotations

import pytest

from zoo.__main__ import main


def test_show_table_and_list(tmp_path, capsys):
    out = tmp_path / "bigbird.png"
    assert main(["show", "bigbird", "--seq-len", "128", "--out", str(out), "block_size=16"]) == 0
    assert out.read_bytes()[:4] == b"\x89PNG"
    assert main(["table", "--seq-len", "64", "--layers", "2"]) == 0
    assert "| `full`" in capsys.readouterr().out
    assert main(["list"]) == 0
    assert "| `bigbird`" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv,message",
    [
        (["show", "bigbrid"], "did you mean 'bigbird'"),
        (["show", "local", "--seq-len", "0"], "seq_len must be a positive int, got 0"),
        (["show", "local", "--out", "/no/such/folder/x.png"], "does not exist"),
        (["show", "local", "window=3"], "no parameter 'window'"),
        (["table", "--seq-len", "-4"], "seq_len must be a positive int, got -4"),
        (["attention-map", "local", "--seq-len", "0"], "seq_len must be a positive int"),
    ],
)
def test_bad_input_exits_2_with_a_sentence(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_stray_words_are_rejected():
    with pytest.raises(SystemExit) as exit_:
        main(["table", "window_size=3"])
    assert exit_.value.code == 2
