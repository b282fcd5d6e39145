"""Errors that used to mislead or were missing (issue #12, item 4), and what a user sees instead."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import zoo
import zoo.registry
from zoo.registry import Registry


def write(tmp_path: Path, text: str, name: str = "mine.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def run_zoo(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "zoo", *argv],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
    )


def test_a_misspelt_module_option_suggests_the_option():
    with pytest.raises(
        TypeError,
        match=r"no parameter 'casual' .*did you mean 'causal'\? 'causal' is an option of the "
        r"module \(create_attention / zoo.MultiHeadAttention\), not a parameter of the variant",
    ):
        zoo.create_attention("local", dim=32, num_heads=2, casual=True)
    with pytest.raises(TypeError, match=r"did you mean 'dropout'\?"):
        zoo.create_attention("local", dim=32, num_heads=2, dropuot=0.1)
    q = torch.randn(1, 2, 8, 4)
    with pytest.raises(TypeError, match=r"did you mean 'causal'\? .*option of zoo.attention"):
        zoo.attention(q, q, q, variant="local", casual=True)
    with pytest.raises(TypeError, match=r"did you mean 'dropout_p'\?"):
        zoo.attention(q, q, q, variant="local", dropout=0.1)
    # A misspelt variant parameter is suggested as before, with no word about options.
    with pytest.raises(TypeError, match=r"did you mean 'window_size'\?$"):
        zoo.create_attention("local", dim=32, num_heads=2, windowsize=3)


def test_a_misspelt_combinator_is_an_unknown_pattern(tmp_path):
    path = write(
        tmp_path,
        """
        variants:
          mine:
            pattern:
              unoin:
                - local: {window_size: 2}
                - global: {global_tokens: 1}
            description: d
        """,
    )
    with pytest.raises(ValueError) as error:
        Registry().load(path)
    message = str(error.value)
    assert f"{path}: variant 'mine': unknown pattern 'unoin'; did you mean 'union'?" in message
    assert "must be a mapping" not in message


BROKEN = """
variants:
  broken_band:
    pattern: no_such_package.patterns:band
    description: Its package is not installed.
  good_band:
    pattern: local
    params: {window_size: 3}
    description: A good one.
positional:
  broken_pos:
    encoding: no_such_package.positions:Nearby
    description: Its package is not installed.
"""


def test_an_entry_that_does_not_import_fails_only_when_used(tmp_path, monkeypatch):
    path = write(tmp_path, BROKEN)
    monkeypatch.setattr(zoo.registry, "_registry", None)  # a fresh registry, restored after
    assert set(zoo.load_registry(path)) == {"broken_band", "good_band", "broken_pos"}
    assert "good_band" in zoo.list_variants() and "broken_band" not in zoo.list_variants()
    assert zoo.create_attention("good_band", dim=8, num_heads=2)(torch.randn(1, 5, 8)).shape
    expected = (
        rf"{path}: variant 'broken_band': pattern 'no_such_package.patterns:band': cannot import "
        r"module 'no_such_package.patterns' \(no module named 'no_such_package'\); the part "
        r"before the colon must be importable from sys.path"
    )
    with pytest.raises(ValueError, match=expected):
        zoo.create_attention("broken_band", dim=8, num_heads=2)
    with pytest.raises(ValueError, match=rf"{path}: encoding 'broken_pos': .*cannot import"):
        zoo.create_attention("good_band", dim=8, num_heads=2, pos="broken_pos")


def test_a_module_without_the_name_or_with_a_missing_import(tmp_path, monkeypatch):
    (tmp_path / "half_there.py").write_text("import no_such_dependency\n")
    (tmp_path / "there.py").write_text("def band(window_size: int = 1): ...\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    path = write(
        tmp_path,
        """
        variants:
          a: {pattern: "half_there:band", description: d}
          b: {pattern: "there:bnad", description: d}
        """,
    )
    registry = Registry()
    registry.load(path)
    messages = {n: e.message for n, e in registry.unavailable["variants"].items()}
    assert "it imports 'no_such_dependency', which is not installed" in messages["a"]
    assert "has no attribute 'bnad'; the part after the colon must name one" in messages["b"]


def test_the_cli_runs_with_an_entry_that_does_not_import(tmp_path):
    path = write(tmp_path, BROKEN)
    env = {"ZOO_REGISTRY": str(path)}
    listed = run_zoo("list", env=env)
    assert listed.returncode == 0, listed.stderr
    assert "| `good_band`" in listed.stdout and "| `local`" in listed.stdout
    assert "UNAVAILABLE: no_such_package.patterns:band does not import" in listed.stdout
    shown = run_zoo("show", "broken_band", "--out", str(tmp_path / "x.png"), env=env)
    assert shown.returncode == 2 and "Traceback" not in shown.stderr
    assert f"{path}: variant 'broken_band'" in shown.stderr
    assert "cannot import module 'no_such_package.patterns'" in shown.stderr


def test_the_cli_exits_quietly_when_its_reader_goes_away():
    read, write_end = os.pipe()
    os.close(read)  # the reader is gone before the first line, as `zoo table | head -0`
    try:
        done = subprocess.run(
            [sys.executable, "-m", "zoo", "table", "--seq-len", "64"],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
        )
    finally:
        os.close(write_end)
    assert done.returncode == 1
    assert "Traceback" not in done.stderr and "BrokenPipeError" not in done.stderr, done.stderr


def test_the_module_repr_shows_every_parameter_of_the_variant():
    attn = zoo.create_attention("local", dim=32, num_heads=2)
    assert (
        "dim=32, num_heads=2, variant='local', window_size=128, causal=False, backend='auto', "
        "pos='none'" in repr(attn)
    )
    attn = zoo.create_attention("bigbird", dim=32, num_heads=2, block_size=16, dropout=0.1)
    assert "block_size=16, window_neighbors=1, global_blocks=2, random_blocks=3, seed=0" in repr(
        attn
    )
    assert "dropout=0.1" in repr(attn)


def test_explain_says_when_a_variant_is_full_attention_at_this_length():
    q = torch.randn(1, 2, 64, 8)
    wide = zoo.explain(q, q, q, variant="local")  # window 128 on each side of 64 tokens
    assert "'local' (window_size=128) allows every pair of queries and keys" in wide
    assert "it is full attention at this length, the same as variant 'full'" in wide
    causal = zoo.explain(q, q, q, variant="local", causal=True)
    assert "it is causal attention at this length, the same as variant 'causal'" in causal
    assert "Note:" not in zoo.explain(q, q, q, variant="local", window_size=8)
    assert "Note:" not in zoo.explain(q, q, q, variant="full")
