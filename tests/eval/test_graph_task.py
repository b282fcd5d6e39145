"""The graph_hops task: labels against an independent breadth-first search, and its edges
reaching the graph variant's attention through the harness (and no other variant's)."""

from __future__ import annotations

import torch

from eval.harness.model import SequenceModel
from eval.tasks import get_task
from eval.tasks.graph_hops import FIRST_CLASS, SOURCE, solve


def test_labels_match_breadth_first_search():
    task = get_task("graph_hops", seq_len=48, max_hops=3)
    batch = task.sample(60, seed=5)
    for row, target, edges in zip(
        batch.inputs.tolist(), batch.targets.tolist(), batch.attention_inputs["edge_index"],
        strict=True,
    ):  # fmt: skip
        assert row.count(SOURCE) == 1
        assert solve(row, edges, task.max_hops) == target
    classes = batch.targets.flatten().bincount(minlength=task.vocab_size)[FIRST_CLASS:]
    assert (classes > 0).all()  # every hop class occurs: multi-hop answers are needed


def test_edges_reach_only_the_graph_variant():
    task = get_task("graph_hops", seq_len=24, max_hops=2)
    batch = task.sample(2, seed=0)
    common = dict(vocab_size=task.vocab_size, num_classes=task.num_classes, head="token",
                  dim=16, depth=1, heads=2, mlp_dim=0)  # fmt: skip
    torch.manual_seed(0)
    graph = SequenceModel(variant="graph", **common)
    torch.manual_seed(0)
    full = SequenceModel(variant="full", **common)
    kept = graph(batch.inputs, None, **batch.attention_inputs)
    assert torch.equal(full(batch.inputs, None, **batch.attention_inputs), full(batch.inputs))
    # One layer of graph attention: a node beyond the source's neighbours sees no SOURCE token.
    far = (batch.targets[0] > FIRST_CLASS + 1).nonzero()[0, 0]
    changed = batch.inputs.clone()
    changed[0, far] = SOURCE
    moved = graph(changed, None, **batch.attention_inputs)
    neighbours = batch.attention_inputs["edge_index"][0]
    unaffected = torch.ones(24, dtype=torch.bool)
    unaffected[far] = False
    unaffected[neighbours[0][neighbours[1] == far]] = False
    assert torch.equal(moved[0, unaffected], kept[0, unaffected])
