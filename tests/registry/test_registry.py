"""registry.yaml: the built-in entries, users' own files, and errors that name file and entry."""

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

ROOT = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, text: str, name: str = "mine.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


@pytest.fixture
def fresh_registry(monkeypatch):
    """The process-wide registry, reloaded for one test and restored after it."""
    monkeypatch.setattr(zoo.registry, "_registry", None)
    yield zoo.registry.registry()


def test_root_file_is_the_shipped_file():
    assert (ROOT / "registry.yaml").read_text() == zoo.registry.BUILTIN_REGISTRY.read_text()


@pytest.mark.parametrize("name", zoo.list_variants())
def test_builtin_entries_are_complete(name):
    spec = zoo.get_spec(name)
    assert spec.description and spec.paper and spec.complexity.startswith("O(")
    assert isinstance(spec.build(), zoo.Pattern)


def test_glob_listing():
    assert zoo.list_variants("*local*") == ["block_local", "block_local_2d", "local"]
    assert set(zoo.list_variants()) >= {
        "full",
        "local",
        "strided",
        "global",
        "random",
        "longformer",
        "bigbird",
    }


def test_unknown_variant_suggests_close_names():
    with pytest.raises(ValueError, match=r"unknown variant 'bigbrid'; did you mean 'bigbird'\?"):
        zoo.get_spec("bigbrid")


def test_overrides_win_and_unknown_overrides_fail():
    assert zoo.get_spec("local").build(window_size=3) == zoo.patterns.Local(3)
    with pytest.raises(
        TypeError, match=r"variant 'bigbird' has no parameter 'window_size'.*block_size"
    ):
        zoo.get_spec("bigbird").build(window_size=3)


def test_user_file_adds_a_composition(fresh_registry, tmp_path):
    path = write(
        tmp_path,
        """
        variants:
          band_and_first:
            pattern:
              union:
                - local: {window_size: $w}
                - global: {global_tokens: 1}
            params: {w: 2}
            description: A narrow band plus the first token.
        """,
    )
    assert zoo.load_registry(path) == ["band_and_first"]
    mask = zoo.dense_mask("band_and_first", 10, w=1)
    assert mask[5].tolist() == [True, False, False, False, True, True, True, False, False, False]
    attn = zoo.create_attention("band_and_first", dim=16, num_heads=2, w=3)
    assert attn(torch.randn(1, 12, 16)).shape == (1, 12, 16)


def test_a_parameter_placed_inside_a_list(fresh_registry, tmp_path):
    """``global_tokens: [$first, 5]`` was passed on as the string '$first', so the entry failed
    with "global_tokens[0] must be an int, got '$first'" although it declares first."""
    path = write(
        tmp_path,
        """
        variants:
          two_globals:
            pattern: {global: {global_tokens: [$first, 5]}}
            params: {first: 0}
            description: Tokens first and 5 attend and are attended by all.
        """,
    )
    zoo.load_registry(path)
    assert zoo.get_spec("two_globals").build(first=2) == zoo.patterns.Global([2, 5])
    with pytest.raises(ValueError, match=r"\$last refers to a parameter .* do not declare"):
        pattern = {"global": {"global_tokens": ["$first", "$last"]}}
        zoo.VariantSpec(name="b", pattern=pattern, params={"first": 0}).validate()


def test_zoo_registry_environment_variable(tmp_path):
    path = write(
        tmp_path,
        "variants:\n  wide_local:\n    pattern: local\n"
        "    params: {window_size: 512}\n    description: d\n",
    )
    env = {**os.environ, "ZOO_REGISTRY": str(path)}
    code = "import zoo; print(zoo.get_spec('wide_local').build())"
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    assert "Local(window_size=(512, 512))" in done.stdout


def test_zoo_imports_makes_a_one_file_pattern_a_variant_of_the_command_lines(tmp_path):
    """``ZOO_IMPORTS`` names the module of a one-file pattern: ``zoo list`` and the harness's
    name check know it (before, only a Python session that imported the file did); a module
    that does not import is a warning, and the zoo works."""
    (tmp_path / "band.py").write_text(
        textwrap.dedent(
            """
            from dataclasses import dataclass
            import zoo

            @zoo.register_pattern("band_with_first", description="Keys within w, and key 0.")
            @dataclass(frozen=True)
            class BandAndFirst(zoo.Pattern):
                w: int = 64

                def allowed(self, q_pos, kv_pos):
                    return ((q_pos - kv_pos).abs() <= self.w) | (kv_pos == 0)
            """
        )
    )
    # a module that uses the zoo as it is imported: what it loads stays loaded
    (tmp_path / "wide.yaml").write_text(
        "variants:\n  wide_local:\n    pattern: local\n    params: {window_size: 512}\n"
        "    description: d\n"
    )
    (tmp_path / "loads_yaml.py").write_text(
        f"import zoo\nzoo.load_registry({str(tmp_path / 'wide.yaml')!r})\n"
    )
    path = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    modules = os.pathsep.join(["band", "loads_yaml", "not_a_module"])
    env = {**os.environ, "ZOO_IMPORTS": modules, "PYTHONPATH": path}
    listed = subprocess.run([sys.executable, "-m", "zoo", "list"], env=env, capture_output=True,
                            text=True, cwd=tmp_path)  # fmt: skip
    assert listed.returncode == 0, listed.stderr
    assert "band_with_first" in listed.stdout
    assert "ZOO_IMPORTS names 'not_a_module', which did not import" in listed.stderr
    code = "import zoo; print({'band_with_first', 'wide_local'} <= set(zoo.list_attention()))"
    checked = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, cwd=tmp_path)  # fmt: skip
    assert checked.stdout.strip() == "True", checked.stderr


def test_modules_imported_as_the_registry_loads_register_as_a_script_does(tmp_path):
    """Found by review. A module that a ZOO_REGISTRY entry names (``module:Factory``) and that
    registers a variant as it is imported: its variant was dropped (the registry was being
    built), though ``check_pattern`` found the family. A ZOO_IMPORTS module registering a taken
    name: a warning, the variant left out, but its family kept, so a YAML ``pattern:`` of that
    name built the user's pattern. Both now go as in a script: the variant is added, or the
    name is refused and its family taken back."""
    (tmp_path / "sink.py").write_text(
        textwrap.dedent(
            """
            from dataclasses import dataclass
            import zoo

            @zoo.register_pattern("dilated_sink", description="Every d-th key within w, and 0.")
            @dataclass(frozen=True)
            class DilatedSink(zoo.Pattern):
                w: int = 8
                d: int = 2

                def allowed(self, q_pos, kv_pos):
                    near = ((q_pos - kv_pos).abs() <= self.w) & ((q_pos - kv_pos) % self.d == 0)
                    return near | (kv_pos == 0)
            """
        )
    )
    (tmp_path / "taken.py").write_text(
        "import zoo\n@zoo.register_pattern('longformer', description='mine')\n"
        "def mine(w: int = 1):\n    return zoo.patterns.Local(w)\n"
    )
    (tmp_path / "entries.yaml").write_text(
        "variants:\n  wide_sink:\n    pattern: sink:DilatedSink\n    params: {w: 16}\n"
        "    description: d\n"
    )
    path = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "ZOO_IMPORTS": "taken", "PYTHONPATH": path,
           "ZOO_REGISTRY": str(tmp_path / "entries.yaml")}  # fmt: skip
    code = (
        "import torch, zoo; q = torch.randn(1, 1, 20, 4)\n"
        "print(sorted({'wide_sink', 'dilated_sink'} & set(zoo.list_variants())))\n"
        "print(zoo.attention(q, q, q, variant='dilated_sink').shape)\n"
        "print('longformer' in zoo.list_pattern_families(), zoo.get_spec('longformer').description)"
    )
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr
    listed, shape, taken = done.stdout.splitlines()
    assert listed == "['dilated_sink', 'wide_sink']" and shape == "torch.Size([1, 1, 20, 4])"
    assert taken.startswith("False ") and "mine" not in taken, taken
    assert "ZOO_IMPORTS names 'taken', which did not import (ValueError: variant 'longformer'" in (
        done.stderr
    )


def test_zoo_imports_says_where_to_fix_a_module_that_does_not_import(tmp_path, monkeypatch):
    """Every failure got "is it on sys.path (PYTHONPATH)?", also a module that was found and
    raised (a taken pattern name, a dependency not installed), where sys.path is not the fix."""
    (tmp_path / "raises_on_import.py").write_text("raise RuntimeError('boom')\n")
    (tmp_path / "needs_a_package.py").write_text("import package_not_installed\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    found = "it was found: the error comes from its code"
    for module, said in [
        ("raises_on_import", rf"\(RuntimeError: boom\); {found}"),
        ("needs_a_package", rf"'package_not_installed'\); {found}"),
        ("no_such_module", r"'no_such_module'\); is it on sys.path \(PYTHONPATH\)\?"),
    ]:
        monkeypatch.setenv("ZOO_IMPORTS", module)
        with pytest.warns(zoo.registry.RegistryWarning, match=rf"names '{module}', .*{said}"):
            zoo.registry._import_user_modules()


def test_user_pattern_family_by_decorator_and_by_module_path(fresh_registry, tmp_path, monkeypatch):
    module = tmp_path / "my_patterns.py"
    module.write_text(
        textwrap.dedent(
            """
            import zoo
            from zoo.patterns import Local, Global

            @zoo.register_pattern("band_plus_last")
            def band_plus_last(window_size: int = 1):
                return Local(window_size) | Global([9])

            def only_band(window_size: int = 1):
                return Local(window_size)
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    import my_patterns  # noqa: F401  (registers the family)

    path = write(
        tmp_path,
        """
        variants:
          by_decorator: {pattern: band_plus_last, description: d}
          by_path: {pattern: "my_patterns:only_band", params: {window_size: 2}, description: d}
        """,
    )
    zoo.load_registry(path)
    assert zoo.dense_mask("by_decorator", 10)[0, 9] and zoo.dense_mask("by_decorator", 10)[9].all()
    assert zoo.dense_mask("by_path", 10)[5].sum() == 5
    with pytest.raises(ValueError, match="already registered"):
        zoo.register_pattern("band_plus_last")(lambda: None)


BAD_FILES = {
    "duplicate key": (
        "variants:\n  a: {pattern: full, description: d}\n  a: {pattern: full, description: d}\n",
        "duplicate key 'a'",
    ),
    "unknown entry key": (
        "variants:\n  a: {pattern: full, descripton: d}\n",
        "variant 'a': unknown key 'descripton'; did you mean 'description'",
    ),
    "unknown family": (
        "variants:\n  a: {pattern: lokal, description: d}\n",
        "variant 'a': unknown pattern family 'lokal'; did you mean 'local'",
    ),
    "unknown family parameter": (
        "variants:\n  a: {pattern: local, params: {window: 3}, description: d}\n",
        "variant 'a': .*no parameter 'window'",
    ),
    "wrong type": (
        "variants:\n  a: {pattern: local, params: {window_size: wide}, description: d}\n",
        "variant 'a': window_size must be an int, got 'wide'",
    ),
    "undeclared reference": (
        "variants:\n  a:\n    pattern: {local: {window_size: $w}}\n    description: d\n",
        r"variant 'a': \$w refers to a parameter",
    ),
    "unused parameter": (
        "variants:\n  a:\n    pattern: {local: {window_size: 3}}\n"
        "    params: {w: 2}\n    description: d\n",
        r"variant 'a': params \['w'\] are declared",
    ),
    "name not a string": (  # YAML reads yes as True, 3 as an int: zoo list failed on them
        "variants:\n  yes: {pattern: full, description: d}\n",
        "variant True: a name must be a string, but YAML reads this one as a bool; quote it",
    ),
    "unknown encoding parameter": (  # was the class's TypeError, with no parameters listed
        "positional:\n  p: {encoding: rope, params: {bas: 3}, description: d}\n",
        "encoding 'p': encoding class 'rope' has no parameter 'bas' .*did you mean 'base'",
    ),
    "missing pattern": ("variants:\n  a: {description: d}\n", "variant 'a': needs 'pattern'"),
    "not a mapping": ("variants:\n  a: 3\n", "variant 'a': an entry is a mapping"),
    "unknown section": ("variantz: {}\n", "unknown section 'variantz'; did you mean 'variants'"),
    "bad yaml": ("variants: [unclosed\n", "not valid YAML"),
    "union of one": (
        "variants:\n  a:\n    pattern: {union: [full]}\n    description: d\n",
        "union takes a list of at least two",
    ),
}


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_malformed_files_name_the_file_and_the_entry(case, tmp_path):
    text, message = BAD_FILES[case]
    path = write(tmp_path, text)
    with pytest.raises(ValueError, match=message) as error:
        Registry().load(path)
    assert str(path) in str(error.value)


def test_a_name_yaml_reads_as_no_string_leaves_the_listings_working(tmp_path):
    """An unquoted ``3:`` or ``yes:`` in a ZOO_REGISTRY file was added as an int or bool name,
    and every listing (``zoo.list_variants()``, ``zoo list``) then raised TypeError."""
    path = write(tmp_path, "variants:\n  3: {pattern: local, description: d}\n")
    registry = Registry()
    with pytest.warns(zoo.registry.RegistryWarning, match="variant 3: a name must be a string"):
        registry.load(path, strict=False)
    assert registry.variants == {}


def test_the_same_file_loaded_again_defines_nothing_twice(tmp_path, monkeypatch):
    """A file loaded twice (named in ZOO_REGISTRY and to load_registry, or a notebook cell run
    again) raised "variant 'mine' is already defined in mine.yaml; give it another name", with a
    RegistryWarning per entry where ZOO_REGISTRY named it twice. Its own unchanged entries are
    no second definition; a changed entry still is."""
    text = "variants:\n  mine: {pattern: local, params: {window_size: 3}, description: d}\n"
    path = write(tmp_path, text)
    registry = Registry()
    assert registry.load(path) == ["mine"]
    monkeypatch.chdir(tmp_path)
    assert registry.load("mine.yaml") == ["mine"]  # the same file by another path
    assert registry.variants["mine"].build() == zoo.patterns.Local(3)
    write(tmp_path, text.replace("3", "4"))
    with pytest.raises(ValueError, match=r"variant 'mine' is already defined in .*mine.yaml"):
        registry.load(path)


def test_a_name_defined_twice_across_files(tmp_path):
    registry = Registry()
    registry.load(zoo.registry.BUILTIN_REGISTRY)
    path = write(tmp_path, "variants:\n  local: {pattern: full, description: d}\n")
    with pytest.raises(
        ValueError,
        match=r"variant 'local' is already defined in .*registry.yaml; give it another name",
    ):
        registry.load(path)


def test_a_module_named_where_a_pattern_is_wanted_is_named_a_module():
    """zoo list shows nsa among the variants; zoo.attention, zoo show and zoo.dense_mask called
    it an unknown variant and listed the names without it."""
    q = torch.randn(1, 2, 64, 16)
    for call in (lambda: zoo.attention(q, q, q, variant="nsa"), lambda: zoo.get_spec("nsa"),
                 lambda: zoo.dense_mask("nsa", 16)):  # fmt: skip
        with pytest.raises(ValueError, match=r"'nsa' is an attention module .*create_attention"):
            call()
    assert type(zoo.create_attention("nsa", dim=64, num_heads=4)).__name__ == (
        "NativeSparseAttention"
    )
