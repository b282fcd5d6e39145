"""A pattern in one file: a class that defines only ``allowed``, registered with
``@zoo.register_pattern(name, description=...)``, is a variant by that name on every backend, in
``zoo list`` and ``zoo check``, with block states derived from ``allowed``."""

from __future__ import annotations

import importlib
import sys
import textwrap

import pytest
import torch
from helpers import check_against_reference

import zoo
from zoo import registry as zoo_registry
from zoo.backends import BlockedBackend, FlexBackend
from zoo.patterns import families as families
from zoo.patterns.base import EMPTY, FULL, PARTIAL, Spans
from zoo.patterns.derived import derived_block_state

PATTERN_FILE = """
from dataclasses import dataclass

import zoo


@zoo.register_pattern(
    "band_and_first_only_allowed",
    description="Keys within w of the query, and key 0.",
    paper="(a test)",
    complexity="O(n·w·d)",
)
@dataclass(frozen=True)
class BandAndFirst(zoo.Pattern):
    w: int = 5

    def allowed(self, q_pos, kv_pos):
        return ((q_pos - kv_pos).abs() <= self.w) | (kv_pos == 0)
"""
NAME = "band_and_first_only_allowed"


@pytest.fixture(scope="module")
def one_file(tmp_path_factory):
    """The file above imported as a user's module; unregistered afterwards (the registry is
    process-wide, and the README's tables are generated from it)."""
    folder = tmp_path_factory.mktemp("user")
    (folder / "one_file_pattern.py").write_text(textwrap.dedent(PATTERN_FILE))
    sys.path.insert(0, str(folder))
    try:
        yield importlib.import_module("one_file_pattern")
    finally:
        sys.path.remove(str(folder))
        sys.modules.pop("one_file_pattern", None)
        zoo_registry.registry().variants.pop(NAME, None)
        families._FAMILIES.pop(NAME, None)
        families._CODE_VARIANTS.pop(NAME, None)


BACKENDS = {
    "reference": "reference",
    "sdpa": "sdpa",
    "blocked": BlockedBackend(block_size=16),
    "auto": "auto",
}


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_it_runs_by_name_on_every_backend(one_file, backend, causal, padded):
    check_against_reference(
        NAME, BACKENDS[backend], q_len=45, kv_len=45, causal=causal, padded=padded, params={}
    )


@pytest.mark.parametrize("backend", ["flex-eager", "flex"])
def test_it_runs_on_flex(one_file, backend):
    flex = FlexBackend(block_size=16, compile=backend == "flex")
    check_against_reference(NAME, flex, q_len=45, kv_len=45, params={"w": 3}, grads=False)


def test_it_is_a_variant_with_its_metadata(one_file, capsys):
    spec = zoo.get_spec(NAME)
    assert (spec.description, spec.paper, spec.complexity) == (
        "Keys within w of the query, and key 0.", "(a test)", "O(n·w·d)",
    )  # fmt: skip
    assert spec.parameters() == {"w": 5} and NAME in zoo.list_variants()
    layer = zoo.create_attention(NAME, dim=16, num_heads=2, w=2)
    assert layer(torch.randn(2, 30, 16)).shape == (2, 30, 16)
    from zoo.__main__ import main

    assert main(["list"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if f"`{NAME}`" in line)
    assert "| w=5 " in row  # its defaults, its parameters: "-" before
    assert main(["check", NAME, "--lengths", "37,100"]) == 0


def test_a_pattern_that_is_not_frozen_is_left_out_with_a_sentence():
    """A dataclass without frozen=True is not hashable: every backend's first call failed with a
    bare "unhashable type"; now its registration says why (a ValueError once the registry is
    loaded, as here; a RegistryWarning and the variant left out if it loads later)."""
    import dataclasses

    @dataclasses.dataclass
    class Band(zoo.Pattern):
        w: int = 4

        def allowed(self, q_pos, kv_pos):
            return (q_pos - kv_pos).abs() <= self.w

    assert "longformer" in zoo.list_variants()  # the registry loaded
    try:
        with pytest.raises(ValueError, match=r"not hashable .*@dataclass\(frozen=True\)"):
            zoo.register_pattern("band_not_frozen", description="keys within w")(Band)
        assert "band_not_frozen" not in zoo.list_variants()
        zoo.register_pattern("band_not_frozen")(Band)  # a family alone: refused where built
        with pytest.raises(TypeError, match="pattern 'band_not_frozen' returned a Band that is"):
            families.build_family("band_not_frozen", {})
    finally:
        families._FAMILIES.pop("band_not_frozen", None)
        families._CODE_VARIANTS.pop("band_not_frozen", None)


def test_a_taken_name_raises_and_registers_nothing(one_file):
    with pytest.raises(ValueError, match="variant 'longformer' is already defined in"):

        @zoo.register_pattern("longformer", description="a second longformer")
        class Mine(zoo.Pattern):
            def allowed(self, q_pos, kv_pos):
                return q_pos == kv_pos

    assert zoo.get_spec("longformer").description != "a second longformer"
    assert "longformer" not in zoo.list_families()  # the family was taken back too
    with pytest.raises(ValueError, match="is already defined in one_file_pattern"):
        zoo.register_pattern(NAME, description="again")(one_file.BandAndFirst)
    assert zoo.get_spec(NAME).description == "Keys within w of the query, and key 0."


@pytest.mark.parametrize("name", ["my:band", "", 3])
def test_a_family_name_that_no_lookup_could_find_is_refused(name):
    """A name with a colon registered, but every lookup reads such a name as
    package.module:factory ("cannot import module 'my'"); 3 registered as a family and failed
    as a variant with "a pattern spec is a family name or a one-key mapping"."""
    with pytest.raises(ValueError, match=r"a family name is a non-empty str without ':'"):
        zoo.register_pattern(name)(lambda: zoo.patterns.Full())
    assert name not in families._FAMILIES


def test_a_variant_whose_family_needs_a_parameter_is_refused_with_the_fix():
    """With a description the family is a variant built with its defaults: a field without a
    default failed with the raw "__init__() missing 1 required positional argument: 'w'".
    Without one it is a building block, which a registry entry gives its parameters."""
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class NeedsW(zoo.Pattern):
        w: int

        def allowed(self, q_pos, kv_pos):
            return (q_pos - kv_pos).abs() <= self.w

    with pytest.raises(TypeError, match=r"but w has no default; give it one, or register"):
        zoo.register_pattern("needs_w", description="a band of w")(NeedsW)
    assert "needs_w" not in zoo.list_families() and "needs_w" not in zoo.list_variants()
    try:
        zoo.register_pattern("needs_w")(NeedsW)
        assert zoo.get_spec("local").build() is not None  # the registry still reads
        assert zoo.patterns.families.build_family("needs_w", {"w": 2}) == NeedsW(2)
    finally:
        families._FAMILIES.pop("needs_w", None)


def test_derived_states_are_exact(one_file):
    """EMPTY where no pair is allowed, FULL where every pair of complete blocks is, PARTIAL
    otherwise: counted against the dense view, block by block, blocks of 7 over 45 positions
    (the last block incomplete) and a stepped progression."""
    pattern = one_file.BandAndFirst(4)
    for step in (1, 3):
        positions = torch.arange(0, 45 * step, step)
        blocks = positions.split(7)
        lo = torch.stack([b[0] for b in blocks])
        hi = torch.stack([b[-1] for b in blocks])
        complete = torch.tensor([len(b) == 7 for b in blocks])
        q, k = Spans(lo, hi, step, complete).column(), Spans(lo, hi, step, complete).row()
        state = derived_block_state(pattern, q, k)
        for i, qb in enumerate(blocks):
            for j, kb in enumerate(blocks):
                hit = pattern.allowed(qb[:, None], kb[None, :])
                expected = (
                    FULL if hit.all() and complete[i] and complete[j]
                    else PARTIAL if hit.any() else EMPTY
                )  # fmt: skip
                assert state[i, j] == expected, (step, i, j)


def test_derived_states_chunk_large_spans(one_file, monkeypatch):
    """Spans far larger than a chunk (as the key-value cache's retention asks) give the states
    of the unchunked evaluation."""
    from zoo.patterns import derived

    pattern = one_file.BandAndFirst(30)
    keys = torch.arange(200)
    span_q = Spans(keys // 2, torch.full_like(keys, 199), 1, torch.ones(200, dtype=torch.bool))
    span_k = Spans(keys, keys, 1, torch.ones(200, dtype=torch.bool))
    whole = derived_block_state(pattern, span_q, span_k)
    monkeypatch.setattr(derived, "CHUNK", 64)
    assert torch.equal(derived_block_state(pattern, span_q, span_k), whole)


def test_the_docs_example_runs_by_name(tmp_path, monkeypatch):
    """The docs' one-file pattern (``# band.py`` in docs/extending.md), imported and run by
    name."""
    import re
    from pathlib import Path

    readme = (Path(__file__).parents[2] / "docs" / "extending.md").read_text()
    code = re.search(r"```python\n# band.py\n(.*?)```", readme, re.S).group(1)
    (tmp_path / "readme_band.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        importlib.import_module("readme_band")
        q = torch.randn(1, 2, 100, 8)
        out = zoo.attention(q, q, q, variant="band_with_first", w=4, backend="blocked")
        expected = zoo.attention(q, q, q, variant="band_with_first", w=4, backend="reference")
        torch.testing.assert_close(out, expected)
    finally:
        sys.modules.pop("readme_band", None)
        zoo_registry.registry().variants.pop("band_with_first", None)
        families._FAMILIES.pop("band_with_first", None)
        families._CODE_VARIANTS.pop("band_with_first", None)


def test_a_registry_built_anew_keeps_the_variant(one_file, monkeypatch):
    """A registry loaded after the registration (or anew) adds the families registered as
    variants, after the zoo's own file."""
    monkeypatch.setattr(zoo_registry, "_registry", None)
    assert NAME in zoo.list_variants()
    assert zoo.get_spec(NAME).description == "Keys within w of the query, and key 0."


def test_a_user_patterns_odd_defaults_and_values_run_on_auto_and_as_a_module():
    """Found by review: a family's ``field(default_factory=...)`` default showed as a sentinel
    among the variant's parameters, and it, or a NumPy int given as a parameter, failed only
    on auto (its table compares parameters as JSON); ``create_attention`` refused a Pattern
    that ``MultiHeadAttention`` takes; ``check_pattern`` checked a user's family that shares a
    mechanism's name instead of saying the name is a mechanism."""
    import dataclasses

    import numpy as np

    name = "offsets_band_with_a_factory"

    @dataclasses.dataclass(frozen=True)
    class OffsetsBand(zoo.Pattern):
        offsets: tuple = dataclasses.field(default_factory=lambda: (0, 2))

        def allowed(self, q_pos, kv_pos):
            return sum(((q_pos - kv_pos).abs() == o) for o in self.offsets).bool()

    try:
        zoo.register_pattern(name, description="Keys at the given offsets.")(OffsetsBand)
        assert zoo.get_spec(name).parameters() == {"offsets": (0, 2)}
        q = torch.randn(1, 2, 30, 8)
        want = zoo.attention(q, q, q, variant=name, backend="reference")
        torch.testing.assert_close(zoo.attention(q, q, q, variant=name), want)
        given = dict(variant=name, offsets=(np.int64(0), np.int64(3)))
        torch.testing.assert_close(
            zoo.attention(q, q, q, **given), zoo.attention(q, q, q, backend="reference", **given)
        )
        module = zoo.create_attention(OffsetsBand((0, 1)), dim=16, num_heads=2)
        assert module(torch.randn(1, 9, 16)).shape == (1, 9, 16)
        zoo.register_pattern("performer")(OffsetsBand)  # a family only: a building block
        with pytest.raises(ValueError, match="'performer' is a mechanism"):
            zoo.check_pattern("performer")
    finally:
        zoo_registry.registry().variants.pop(name, None)
        for family in (name, "performer"):
            families._FAMILIES.pop(family, None)
            families._CODE_VARIANTS.pop(family, None)
