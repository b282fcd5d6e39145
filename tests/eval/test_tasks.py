"""Tests of the synthetic task generators in eval/tasks: contracts, labels and validation."""

from __future__ import annotations

import json

import pytest
import torch

from eval.tasks import TASKS, get_task, induction, list_tasks, listops, mqar, passkey, pathfinder
from eval.tasks import copy as copy_task
from eval.tasks import selective_copy as sel_copy
from eval.tasks.base import IGNORE, PAD, pow2_bucket, pow2_bucket_int

# Small but non-trivial configurations, so the whole file stays fast.
CONFIGS = {
    "mqar": dict(seq_len=128, num_kv_pairs=8, vocab_size=512),
    "listops": dict(seq_len=100, min_length=20, max_length=100),
    "selective_copy": dict(seq_len=96, num_tokens=8),
    "induction": dict(seq_len=64),
    "passkey": dict(seq_len=80, num_digits=5),
    "graph_hops": dict(seq_len=40, max_hops=3),
    "copy": dict(seq_len=41),
    "pathfinder": dict(seq_len=256, contour_length=5, distractor_length=2, num_distractors=4),
}


def make(name: str, **override):
    return get_task(name, **{**CONFIGS[name], **override})


def assert_batches_equal(a, b) -> None:
    assert a.slices.keys() == b.slices.keys()
    left = [a.inputs, a.targets, a.padding_mask, *a.slices.values()]
    right = [b.inputs, b.targets, b.padding_mask, *b.slices.values()]
    for x, y in zip(left, right, strict=True):
        assert (x is None and y is None) or torch.equal(x, y)


def test_registry_lists_every_task() -> None:
    assert list_tasks() == sorted(CONFIGS)
    assert set(TASKS) == set(CONFIGS)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_deterministic_and_seed_dependent(name: str) -> None:
    task = make(name)
    assert_batches_equal(task.sample(16, seed=3), task.sample(16, seed=3))
    assert_batches_equal(make(name).sample(16, seed=3), task.sample(16, seed=3))
    assert not torch.equal(task.sample(16, seed=3).inputs, task.sample(16, seed=4).inputs)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_batch_contract(name: str) -> None:
    task = make(name)
    n, L = 32, task.seq_len
    batch = task.sample(n, seed=0)
    assert batch.inputs.shape == (n, L) and batch.inputs.dtype == torch.int64
    want = (n, L) if task.head == "token" else (n,)
    assert task.head in ("token", "sequence")
    assert batch.targets.shape == want and batch.targets.dtype == torch.int64
    assert batch.inputs.min() >= 0 and batch.inputs.max() < task.vocab_size
    if batch.padding_mask is None:
        assert (batch.inputs != PAD).all()
    else:
        assert batch.padding_mask.shape == (n, L) and batch.padding_mask.dtype == torch.bool
        assert torch.equal(batch.padding_mask, batch.inputs == PAD)
    scored = batch.targets != IGNORE
    assert scored.reshape(n, -1).any(dim=1).all(), "every sequence needs a scored target"
    assert batch.targets[scored].min() >= 0 and batch.targets[scored].max() < task.num_classes
    if task.head == "token" and batch.padding_mask is not None:
        assert not (scored & batch.padding_mask).any()
    assert batch.slices
    for key, value in batch.slices.items():
        assert value.shape == batch.targets.shape and value.dtype == torch.int64, key
    record = task.describe()
    assert record["task"] == name and record["seq_len"] == L
    json.dumps(record)  # result records must be serialisable


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_vocab_independent_of_seq_len(name: str) -> None:
    factor = 4 if name == "pathfinder" else 3  # an image: 16 x 16 -> 32 x 32
    short, long = make(name), make(name, seq_len=CONFIGS[name]["seq_len"] * factor)
    assert (short.vocab_size, short.num_classes) == (long.vocab_size, long.num_classes)
    batch = long.sample(4, seed=1)
    assert batch.inputs.max() < short.vocab_size


# Each checker recomputes the labels from the tokens alone, differently from the generator.
CHECKERS = {
    "mqar": lambda task, row: mqar.solve(row, task.num_kv_pairs),
    "listops": lambda task, row: listops.solve(row),
    "selective_copy": lambda task, row: sel_copy.solve(row),
    "induction": lambda task, row: induction.solve(row),
    "passkey": lambda task, row: passkey.solve(row, task.num_digits),
    "copy": lambda task, row: copy_task.solve(row),
    "pathfinder": lambda task, row: pathfinder.solve(row, task.size, task.gap),
}


@pytest.mark.parametrize("name", sorted(CHECKERS))  # graph_hops: tests/eval/test_graph_task.py
def test_labels_match_independent_checker(name: str) -> None:
    task = make(name)
    batch = task.sample(200, seed=11)
    for row, target in zip(batch.inputs.tolist(), batch.targets.tolist(), strict=True):
        assert CHECKERS[name](task, row) == target


def test_slices_match_recomputed_keys() -> None:
    task = make("mqar")
    b = task.sample(50, seed=2)
    rows = zip(b.inputs.tolist(), b.targets.tolist(), b.slices["gap"].tolist(), strict=True)
    for row, tgt, gap in rows:
        for pos, t in enumerate(tgt):
            if t != IGNORE:
                assert gap[pos] == pow2_bucket_int(pos - row.index(row[pos]))
    b = make("induction").sample(50, seed=2)
    for row, dist in zip(b.inputs.tolist(), b.slices["distance"].tolist(), strict=True):
        assert dist[-1] == pow2_bucket_int(len(row) - 1 - row.index(induction.SPECIAL))
    task = make("passkey")
    b = task.sample(50, seed=2)
    starts = task.seq_len - 2 * task.num_digits - 1
    for row, depth in zip(b.inputs.tolist(), b.slices["depth"].tolist(), strict=True):
        assert depth[-1] == int(10 * row.index(passkey.KEY) / starts)
    assert set(b.slices["depth"][:, -1].tolist()) <= set(range(10))
    b = make("listops").sample(50, seed=2)
    for row, depth in zip(b.inputs.tolist(), b.slices["depth"].tolist(), strict=True):
        assert depth == listops.depth_of(row)
    index = make("copy").sample(2, seed=2).slices["index"][:, -20:]
    assert index.tolist() == [[pow2_bucket_int(i) for i in range(20)]] * 2


def test_pow2_bucket() -> None:
    x = torch.arange(0, 5000)
    assert pow2_bucket(x).tolist() == [pow2_bucket_int(v) for v in range(5000)]
    assert pow2_bucket(torch.tensor([1, 2, 3, 4, 1024, 1025])).tolist() == [1, 2, 2, 4, 1024, 1024]


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("[MED 1 2 3 4 ]", 2),
        ("[SM 9 9 ]", 8),
        ("[MIN 3 [MAX 1 7 ] 5 ]", 3),
        ("[MED 5 1 9 ]", 5),
        ("[MAX 2 [SM 5 6 ] [MED 0 9 ] ]", 4),
        ("7", 7),
    ],
)
def test_listops_hand_worked(text: str, value: int) -> None:
    assert listops.solve(listops.encode(text)) == value


def test_listops_generator_operators() -> None:
    assert listops._apply(listops.MED, [1, 2, 3, 4]) == 2
    assert listops._apply(listops.MED, [0, 9]) == 4
    assert listops._apply(listops.SM, [9, 9]) == 8
    assert listops._apply(listops.MIN, [4, 2, 8]) == 2
    assert listops._apply(listops.MAX, [4, 2, 8]) == 8


def test_listops_lengths_and_padding() -> None:
    task = make("listops", seq_len=120, min_length=30, max_length=80)
    b = task.sample(300, seed=5)
    lengths = b.meta["lengths"]
    assert (lengths > 30).all() and (lengths < 80).all()
    assert torch.equal((~b.padding_mask).sum(dim=1), lengths)
    assert len({tuple(row) for row in b.inputs.tolist()}) == 300, "duplicates must be dropped"
    assert torch.equal(b.slices["length"], pow2_bucket(lengths))
    assert (b.slices["depth"] >= 1).all() and (b.slices["depth"] <= 9).all()


def test_mqar_structure() -> None:
    task = get_task("mqar", seq_len=256, num_kv_pairs=16, vocab_size=1024)
    b = task.sample(200, seed=7)
    kv, V = 16, 1024
    keys, values = b.inputs[:, 0 : 2 * kv : 2], b.inputs[:, 1 : 2 * kv : 2]
    assert (keys >= 1).all() and (keys < V // 2).all()
    assert (values >= V // 2).all() and (values < V).all()
    assert all(len(set(row)) == kv for row in keys.tolist()), "keys must be distinct"
    query = b.inputs[:, 2 * kv :]
    is_key = (query.unsqueeze(2) == keys.unsqueeze(1)).any(dim=2)
    assert torch.equal(is_key, b.targets[:, 2 * kv :] != IGNORE), "targets only at queries"
    assert (is_key.sum(dim=1) == kv).all(), "each key is queried exactly once"
    assert (b.targets[:, : 2 * kv] == IGNORE).all()
    assert (b.slices["num_kv_pairs"] == kv).all()


def gap_index_histogram(power_a: float) -> torch.Tensor:
    task = get_task("mqar", seq_len=256, num_kv_pairs=8, power_a=power_a)
    b = task.sample(1000, seed=9)
    ctx = 2 * task.num_kv_pairs
    pos = (b.targets[:, ctx:] != IGNORE).nonzero()[:, 1]
    return torch.bincount(pos // 2, minlength=(256 - ctx) // 2)


def test_mqar_gaps_follow_power_law() -> None:
    hist = gap_index_histogram(0.01)
    assert hist[:10].sum() > 5 * hist[-10:].sum()
    assert hist[:40].sum() > hist[40:80].sum() > hist[80:].sum() * 0.5
    # The uniform setting (a = 1) must not show the skew, or the test above proves nothing.
    flat = gap_index_histogram(1.0)
    assert flat[:10].sum() < 2 * flat[-10:].sum()


@pytest.mark.parametrize(
    ("name", "params", "words"),
    [
        ("mqar", dict(seq_len=16, num_kv_pairs=8), ["seq_len=16", "num_kv_pairs=8"]),
        ("mqar", dict(seq_len=64, num_kv_pairs=9, vocab_size=16), ["num_kv_pairs=9"]),
        ("mqar", dict(seq_len=64, power_a=0), ["power_a", "0"]),
        ("listops", dict(seq_len=1024), ["seq_len=1024", "max_length=2000"]),
        ("listops", dict(seq_len=100, max_args=1), ["max_args", "1"]),
        ("listops", dict(seq_len=100, min_length=50, max_length=51), ["max_length=51"]),
        ("selective_copy", dict(seq_len=10, num_tokens=6), ["seq_len=10", "num_tokens=6"]),
        ("selective_copy", dict(seq_len=10, num_tokens=-2), ["num_tokens", "-2"]),
        ("induction", dict(seq_len=2), ["seq_len=2"]),
        ("induction", dict(seq_len=10, vocab_size=2), ["vocab_size", "2"]),
        ("passkey", dict(seq_len=11, num_digits=5), ["seq_len=11", "num_digits=5"]),
        ("passkey", dict(seq_len=100, num_digits=0), ["num_digits", "0"]),
        ("copy", dict(seq_len=10, num_tokens=5), ["seq_len=10", "num_tokens=5"]),
        ("copy", dict(seq_len=10, num_tokens=2.5), ["num_tokens", "2.5"]),
        ("copy", dict(seq_len=0), ["seq_len", "0"]),
    ],
)
def test_bad_parameters_are_named(name: str, params: dict, words: list[str]) -> None:
    with pytest.raises(ValueError) as err:
        get_task(name, **params)
    for word in words:
        assert word in str(err.value)


def test_unknown_names_suggest_close_matches() -> None:
    with pytest.raises(ValueError, match=r"unknown task 'mqr'; did you mean 'mqar'\?"):
        get_task("mqr", seq_len=64)
    with pytest.raises(ValueError, match="did you mean 'num_kv_pairs'"):
        get_task("mqar", seq_len=64, num_kv=4)
    with pytest.raises(ValueError, match="seq_len"):
        get_task("copy")


def test_bad_sample_arguments() -> None:
    task = make("copy")
    with pytest.raises(ValueError, match="n must be positive, got 0"):
        task.sample(0, seed=1)
    with pytest.raises(ValueError, match="seed must be at least 0, got -1"):
        task.sample(4, seed=-1)


@pytest.mark.parametrize(("name", "module"), [("copy", copy_task), ("selective_copy", sel_copy)])
def test_fed_answers_hold_the_previous_answer(name, module) -> None:
    """The autoregressive layout: same targets as the fixed one; slot i holds answer i - 1."""
    fixed, fed = make(name).sample(50, seed=5), make(name, feed_answers=True).sample(50, seed=5)
    assert torch.equal(fixed.targets, fed.targets)
    scored = fed.targets != IGNORE
    assert torch.equal(fixed.inputs[~scored], fed.inputs[~scored]), "the prompt is unchanged"
    first = int(scored[0].nonzero()[0])
    assert torch.equal(fed.inputs[:, first + 1 :], fed.targets[:, first:-1])
    assert torch.equal(fed.inputs[:, first], fixed.inputs[:, first])  # the start token
    for row, target in zip(fed.inputs.tolist(), fed.targets.tolist(), strict=True):
        assert module.solve(row, feed_answers=True) == target
    with pytest.raises(ValueError, match="feed_answers must be true or false, got 'yes'"):
        make(name, feed_answers="yes")


def chi_square(observed: torch.Tensor, expected: torch.Tensor) -> float:
    return float(((observed - expected) ** 2 / expected).sum())


def chi_square_bound(df: int) -> float:
    """Far above the 99.9th percentile of a chi-square with ``df`` degrees of freedom (mean df,
    variance 2 df): a correct generator never fails it at the fixed seeds used here, and a wrong
    law overshoots it by orders of magnitude."""
    return df + 8 * (2 * df) ** 0.5


@pytest.mark.parametrize("power_a", [0.01, 0.5, 1.0])
def test_mqar_gap_index_follows_its_law_exactly(power_a: float) -> None:
    """With one pair the gap index g (1..S) is drawn with probability a * g**(a - 1), normalised:
    the definition itself, checked by a chi-square test over every index."""
    task = get_task("mqar", seq_len=64, num_kv_pairs=1, power_a=power_a)
    b = task.sample(20000, seed=3)
    index = (b.targets[:, 2:] != IGNORE).nonzero()[:, 1] // 2  # zero-based g - 1
    slots = (64 - 2) // 2
    observed = torch.bincount(index, minlength=slots).double()
    g = torch.arange(1, slots + 1, dtype=torch.float64)
    law = power_a * g ** (power_a - 1)
    expected = law / law.sum() * len(index)
    assert chi_square(observed, expected) < chi_square_bound(slots - 1)
    if power_a != 1.0:  # the uniform law would pass a power law's test only by accident
        uniform = torch.full_like(expected, len(index) / slots)
        assert chi_square(observed, uniform) > 10 * chi_square_bound(slots - 1)


def test_mqar_gaps_without_replacement_match_sequential_draws() -> None:
    """With several pairs, the gap indices are drawn one by one without replacement in Zoology's
    rule; torch.multinomial(replacement=False) draws exactly so, independently of the generator's
    Gumbel-top-k: the two give the same distribution of indices (two-sample chi-square)."""
    kv, seq_len, power_a, n = 4, 64, 0.01, 5000
    task = get_task("mqar", seq_len=seq_len, num_kv_pairs=kv, power_a=power_a)
    b = task.sample(n, seed=5)
    ours = (b.targets[:, 2 * kv :] != IGNORE).nonzero()[:, 1] // 2
    slots = (seq_len - 2 * kv) // 2
    g = torch.arange(1, slots + 1, dtype=torch.float64)
    weights = (power_a * g ** (power_a - 1)).expand(n, slots)
    generator = torch.Generator().manual_seed(11)
    theirs = torch.multinomial(weights, kv, replacement=False, generator=generator).flatten()
    a = torch.bincount(ours, minlength=slots).double()
    c = torch.bincount(theirs, minlength=slots).double()
    statistic = float(((a - c) ** 2 / (a + c).clamp_min(1)).sum())
    assert statistic < chi_square_bound(slots - 1)


def test_induction_distance_is_uniform_over_its_range() -> None:
    """The first special token sits uniformly in [0, L - 3], so the distance to the query,
    (L - 1) - p, is uniform over 2..L-1."""
    length = 40
    b = get_task("induction", seq_len=length).sample(20000, seed=4)
    distance = b.meta["distance"]
    assert int(distance.min()) == 2 and int(distance.max()) == length - 1
    observed = torch.bincount(distance - 2, minlength=length - 2).double()
    expected = torch.full_like(observed, len(distance) / (length - 2))
    assert chi_square(observed, expected) < chi_square_bound(length - 3)


def test_mamba_tasks_draw_from_the_papers_alphabets_by_default() -> None:
    """Selective copying: A = 16 tokens, blank, marker and 14 data symbols; induction heads: a
    vocabulary of 16, the special token and 15 ordinary ones (PAD, never emitted, aside)."""
    copying = get_task("selective_copy", seq_len=512, num_tokens=16)
    batch = copying.sample(400, seed=0)
    data = batch.inputs[batch.inputs >= sel_copy.FIRST_DATA]
    assert set(data.unique().tolist()) == set(range(3, 17))
    assert set(batch.inputs.unique().tolist()) == {sel_copy.BLANK, sel_copy.MARKER, *range(3, 17)}
    heads = get_task("induction", seq_len=256)
    tokens = heads.sample(200, seed=0).inputs
    assert set(tokens.unique().tolist()) == {induction.SPECIAL, *range(2, 17)}
    assert copying.num_classes == heads.num_classes == 17


def test_mqar_spread_layout_scatters_the_pairs_over_the_first_half() -> None:
    """kv_layout="spread": each pair at an even position of the first half, no two alike, the
    queries in the second half; the labels match the checker given the pairs' positions, and
    the gap slice is the distance from the pair's key to its query."""
    task = get_task("mqar", seq_len=128, num_kv_pairs=6, vocab_size=64, kv_layout="spread")
    assert task.params["kv_layout"] == "spread"
    assert "kv_layout" not in get_task("mqar", seq_len=128, num_kv_pairs=6).params  # as before
    batch = task.sample(300, seed=4)
    pairs = batch.meta["pair_positions"]
    assert pairs.shape == (300, 6) and (pairs % 2 == 0).all() and (pairs < 64).all()
    assert (pairs.sort(1).values.diff(dim=1) > 0).all()  # distinct slots
    assert len(set(pairs[:, 0].tolist())) > 20  # spread, not fixed
    query = (batch.targets != IGNORE).nonzero()
    assert (query[:, 1] >= 64).all() and len(query) == 300 * 6
    rows = zip(batch.inputs.tolist(), batch.targets.tolist(), pairs.tolist(), strict=True)
    for (row, target, at), gap in zip(rows, batch.slices["gap"].tolist(), strict=True):
        assert mqar.solve(row, 6, at) == target
        for pos, t in enumerate(target):
            if t != IGNORE:
                assert gap[pos] == pow2_bucket_int(pos - row.index(row[pos]))
    with pytest.raises(ValueError, match="kv_layout must be one of"):
        get_task("mqar", seq_len=128, kv_layout="middle")
