"""A pattern's reach through depth (eval/harness/reach.py), held for every registry variant at a
few lengths to an independent composition: the pairs the model's own attention reads (its
weights, every head), followed as paths of at most ``depth`` steps position by position; and the
answers each task needs (eval/harness/needs.py) held to the tasks' layouts."""

from __future__ import annotations

import pytest
import torch

import eval.harness.reach as reach_module
import zoo
from eval.harness.needs import needs
from eval.harness.reach import (
    CONTENT,
    EXACT,
    GRAPH,
    Reach,
    compose,
    graph_mask,
    pattern_reach,
)
from eval.tasks import IGNORE, get_task

# Parameters small enough that every pattern is sparse at 16 to 64 tokens.
PARAMS = {
    "axial_2d": {},
    "bigbird": {"block_size": 4, "random_blocks": 1},
    "block_local": {"block_size": 4},
    "block_local_2d": {"window_size": 2},
    "causal": {},
    "dilated": {"window_size": 8, "dilation": 2},
    "full": {},
    "global": {"global_tokens": 1},
    "graph": {},
    "local": {"window_size": 3},
    "longformer": {"window_size": 2, "global_tokens": 1},
    "moba": {"block_size": 4, "top_k": 2},
    "neighborhood_2d": {"kernel_size": 3},
    "random": {"block_size": 4, "num_blocks": 1, "per_head": True},
    "sliding_window": {"window_size": 3},
    "strided": {"stride": 4, "window_size": 3},
}
GRIDDED = ("axial_2d", "block_local_2d", "neighborhood_2d")
HEADS = 2


def params_at(variant: str, n: int) -> dict:
    params = dict(PARAMS[variant])
    if variant in GRIDDED:
        side = int(n**0.5)
        params["grid"] = (side, side)
    return params


def read_pairs(variant: str, n: int, causal: bool, **inputs) -> torch.Tensor:
    """The (n, n) pairs one layer of the model's attention reads: nonzero weights in any head."""
    torch.manual_seed(0)
    attention = zoo.MultiHeadAttention(
        8, HEADS, variant=variant, causal=causal, backend="reference", **params_at(variant, n)
    )
    _, weights = attention(torch.randn(1, n, 8), return_weights=True, **inputs)
    return (weights[0] > 0).any(0)


def paths(one_layer: torch.Tensor, depth: int) -> torch.Tensor:
    """Where a chain of at most ``depth`` read pairs leads from each query, position by position
    (a position keeps its own information through the residual stream)."""
    n = one_layer.shape[0]
    reads = [set(one_layer[i].nonzero().flatten().tolist()) | {i} for i in range(n)]
    out = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        reached = {i}
        for _ in range(depth):
            reached = set().union(*(reads[m] for m in reached))
        out[i, sorted(reached)] = True
    return out


def test_every_registry_variant_has_parameters_here():
    assert set(zoo.list_variants()) <= set(PARAMS)


@pytest.mark.parametrize("variant", sorted(set(PARAMS) - {"graph", "moba"}))
@pytest.mark.parametrize("n", [16, 36, 64])
@pytest.mark.parametrize("causal", [False, True])
def test_reach_per_depth_is_the_mask_composed_depth_times(variant, n, causal):
    one_layer = read_pairs(variant, n, causal)
    if not PARAMS[variant].get("per_head") and variant != "bigbird":
        assert torch.equal(
            one_layer, zoo.dense_mask(variant, n, causal=causal, **params_at(variant, n))
        )
    for depth in (1, 2, 3):
        reach = pattern_reach(variant, params_at(variant, n), n, causal, depth, HEADS)
        assert reach.basis == EXACT
        assert torch.equal(reach.matrix(), paths(one_layer, depth)), (variant, n, causal, depth)


@pytest.mark.parametrize("causal", [False, True])
def test_a_graph_reaches_along_its_edges_per_sequence(causal):
    n = 16
    edges = torch.randint(0, n, (2, 24), generator=torch.Generator().manual_seed(1))
    one_layer = read_pairs("graph", n, causal, edge_index=edges)
    reach = pattern_reach("graph", {}, n, causal, 2, HEADS)
    assert reach.basis == GRAPH
    mask = graph_mask("graph", {}, n, causal, edges)
    assert torch.equal(mask, one_layer)
    assert torch.equal(reach.for_graph(mask), paths(one_layer, 2))


def test_a_pattern_chosen_by_content_reaches_what_it_may_choose():
    reach = pattern_reach("moba", PARAMS["moba"], 16, True, 2, HEADS)
    assert reach.basis == CONTENT
    assert torch.equal(reach.matrix(), torch.ones(16, 16).tril().bool())


def test_reach_by_hand_and_through_padding():
    # a causal window of the query and 3 keys before it: 3 x depth positions back
    for depth in (1, 2, 3):
        reach = pattern_reach("local", {"window_size": [3, 0]}, 32, True, depth, 1).matrix()
        assert reach[31].nonzero().min() == 31 - 3 * depth
    # one global token: two layers reach every pair, one does not
    assert not pattern_reach("global", {"global_tokens": 1}, 16, False, 1).matrix().all()
    assert pattern_reach("global", {"global_tokens": 1}, 16, False, 2).matrix().all()
    # a mask sparse enough is composed as a sparse matrix, to the same reach
    sparse = pattern_reach("local", {"window_size": 1}, 1024, False, 1).mask
    assert sparse.float().mean() < reach_module.SPARSE_SHARE
    assert torch.equal(compose(sparse, 3), paths(sparse, 3))
    # padding cuts paths: with a hub at the last position, two layers reach every pair of a
    # whole sequence, and nothing but itself from a sequence whose last position is padding
    hub = torch.zeros(10, 10, dtype=torch.bool)
    hub[:, 9] = hub[9, :] = True
    padded = Reach(EXACT, 2, hub)
    assert padded.matrix().all()
    assert torch.equal(padded.matrix(9), torch.eye(9, dtype=torch.bool))


TASKS = {
    "mqar": {"vocab_size": 32, "num_kv_pairs": 4},
    "induction": {},
    "passkey": {},
    "copy": {},
    "selective_copy": {"num_tokens": 8},
}


@pytest.mark.parametrize("name", sorted(TASKS))
def test_each_answer_needs_the_tokens_it_repeats(name):
    """The needed positions of every answer hold the token it answers (the value, the digit,
    the copied token), and the markers that find it."""
    task = get_task(name, seq_len=64, **TASKS[name])
    batch = task.sample(16, 3)
    wanted = needs(name, task, batch)
    scored = batch.targets != IGNORE
    assert wanted.query.numel() == int(scored.sum())
    answers = batch.targets[scored]
    for t in range(wanted.query.numel()):
        tokens = batch.inputs[wanted.example[t]]
        positions = wanted.needed[t].nonzero().flatten()
        assert answers[t] in tokens[positions], (name, t)
        assert wanted.needed[t, wanted.query[t]]


def test_a_pooled_answer_needs_every_real_token():
    task = get_task("listops", seq_len=64, min_length=10, max_length=60)
    batch = task.sample(8, 0)
    wanted = needs("listops", task, batch)
    assert (wanted.query == -1).all()
    assert torch.equal(wanted.needed, ~batch.padding_mask)


def test_pathfinder_answers_need_the_circles_components_and_their_surroundings():
    """Blank every pixel outside the needed ones: the task's own checker gives the same label."""
    from eval.tasks.pathfinder import BACKGROUND, solve

    task = get_task("pathfinder", seq_len=1024)
    batch = task.sample(6, 2)
    wanted = needs("pathfinder", task, batch)
    assert (wanted.query == -1).all() and not wanted.needed.all(1).any()
    for b in range(6):
        row = batch.inputs[b].clone()
        row[~wanted.needed[b]] = BACKGROUND
        assert solve(row.tolist(), task.size, task.gap) == int(batch.targets[b])


def test_graph_attention_reaches_the_hop_classes_within_its_depth():
    """A model with d layers of graph attention carries the source's mark d hops, no further; a
    variant that reads no graph reaches only the source itself."""
    from eval.harness.slices import slice_reach

    cell = {
        "task": "graph_hops", "task_params": {"max_hops": 3}, "causal": False,
        "variant_params": {}, "model": {"depth": 2, "heads": 1},
    }  # fmt: skip
    task = get_task("graph_hops", seq_len=32, max_hops=3)
    drawn = [(task, task.sample(8, 0))]
    hops = slice_reach({**cell, "variant": "graph"}, 32, drawn, {})["slices"]["hops"]
    assert all(inside == count for h, (inside, count) in hops.items() if int(h) <= 2)
    assert hops["3"][0] == 0  # 4: farther than 3 hops, reached where the component is small
    blind = slice_reach({**cell, "variant": "full"}, 32, drawn, {})["slices"]["hops"]
    assert blind["0"][0] == blind["0"][1] and all(v[0] == 0 for h, v in blind.items() if h != "0")


def test_an_mqar_answer_needs_its_pair_wherever_the_layout_puts_it():
    """The spread layout's pairs lie anywhere in the first half: each answer needs its own
    pair's key and value (``meta["pair_positions"]``), and its query."""
    task = get_task("mqar", seq_len=64, vocab_size=32, num_kv_pairs=4, kv_layout="spread")
    batch = task.sample(16, 3)
    wanted = needs("mqar", task, batch)
    pairs = batch.meta["pair_positions"]
    for t in range(wanted.query.numel()):
        b, q = int(wanted.example[t]), int(wanted.query[t])
        key = int(pairs[b][batch.inputs[b, pairs[b]] == batch.inputs[b, q]])
        assert wanted.needed[t].nonzero().flatten().tolist() == [key, key + 1, q]
