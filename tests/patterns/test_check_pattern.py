"""``zoo.check_pattern`` and ``zoo check``: a user's pattern is checked as the zoo's own are (issue
#12, item 3). A pattern whose block_state claims too much runs on the sparse backends and gives
wrong outputs with no error; the check names the first wrong block in words."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import types
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from helpers import FIXED_VARIANTS

import zoo
import zoo.patterns.families
from zoo.__main__ import main
from zoo.patterns import FULL, ChosenBlocks, Local, Moba, Pattern, Residue, Spans
from zoo.patterns.base import state_from

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Band(Pattern):
    """|i - j| <= w, with a correct block_state."""

    w: int = 8

    def allowed(self, q_pos, kv_pos):
        return (q_pos - kv_pos).abs() <= self.w

    def block_state(self, q: Spans, k: Spans):
        nearest, farthest = q.lo - k.hi, q.hi - k.lo
        some = (farthest >= -self.w) & (nearest <= self.w)
        every = (nearest >= -self.w) & (farthest <= self.w)
        return state_from(some, every, q, k)


@dataclass(frozen=True)
class EagerBand(Band):
    """Says FULL wherever some pair is allowed."""

    def block_state(self, q: Spans, k: Spans):
        some = (q.hi - k.lo >= -self.w) & (q.lo - k.hi <= self.w)
        return state_from(some, some, q, k)


@dataclass(frozen=True)
class NarrowBand(Band):
    """Says EMPTY for blocks off the diagonal, though the band crosses into them."""

    def block_state(self, q: Spans, k: Spans):
        same = q.lo == k.lo
        return state_from(same, torch.zeros_like(same), q, k)


@dataclass(frozen=True)
class FullWithPadding(Band):
    """Every pair allowed, but FULL even for blocks holding padding slots."""

    w: int = 10**6

    def block_state(self, q: Spans, k: Spans):
        return torch.full(torch.broadcast_shapes(q.lo.shape, k.lo.shape), FULL, dtype=torch.int8)


@dataclass(frozen=True)
class WrongDense(Band):
    def dense(self, q_len, kv_len):
        return torch.ones(q_len, kv_len, dtype=torch.bool).tril(kv_len - q_len)


@dataclass(frozen=True)
class CoarseResidue(Residue):
    """Right in the natural order, wrong in its own regrouped order (stride 4)."""

    def block_state(self, q: Spans, k: Spans):
        if q.step % self.stride:
            return super().block_state(q, k)
        same = q.lo == k.lo
        return state_from(same, same, q, k)


@dataclass(frozen=True)
class OverlappingParts(Band):
    def parts(self):
        return (Band(self.w), Local(1))


@dataclass(frozen=True)
class EvenKeys(Pattern):
    """Right in the natural order, wrong where a block's positions are 3 apart."""

    def allowed(self, q_pos, kv_pos):
        return (kv_pos % 2 == 0) | (q_pos < -(10**9))

    def block_state(self, q: Spans, k: Spans):
        even = k.lo % 2 == 0
        every = even & ((k.lo == k.hi) | (k.step > 1))  # a step of 3 mixes parities
        return state_from(even | (k.hi > k.lo), every, q, k)


def message(pattern, **kwargs) -> str:
    with pytest.raises(zoo.PatternCheckError) as error:
        zoo.check_pattern(pattern, **kwargs)
    return str(error.value)


@pytest.mark.parametrize("variant", FIXED_VARIANTS)
def test_every_registry_variant_passes(variant):
    # 2-D variants need grids that their default 7 x 7 kernel fits at n and 2n/3 (196: 14 x 14,
    # 130: 10 x 13); the default lengths have 37 = 1 x 37 and 66 = 6 x 11.
    grid = "grid" in zoo.get_spec(variant).parameters()
    lengths = (144, 196, 300, 600) if grid else zoo.testing.pattern_views.LENGTHS
    assert zoo.check_pattern(variant, lengths=lengths) == 16  # 4 lengths x 4 q/k length pairs


def test_a_pattern_chosen_by_content_is_checked_on_a_bound_input():
    """moba's views, bound to a seeded input, agree per sequence and head, causal and not."""
    assert zoo.check_pattern("moba", block_size=8, top_k=2, lengths=(37, 100)) == 8


@dataclass(frozen=True)
class _FullEverywhere(ChosenBlocks):
    def block_state(self, q: Spans, k: Spans):
        return torch.full(
            (*self.picks.shape[:2], *torch.broadcast_shapes(q.lo.shape, k.lo.shape)), FULL
        )


@dataclass(frozen=True)
class _LyingMoba(Moba):
    """moba whose bound block_state claims every block FULL."""

    def bind(self, inputs):
        chosen = super().bind(inputs)
        return _FullEverywhere(chosen.block_size, chosen.picks, chosen.blocks, chosen.offset)


def test_a_routed_block_state_that_claims_too_much_is_named():
    with pytest.raises(
        zoo.testing.pattern_views.PatternCheckError, match=r"block_state says FULL .* sequence"
    ):
        zoo.check_pattern(_LyingMoba(block_size=8, top_k=2), lengths=(37,))


def test_a_correct_user_pattern_passes_at_the_shapes_asked():
    assert zoo.check_pattern(Band(3)) == 16
    assert zoo.check_pattern(Band(3), lengths=[(5, 50), 20], block_sizes=[8, (4, 16)]) == 5
    union = Band(3) | Residue(5)  # two parts, each in its own token order
    assert zoo.check_pattern(union, lengths=[100, 300]) == 8


def test_a_full_claim_with_a_rejected_pair_names_the_block_and_the_pair():
    assert message(EagerBand(8), lengths=[100], block_sizes=[32]) == (
        "pattern EagerBand(w=8) disagrees with itself: block_state says FULL for query block 0 "
        "(positions 0..31) x key block 0 (positions 0..31) at q_len=100, kv_len=100, block 32, "
        "but allowed() rejects (q=0, k=9); a FULL block must have every pair allowed, and "
        "PARTIAL is always safe"
    )
    assert isinstance(zoo.PatternCheckError("x"), ValueError)


def test_an_empty_claim_with_an_allowed_pair_names_the_block_and_the_pair():
    text = message(NarrowBand(8), lengths=[100], block_sizes=[32])
    assert "block_state says EMPTY for query block 0 (positions 0..31) x key block 1 " in text
    assert "(positions 32..63) at q_len=100, kv_len=100, block 32" in text
    assert "but allowed() accepts (q=24, k=32)" in text


def test_lengths_cover_decoding_and_both_uneven_shapes():
    assert zoo.testing.pattern_views.shapes_of([100, (5, 7)]) == [
        (100, 100),
        (1, 100),
        (66, 100),
        (100, 66),
        (5, 7),
    ]
    assert "at q_len=1, kv_len=37" in message(CoarseResidue(4), lengths=[37], block_sizes=[16])


def test_a_full_block_with_padding_is_named():
    text = message(FullWithPadding(), lengths=[37], block_sizes=[16])
    assert "key block 2 (positions 32..36, 11 padding slots)" in text
    assert "the block holds padding slots" in text and "state_from" in text


def test_each_part_is_checked_in_its_own_token_order():
    text = message(CoarseResidue(4), lengths=[37], block_sizes=[16])
    assert "in the stride-4 token order" in text and "step 4" in text
    text = message(Band(2) | CoarseResidue(4), lengths=[37], block_sizes=[16])
    assert text.startswith("pattern Union(") and "part 2 of 2 (Difference(" in text


def test_a_stride_1_pattern_is_also_checked_in_the_order_a_composition_uses():
    text = message(EvenKeys(), lengths=[100], block_sizes=[16])
    assert text.startswith("pattern EvenKeys() disagrees with itself: block_state says FULL ")
    assert "in the stride-3 token order (where a union or intersection with a stride-3 " in text


def test_dense_mask_mod_and_parts_must_agree_with_allowed():
    assert "dense() rejects query 0 (position 0) x key 1 at q_len=37, kv_len=37" in message(
        WrongDense(3)
    )
    assert "parts() overlap at query 0 (position 0) x key 0" in message(OverlappingParts(3))

    @dataclass
    class Mutable(Pattern):
        w: int = 3

        def allowed(self, q_pos, kv_pos):
            return (q_pos - kv_pos).abs() <= self.w

    assert "is not hashable" in message(Mutable())

    @dataclass(frozen=True)
    class OnlyAllowed(Pattern):  # block states derived from allowed (zoo.patterns.derived)
        def allowed(self, q_pos, kv_pos):
            return kv_pos <= q_pos

    zoo.check_pattern(OnlyAllowed())


def test_the_check_catches_what_the_sparse_backend_gets_wrong():
    """The issue's case: the blocked backend skips the blocks called EMPTY, pairs and all."""
    q, k, v = torch.randn(3, 1, 2, 256, 16, generator=torch.Generator().manual_seed(0)).unbind(0)
    for pattern, wrong in [(Band(8), False), (NarrowBand(8), True)]:
        reference = zoo.attention(q, k, v, variant=pattern, backend="reference")
        blocked = zoo.attention(q, k, v, variant=pattern, backend="blocked")
        assert bool((blocked - reference).abs().max() > 0.1) == wrong
        if wrong:
            with pytest.raises(zoo.PatternCheckError):
                zoo.check_pattern(pattern)
        else:
            zoo.check_pattern(pattern)


def test_names_resolve_to_variants_families_and_factories(monkeypatch, tmp_path):
    assert zoo.check_pattern("local", window_size=5, lengths=[40]) == 4
    monkeypatch.setitem(zoo.patterns.families._FAMILIES, "eager_band", EagerBand)
    assert "pattern 'eager_band' (w=3) disagrees with itself" in message("eager_band", w=3)
    (tmp_path / "good_patterns.py").write_text(
        "from zoo.patterns import Local\n\ndef band(w=3):\n    return Local(w)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert zoo.check_pattern("good_patterns:band", w=4, lengths=[40]) == 4
    with pytest.raises(ValueError, match="did you mean 'local'"):
        zoo.check_pattern("loacl")
    # a family is a name it takes: a misspelt one was matched among the variants alone
    with pytest.raises(ValueError, match="family 'globl_blocks'; did you mean 'global_blocks'"):
        zoo.check_pattern("globl_blocks")
    with pytest.raises(ValueError, match="'performer' is a mechanism"):
        zoo.check_pattern("performer")
    with pytest.raises(TypeError, match="apply to a variant name"):
        zoo.check_pattern(Band(3), w=4)


def test_cli_exits_1_for_a_broken_family_and_0_for_a_good_one(monkeypatch, capsys):
    monkeypatch.setitem(zoo.patterns.families._FAMILIES, "eager_band", EagerBand)
    monkeypatch.setitem(zoo.patterns.families._FAMILIES, "good_band", Band)
    assert main(["check", "eager_band", "w=4", "--lengths", "50"]) == 1
    out, err = capsys.readouterr()
    assert not out and err.startswith(
        "zoo check: pattern 'eager_band' (w=4) disagrees with itself: "
    )
    assert "block_state says FULL for query block 0" in err
    assert main(["check", "good_band", "w=4", "--lengths", "50"]) == 0
    assert capsys.readouterr().out == "ok: good_band: three views agree at 4 shapes\n"
    assert main(["check", "no_such_band"]) == 2
    assert main(["check"]) == 2


def test_cli_checks_a_registry_file_with_module_factory_entries(tmp_path):
    (tmp_path / "my_patterns.py").write_text(
        textwrap.dedent(
            """
            from dataclasses import dataclass

            import zoo
            from zoo.patterns import Pattern
            from zoo.patterns.base import state_from


            @zoo.register_pattern("my_band")
            @dataclass(frozen=True)
            class MyBand(Pattern):
                window_size: int = 8

                def allowed(self, q_pos, kv_pos):
                    return (q_pos - kv_pos).abs() <= self.window_size

                def block_state(self, q, k):
                    w = self.window_size
                    some = (q.hi - k.lo >= -w) & (q.lo - k.hi <= w)
                    every = (q.lo - k.hi >= -w) & (q.hi - k.lo <= w)
                    return state_from(some, every, q, k)


            @dataclass(frozen=True)
            class EagerBand(MyBand):
                def block_state(self, q, k):
                    w = self.window_size
                    some = (q.hi - k.lo >= -w) & (q.lo - k.hi <= w)
                    return state_from(some, some, q, k)  # FULL wherever a pair is allowed


            def eager_band(window_size: int = 8):
                return EagerBand(window_size)
            """
        )
    )
    (tmp_path / "mine.yaml").write_text(
        textwrap.dedent(
            """
            variants:
              good_band: {pattern: "my_patterns:MyBand", description: d}
              eager_band: {pattern: "my_patterns:eager_band", description: d}
            """
        )
    )
    env = {
        **os.environ,
        "ZOO_REGISTRY": str(tmp_path / "mine.yaml"),
        "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)]),
    }

    def zoo_check(*argv):
        return subprocess.run(
            [sys.executable, "-m", "zoo", "check", *argv, "--lengths", "50,100"],
            capture_output=True,
            text=True,
            env=env,
            cwd=tmp_path,
        )

    done = zoo_check("--all")
    assert done.returncode == 1, done.stderr
    assert "ok: good_band: three views agree at 8 shapes" in done.stdout
    assert "ok: local: " in done.stdout and "eager_band" not in done.stdout
    assert "zoo check: pattern 'eager_band' disagrees with itself: block_state says FULL" in (
        done.stderr
    )
    done = zoo_check("good_band", "window_size=3")
    assert (done.returncode, done.stdout) == (0, "ok: good_band: three views agree at 8 shapes\n")
    done = zoo_check("my_band")  # the family its module registered with @zoo.register_pattern
    assert (done.returncode, done.stdout) == (0, "ok: my_band: three views agree at 8 shapes\n")


def test_the_docs_example_passes_and_its_quoted_error_is_what_a_broken_one_gives(monkeypatch):
    readme = (ROOT / "docs" / "extending.md").read_text()
    code = re.search(r"```python\n(# my_patterns.py\n.*?)```", readme, re.S).group(1)
    monkeypatch.setattr(zoo.patterns.families, "_FAMILIES", zoo.patterns.families._FAMILIES.copy())

    def load(source: str) -> types.ModuleType:
        module = types.ModuleType("readme_example")
        monkeypatch.setitem(sys.modules, module.__name__, module)
        exec(compile(source, "docs/extending.md", "exec", dont_inherit=True), module.__dict__)
        return module

    assert zoo.check_pattern(load(code).BandAndFirst(16)) == 16
    assert zoo.check_pattern("band_and_first", w=16) == 16
    line = "every = ((nearest >= -self.w) & (farthest <= self.w)) | (k.hi == 0)"
    broken = load(code.replace(line, "every = some").replace("@zoo.register_pattern", "# "))
    quoted = re.search(r"with\s+`(block_state says FULL .*?)`", readme, re.S).group(1)
    assert " ".join(quoted.split()) in message(broken.BandAndFirst(16))
