"""Errors that used to mislead or were missing (issue #12, item 4), and what a user sees instead."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import zoo
import zoo.registry
from zoo.registry import Registry, RegistryWarning


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
        """,
    )
    registry = Registry()
    registry.load(path)
    messages = {n: e.message for n, e in registry.unavailable["variants"].items()}
    assert "it imports 'no_such_dependency', which is not installed" in messages["a"]
    # A module that imports but lacks the name: a misspelling, which the strict load raises
    # (it was recorded as unavailable, silently, until the entry's first use).
    misspelt = write(
        tmp_path, 'variants:\n  b: {pattern: "there:bnad", description: d}\n', "b.yaml"
    )
    with pytest.raises(
        ValueError, match=r"variant 'b': .*has no attribute 'bnad'; did you mean 'band'"
    ):
        Registry().load(misspelt)
    with pytest.warns(RegistryWarning, match="has no attribute 'bnad'"):
        assert Registry().load(misspelt, strict=False) == ["b"]


@pytest.mark.parametrize("field", ["mechanism", "encoding", "module"])
@pytest.mark.parametrize("value", ["5", "null", "[linear]", "{a: 1}"])
def test_a_class_field_that_is_not_a_string_names_the_field(tmp_path, field, value):
    """It failed deep inside ("argument of type 'int' is not iterable", "unhashable type:
    'list'"), and a ZOO_REGISTRY file with ``module: 5`` broke every zoo call with an
    AttributeError."""
    section = {"mechanism": "mechanisms", "encoding": "positional", "module": "modules"}[field]
    path = write(tmp_path, f"{section}:\n  m9: {{{field}: {value}, description: d}}\n")
    with pytest.raises(ValueError, match=rf"'m9': '{field}' must be a string .*got "):
        Registry().load(path)
    with pytest.warns(RegistryWarning, match=rf"'{field}' must be a string"):
        Registry().load(path, strict=False)


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


def test_explain_judges_a_pattern_drawn_per_head_by_every_head():
    """BigBird drawing its random blocks per head among all blocks: at 7 tokens heads 0, 1 and 3
    allow every causal pair and head 2 (seed 2) does not, so 4 heads are not causal attention
    (the note judged head 0 alone); 1 head is."""
    params = dict(variant="bigbird", causal=True, block_size=2, random_blocks=3, seed=0,
                  random_among="all")  # fmt: skip
    four, one = torch.randn(1, 4, 7, 8), torch.randn(1, 1, 7, 8)
    assert "Note:" not in zoo.explain(four, four, four, **params)
    assert "it is causal attention at this length" in zoo.explain(one, one, one, **params)


# Bad input found by a tester (issue #12, item 5): each used to fail deep inside torch, the YAML
# reader or a cache, or not at all.


def test_a_head_dim_of_zero_is_named():
    empty = torch.randn(1, 1, 8, 0)
    expected = r"q, k and v need a head_dim \(dim 3\) of at least 1, got \(1, 1, 8, 0\)"
    with pytest.raises(ValueError, match=expected):
        zoo.attention(empty, empty, empty, variant="full")  # was ZeroDivisionError
    with pytest.raises(ValueError, match=expected):
        zoo.attention(empty, empty, empty, variant="linear")  # a mechanism
    q = torch.randn(1, 1, 8, 4)
    with pytest.raises(ValueError, match=r"at least 1, got .* and \(1, 1, 8, 0\)"):
        zoo.attention(q, q, empty, variant="local")


@pytest.mark.parametrize("scale", [float("inf"), float("nan"), float("-inf")])
def test_a_scale_that_is_not_finite(scale):
    q = torch.randn(1, 2, 8, 4)
    with pytest.raises(
        ValueError,
        match=rf"scale must be a positive number or None \(1/sqrt\(head_dim\)\), got {scale}: "
        r"a finite positive number is expected",
    ):
        zoo.attention(q, q, q, variant="full", scale=scale)  # inf returned NaN everywhere


@pytest.mark.parametrize("variant", ["full", "performer"])
def test_a_scale_beyond_the_scores_dtype_is_not_finite(variant):
    """1e39 is finite in Python, infinite in the float32 the scores are formed in: every output
    was NaN. float64 inputs form their scores in float64, where it is finite."""
    q = torch.randn(1, 2, 8, 4)
    with pytest.raises(ValueError, match=r"got 1e\+39: .* finite in the scores' torch.float32"):
        zoo.attention(q, q, q, variant=variant, scale=1e39)
    with pytest.raises(ValueError, match=r"got 1e\+39: .* finite in the scores' torch.float32"):
        zoo.attention(q.half(), q.half(), q.half(), variant="full", scale=1e39)
    out = zoo.attention(q.double(), q.double(), q.double(), variant="full", scale=1e39)
    assert not out.isnan().any()


def test_return_weights_is_checked_whether_or_not_a_plan_was_kept():
    """A call of a kept plan's signature took return_weights=None or 0 as False: the same call
    was refused before the first plain call and accepted after it."""
    q = torch.randn(1, 2, 8, 4)
    zoo.attention(q, q, q, variant="local", window_size=2)
    for value in (None, 0):
        with pytest.raises(TypeError, match=f"return_weights must be True or False, got {value}"):
            zoo.attention(q, q, q, variant="local", window_size=2, return_weights=value)


def test_cp_order_is_named_without_cp_group_and_explain_takes_it():
    """explain refused cp_order as a parameter of the variant; attention took any cp_order
    without a cp_group."""
    q = torch.randn(1, 2, 8, 4)
    assert "auto -> " in zoo.explain(q, q, q, variant="local", window_size=2, cp_order="head_tail")
    for call in (zoo.attention, zoo.explain):
        with pytest.raises(ValueError, match=r"cp_order must be one of .*, got 'bogus'"):
            call(q, q, q, variant="local", window_size=2, cp_order="bogus")


@pytest.mark.parametrize(
    ("variant", "param"),
    [("local", "window_size"), ("dilated", "dilation"), ("block_local", "block_size"),
     ("global", "global_tokens"), ("performer", "num_features"), ("bigbird", "block_size")],
)  # fmt: skip
def test_an_int_beyond_int64_is_named(variant, param):
    """2**70 failed inside torch ("Overflow when unpacking long long"), naming nothing."""
    q = torch.randn(1, 2, 8, 4)
    with pytest.raises(ValueError, match=rf"{param} must be at most 2\*\*62 .*, got {2**70}"):
        zoo.attention(q, q, q, variant=variant, **{param: 2**70})


@pytest.mark.parametrize("option", ["return_weights", "edge_index"])
def test_explain_with_a_cp_group_refuses_what_attention_refuses(option):
    """explain dropped return_weights=True and described a sharded call that attention refuses
    (checked before any collective, so no process group is needed to see it)."""
    q = torch.randn(1, 2, 8, 4)
    value = True if option == "return_weights" else torch.tensor([[0, 1], [1, 0]])
    with pytest.raises(ValueError, match=f"{option} is not available with cp_group"):
        zoo.explain(q, q, q, variant="local", window_size=2, cp_group=object(), **{option: value})


def test_a_seed_beyond_32_bits():
    """torch's CPU generator reads the low 32 bits of a seed: 2**32 + 5 would draw the pattern
    of 5, so seeds above 2**32 - 1 are refused, naming the bound and why."""
    q = torch.randn(1, 2, 8, 4)
    draw = lambda seed: torch.rand(3, generator=torch.Generator().manual_seed(seed))  # noqa: E731
    assert torch.equal(draw(5), draw(2**32 + 5))
    expected = (
        r"seed must be at most 2\*\*32 - 1 = 4294967295 \(torch's CPU generator reads 32 bits of "
        r"a seed: a larger one would repeat a smaller one's draws\), got 1180591620717411303424"
    )
    at_bound = expected.replace("1180591620717411303424", "4294967296")
    with pytest.raises(ValueError, match=at_bound):
        zoo.attention(q, q, q, variant="random", block_size=2, seed=2**32)
    with pytest.raises(ValueError, match=at_bound):
        zoo.attention(q, q, q, variant="bigbird", block_size=2, seed=2**32)
    with pytest.raises(ValueError, match=at_bound):
        zoo.attention(q, q, q, variant="performer", seed=2**32)
    for variant, params in (("bigbird", {"block_size": 2}), ("performer", {})):
        assert zoo.attention(q, q, q, variant=variant, seed=2**32 - 1, **params).isfinite().all()
    with pytest.raises(ValueError, match=expected):
        zoo.attention(q, q, q, variant="bigbird", seed=2**70)  # was "Overflow when unpacking"
    with pytest.raises(ValueError, match=expected):  # failed only at the first forward
        zoo.create_attention("bigbird", dim=8, num_heads=2, seed=2**70)
    with pytest.raises(ValueError, match=expected):  # a mechanism's seed
        zoo.attention(q, q, q, variant="performer", seed=2**70)
    with pytest.raises(ValueError, match=r"seed must be at least 0, got -1"):
        zoo.attention(q, q, q, variant="random", seed=-1)
    assert zoo.attention(q, q, q, variant="random", block_size=2, seed=2**32 - 1).isfinite().all()


def test_a_value_of_no_parameter_type_gets_the_parameter_check():
    q = torch.randn(1, 2, 8, 4)
    with pytest.raises(TypeError, match=r"window_size must be an int, got \{3\} \(set\)"):
        zoo.attention(q, q, q, variant="local", window_size={3})  # was "unhashable type"


RECURSIVE = {
    "top level": ("a: &x [*x]\n", "a[0]"),
    "in an entry": (
        """
        variants:
          env_loop: &x
            pattern: local
            params: {window_size: 3, more: *x}
            description: d
        """,
        "variants.env_loop.params.more",
    ),
}


@pytest.mark.parametrize("case", list(RECURSIVE))
def test_a_recursive_yaml_anchor_names_the_file(case, tmp_path, monkeypatch):
    text, where = RECURSIVE[case]
    path = write(tmp_path, text)
    monkeypatch.setattr(zoo.registry, "_registry", None)  # a fresh registry, restored after
    with pytest.raises(
        ValueError, match=rf"{path}: a recursive YAML anchor: the alias at {re.escape(where)} "
    ):
        zoo.load_registry(path)  # was RecursionError, without the file
    assert "local" in zoo.list_variants()  # the strict load added nothing, broke nothing


def test_a_key_that_is_not_a_name(tmp_path):
    path = write(tmp_path, "variants:\n  [a, b]: {pattern: full, description: d}\n")
    with pytest.raises(ValueError, match=rf"{path}: not valid YAML: a key must be a name"):
        Registry().load(path)  # was TypeError: unhashable type: 'list'


ENV_ENTRIES = """
variants:
  env_band:
    pattern: local
    params: {window_size: 3}
    description: A good one.
  env_colour:
    pattern: local
    colour: red
    description: An unknown key.
  local:
    pattern: full
    description: The name of a built-in.
"""


def test_a_bad_zoo_registry_file_leaves_the_builtins_working(tmp_path, monkeypatch):
    broken = write(tmp_path, "variants: [unclosed\n", "broken.yaml")
    entries = write(tmp_path, ENV_ENTRIES, "entries.yaml")
    monkeypatch.setenv("ZOO_REGISTRY", os.pathsep.join([str(broken), str(entries)]))
    monkeypatch.setattr(zoo.registry, "_registry", None)  # read ZOO_REGISTRY anew, restored after
    with pytest.warns(zoo.registry.RegistryWarning) as warned:
        zoo.registry.registry()  # every call used to raise the first file's error
    messages = [str(w.message) for w in warned]
    assert len(messages) == 3, messages
    assert messages[0].startswith(f"{broken}: not valid YAML")
    assert "none of its entries are loaded" in messages[0]
    assert messages[1].startswith(f"{entries}: variant 'env_colour': unknown key 'colour'")
    assert messages[2].startswith(f"{entries}: variant 'local' is already defined in")
    assert all(m.endswith("(the file is named in ZOO_REGISTRY)") for m in messages)

    q = torch.randn(1, 2, 8, 4)
    assert zoo.attention(q, q, q, variant="full").shape == q.shape  # the built-ins work
    assert zoo.get_spec("local").source == str(zoo.registry.BUILTIN_REGISTRY)
    assert zoo.attention(q, q, q, variant="env_band").shape == q.shape  # and the good entry
    assert "env_colour" not in zoo.list_variants()
    with pytest.raises(
        ValueError,
        match=rf"{entries}: variant 'env_colour': unknown key 'colour'.*\(the file is named in "
        r"ZOO_REGISTRY\)",
    ):
        zoo.attention(q, q, q, variant="env_colour")
    with pytest.raises(
        ValueError,
        match=rf"unknown variant 'env_gone'.*; note: {broken}, named in ZOO_REGISTRY, did not "
        r"load \(.*not valid YAML",
    ):
        zoo.create_attention("env_gone", dim=8, num_heads=2)


def test_the_cli_lists_the_builtins_with_a_bad_zoo_registry_file(tmp_path):
    looped = write(tmp_path, RECURSIVE["in an entry"][0], "looped.yaml")
    entries = write(tmp_path, ENV_ENTRIES, "entries.yaml")
    listed = run_zoo("list", env={"ZOO_REGISTRY": os.pathsep.join([str(looped), str(entries)])})
    assert listed.returncode == 0, listed.stderr  # was 1, a RecursionError
    assert "| `local`" in listed.stdout and "| `env_band`" in listed.stdout
    assert f"{looped}: a recursive YAML anchor" in listed.stderr
    assert f"{entries}: variant 'env_colour': unknown key 'colour'" in listed.stderr
    assert "Traceback" not in listed.stderr


def test_valid_lens_as_a_list_and_its_errors():
    attn = zoo.MultiHeadAttention(8, 2)
    x = torch.randn(2, 4, 8)
    expected = attn(x, valid_lens=torch.tensor([3, 4]))
    torch.testing.assert_close(attn(x, valid_lens=[3, 4]), expected)  # was AttributeError
    torch.testing.assert_close(attn(x, valid_lens=(3, 4)), expected)
    with pytest.raises(
        ValueError,
        match=r"valid_lens must have shape \(batch,\) = \(2,\), one key count per sequence, got "
        r"\(3,\)",
    ):
        attn(x, valid_lens=torch.tensor([3, 4, 1]))  # named key_padding_mask
    with pytest.raises(
        TypeError,
        match=r"valid_lens must have an integer dtype \(torch.long, say\), got dtype "
        r"torch.float32",
    ):
        attn(x, valid_lens=torch.tensor([3.0, 4.0]))  # reported the shape
    with pytest.raises(TypeError, match=r"valid_lens must hold ints .*got \[3.0, 4\]"):
        attn(x, valid_lens=[3.0, 4])
    with pytest.raises(ValueError, match=r"valid_lens must lie in \[0, 4\] .*got \[3, 5\]"):
        attn(x, valid_lens=[3, 5])


def test_context_of_the_wrong_width():
    x = torch.randn(2, 4, 8)
    with pytest.raises(
        ValueError,
        match=r"context must have shape \(2, kv_len, 8\), got \(2, 5, 6\): its last dim is the "
        r"module's dim, 8 \(build the module with kv_dim=",
    ):
        zoo.MultiHeadAttention(8, 2)(x, context=torch.randn(2, 5, 6))  # was mat1 and mat2 ...
    with pytest.raises(
        ValueError, match=r"got \(2, 5, 8\): its last dim is the module's kv_dim, 6"
    ):
        zoo.MultiHeadAttention(8, 2, kv_dim=6)(x, context=torch.randn(2, 5, 8))


def test_a_variant_that_is_not_a_name_or_a_pattern():
    q = torch.randn(1, 2, 8, 4)
    expected = (
        r"variant must be a registry name \(a str: zoo.list_attention\(\) lists them\), a "
        r"zoo.patterns.Pattern or a mechanism instance \(zoo.mechanisms\), got None \(NoneType\)"
    )
    with pytest.raises(TypeError, match=expected):
        zoo.attention(q, q, q, variant=None)  # was "unknown variant 'None'"
    with pytest.raises(TypeError, match=expected):
        zoo.create_attention(None, dim=8, num_heads=2)
    with pytest.raises(TypeError, match=expected):
        zoo.MultiHeadAttention(8, 2, variant=None)
    with pytest.raises(TypeError, match=expected):
        zoo.dense_mask(None, 4)
    with pytest.raises(TypeError, match=r"an encoding is named by a str .*got None \(NoneType\)"):
        zoo.MultiHeadAttention(8, 2, pos=None)


@pytest.mark.filterwarnings("ignore:`torch.jit.:DeprecationWarning")
@pytest.mark.parametrize("name", ["full", "nsa"])
def test_torchscript_is_refused_with_a_pointer_to_compile_and_export(name):
    """NSA, built by the same create_attention, failed inside TorchScript's compiler or, traced,
    deep in a kernel (found by review): it refuses as MultiHeadAttention does."""
    attn = zoo.create_attention(name, dim=8, num_heads=2, causal=True)
    advice = r"compile the model with torch.compile\(model\), or export .*torch.export.export"
    with pytest.raises(RuntimeError, match=r"does not support TorchScript \(torch.jit.script\)"):
        torch.jit.script(torch.nn.Sequential(attn))
    with pytest.raises(RuntimeError, match=rf"TorchScript \(torch.jit.trace\).*{advice}"):
        torch.jit.trace(attn, torch.randn(2, 4, 8))
