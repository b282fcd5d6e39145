"""The graph pattern: its mask against the edge list, its three views, every CPU backend against
the reference with key padding, causal or not; reverse Cuthill-McKee against brute force; the
caller's order restored exactly; errors."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from helpers import (
    assert_within_convention,
    naive_attention,
    outputs_and_grads,
    padding_mask,
    random_qkv,
)

import zoo
from eval.bench import graph_timing
from zoo.backends import BlockedBackend, FlexBackend
from zoo.layout.frames import build_frame
from zoo.patterns import EMPTY, FULL, Local, RouteInputs, graph
from zoo.patterns.node_order import bandwidth, block_density, cuthill_mckee, in_node_order

N = 40


def random_graph(n: int, seed: int, radius: float = 0.25) -> torch.Tensor:
    """A random geometric graph (points in the unit square, edges within ``radius``), its nodes
    shuffled, some edges one way only: (2, E)."""
    rng = np.random.default_rng(seed)
    points = rng.random((n, 2))
    near = np.linalg.norm(points[:, None] - points[None], axis=-1) < radius
    src, dst = np.nonzero(np.triu(near, 1))
    one_way = rng.random(src.size) < 0.3
    edges = np.concatenate([np.stack([src, dst]), np.stack([dst, src])[:, ~one_way]], axis=1)
    return torch.from_numpy(edges)


def expected_mask(edges, n, causal=False, self_loops=True, global_nodes=()):
    """The definition, pair by pair from the edge list."""
    mask = torch.zeros(n, n, dtype=torch.bool)
    for u, v in edges.t().tolist():
        mask[u, v] = True
    for i in range(n):
        mask[i, i] |= self_loops
        for g in global_nodes:
            mask[i, g] = mask[g, i] = True
    return mask.tril() if causal else mask


@pytest.mark.parametrize("causal", [False, True])
def test_mask_is_the_edge_list(causal):
    edges = random_graph(N, 0)
    mask = zoo.dense_mask("graph", N, edge_index=edges, causal=causal, global_nodes=[3])
    assert torch.equal(mask, expected_mask(edges, N, causal, global_nodes=(3,)))
    bare = zoo.dense_mask("graph", N, edge_index=edges, self_loops=False)
    assert torch.equal(bare, expected_mask(edges, N, self_loops=False))
    both = zoo.dense_mask("graph", N, edge_index=edges, undirected=True)
    assert torch.equal(both, expected_mask(torch.cat([edges, edges.flip(0)], 1), N))


def test_mask_of_a_graph_per_sequence_is_one_mask_per_graph():
    """``dense_mask`` takes every form ``attention`` takes for a graph per sequence (a list, a
    (B, 2, E) tensor, a sparse (B, L, L) adjacency): (B, L, L), each graph's own mask. It made
    a batch of one and refused them all (found by review)."""
    graphs = [random_graph(N, s) for s in (4, 5)]
    want = torch.stack([expected_mask(g, N) for g in graphs])
    cut = min(g.shape[1] for g in graphs)  # a (B, 2, E) tensor: as many edges each
    stacked = torch.stack([g[:, :cut] for g in graphs])
    indices = torch.cat([torch.cat([torch.full((1, g.shape[1]), b), g])
                         for b, g in enumerate(graphs)], 1)  # fmt: skip
    sparse = torch.sparse_coo_tensor(indices, torch.ones(indices.shape[1]), (2, N, N),
                                     check_invariants=True)  # fmt: skip
    assert torch.equal(zoo.dense_mask("graph", N, edge_index=graphs), want)
    assert torch.equal(zoo.dense_mask("graph", N, edge_index=sparse), want)
    assert torch.equal(
        zoo.dense_mask("graph", N, edge_index=stacked),
        torch.stack([expected_mask(g, N) for g in stacked]),
    )


@pytest.mark.parametrize("reordered", [False, True])
def test_three_views_agree(reordered):
    graphs = [random_graph(N, s) for s in (1, 2)]
    q = torch.zeros(2, 1, N, 1)
    layout = graph(global_nodes=(5,)).bind(RouteInputs(q, q, edge_index=graphs))
    if reordered:
        layout, _ = in_node_order(layout)
    dense = layout.dense(N, N)[:, 0]  # (2, N, N)
    b, i, j = torch.meshgrid(*(torch.arange(s) for s in dense.shape), indexing="ij")
    assert torch.equal(layout.allowed_at(b, 0, i, j), dense)
    for block in (8, 16):
        frame = build_frame(1, N, N, block, block, torch.device("cpu"))
        state = layout.block_state(frame.q.spans().column(), frame.k.spans().row())[:, 0]
        padded = torch.nn.functional.pad(dense, (0, frame.k.slots - N, 0, frame.q.slots - N))
        hits = padded.unflatten(1, (-1, block)).unflatten(3, (-1, block)).sum((2, 4))
        area = frame.q.valid.view(-1, block).sum(1)[:, None] * frame.k.valid.view(-1, block).sum(1)
        assert torch.equal(state == EMPTY, hits == 0)
        assert torch.equal(state == FULL, hits == area)


BACKENDS = {
    "blocked": BlockedBackend(block_size=8),
    "sdpa": "sdpa",
    "flex-eager": FlexBackend(block_size=16, compile=False),
}


@pytest.mark.parametrize("padded", [True, False], ids=["padded", "unpadded"])
@pytest.mark.parametrize("per_sequence", [False, True], ids=["shared", "per-sequence"])
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_backends_match_the_reference(backend, causal, per_sequence, padded):
    """Forward and backward (flex eager: forward), with key padding or without (then blocked
    reads a graph shared by the batch once for every sequence and head: ``Runs.shared``), with
    grouped-query heads, nodes in RCM order inside."""
    graphs = [random_graph(N, s) for s in range(3)]
    edge_index = graphs if per_sequence else graphs[0]
    params = dict(edge_index=edge_index, global_nodes=(2,))
    q, k, v = random_qkv(3, 4, N, N, v_dim=8, kv_heads=2)
    padding = padding_mask(3, N) if padded else torch.zeros(3, N, dtype=torch.bool)
    masks = [expected_mask(graphs[b if per_sequence else 0], N, causal, global_nodes=(2,))
             for b in range(3)]  # fmt: skip
    allowed = torch.stack(masks)[:, None] & ~padding[:, None, None, :]
    grad_out = torch.randn(3, 4, N, 8, generator=torch.Generator().manual_seed(1))

    def run(choice):
        def fn(q, k, v):
            mask = padding if padded else None
            return zoo.attention(q, k, v, variant="graph", backend=choice, causal=causal,
                                 key_padding_mask=mask, **params)  # fmt: skip

        return fn

    oracle = outputs_and_grads(
        run("reference"), [t.detach().double().requires_grad_() for t in (q, k, v)],
        grad_out.double(),
    )  # fmt: skip
    baseline = outputs_and_grads(lambda *t: naive_attention(*t, allowed), [q, k, v], grad_out)
    if backend.startswith("flex"):
        with torch.no_grad():
            got = [run(BACKENDS[backend])(q.detach(), k.detach(), v.detach())]
    else:
        got = outputs_and_grads(run(BACKENDS[backend]), [q, k, v], grad_out)
    assert_within_convention(got, baseline, oracle)


def test_outputs_return_in_the_callers_order_exactly():
    """Each node attending only itself outputs its own value, bit for bit, only if the slots
    come back to the right nodes; a real graph gives what the caller's order gives."""
    x = torch.randn(2, 2, N, 8)
    no_edges = torch.zeros(2, 0, dtype=torch.long)
    for backend in ("reference", BlockedBackend(block_size=8)):
        out = zoo.attention(x, x, x, variant="graph", edge_index=no_edges, backend=backend)
        assert torch.equal(out, x)
    edges = [random_graph(N, 7), random_graph(N, 8)]
    layout = graph().bind(RouteInputs(x, x, edge_index=edges))
    _, order = in_node_order(layout)
    assert not torch.equal(order.order, torch.arange(N).expand(2, N))  # nodes did move
    assert torch.equal(order.scatter(order.gather(x)), x)
    kw = dict(variant="graph", edge_index=edges, backend=BlockedBackend(block_size=8))
    moved, kept = zoo.attention(x, x, x, **kw), zoo.attention(x, x, x, reorder=False, **kw)
    torch.testing.assert_close(moved, kept, rtol=0, atol=1e-6)
    out, weights = zoo.attention(x, x, x, variant="graph", edge_index=edges, return_weights=True,
                                 backend="reference")  # fmt: skip
    assert torch.equal(weights > 0, torch.stack([expected_mask(e, N) for e in edges])[:, None]
                       .expand_as(weights))  # fmt: skip


def test_module_takes_the_graph():
    torch.manual_seed(0)
    module = zoo.MultiHeadAttention(16, 2, variant="graph")
    x, edges = torch.randn(2, N, 16), random_graph(N, 3)
    out = module(x, edge_index=edges)
    out.sum().backward()
    changed = x.clone()
    far = int(torch.nonzero(~expected_mask(edges, N)[0])[0])  # a node that node 0 does not see
    changed[:, far] += 1
    assert torch.equal(module(changed, edge_index=edges)[:, 0], out[:, 0].detach())


def brute_force_bandwidth(src, dst, n):
    return min(bandwidth(src, dst, order) for order in itertools.permutations(range(n)))


SMALL_GRAPHS = {
    "path": ([0, 1, 2, 3, 4, 5], [1, 2, 3, 4, 5, 6], 7),
    "cycle": ([0, 1, 2, 3, 4, 5], [1, 2, 3, 4, 5, 0], 6),
    "band-2": ([i for i in range(7) for j in (1, 2) if i + j < 7],
               [i + j for i in range(7) for j in (1, 2) if i + j < 7], 7),
    "grid-2x4": ([0, 1, 2, 4, 5, 6, 0, 1, 2, 3], [1, 2, 3, 5, 6, 7, 4, 5, 6, 7], 8),
}  # fmt: skip


@pytest.mark.parametrize("name", list(SMALL_GRAPHS))
def test_rcm_reaches_the_least_bandwidth_of_small_graphs(name):
    src, dst, n = SMALL_GRAPHS[name]
    shuffle = np.random.default_rng(0).permutation(n)
    src, dst = shuffle[np.asarray(src)], shuffle[np.asarray(dst)]
    order = cuthill_mckee(src, dst, n)
    assert sorted(order.tolist()) == list(range(n))
    assert bandwidth(src, dst, order) == brute_force_bandwidth(src, dst, n)


def test_rcm_recovers_shuffled_bands_in_every_component():
    """Two shuffled bands of width 3 and isolated nodes: a permutation of bandwidth <= 3."""
    rng = np.random.default_rng(1)
    band = [(i, i + j) for i in range(50) for j in (1, 2, 3) if i + j < 50]
    src = np.array([a for a, _ in band] + [a + 55 for a, _ in band])
    dst = np.array([b for _, b in band] + [b + 55 for _, b in band])
    shuffle = rng.permutation(110)
    src, dst = shuffle[src], shuffle[dst]
    order = cuthill_mckee(src, dst, 110)
    assert sorted(order.tolist()) == list(range(110))
    assert bandwidth(src, dst) > 30 and bandwidth(src, dst, order) <= 3


def test_reordering_lowers_block_density():
    edges = random_graph(512, 4, radius=0.06)
    layout = graph(self_loops=False).bind(RouteInputs(torch.zeros(1, 1, 512, 1), torch.zeros(
        1, 1, 512, 1), edge_index=edges))  # fmt: skip
    _, order = in_node_order(layout)
    before = block_density(edges[0], edges[1], 512, 64)
    after = block_density(edges[0], edges[1], 512, 64, order.order[0])
    assert after < 0.6 * before


def test_errors_name_the_value():
    x = torch.randn(2, 1, 6, 4)

    def call(**kw):
        return zoo.attention(x, x, x, variant="graph", **kw)

    with pytest.raises(ValueError, match="edge 1 names key node 6, but the sequence has 6 nodes"):
        call(edge_index=torch.tensor([[0, 1], [2, 6]]))
    with pytest.raises(ValueError, match=r"must have shape \(2, E\).*got \(3, 2\)"):
        call(edge_index=torch.zeros(3, 2, dtype=torch.long))
    with pytest.raises(TypeError, match=r"integer node indices, got dtype torch\.float32"):
        call(edge_index=torch.zeros(2, 2))
    with pytest.raises(ValueError, match="holds 3 graphs, but the batch has 2"):
        call(edge_index=[torch.zeros(2, 1, dtype=torch.long)] * 3)
    with pytest.raises(ValueError, match="global_nodes names node 9, but the sequence has 6"):
        call(edge_index=torch.zeros(2, 1, dtype=torch.long), global_nodes=[9])
    with pytest.raises(ValueError, match="needs the call's graph: pass edge_index"):
        call()
    with pytest.raises(ValueError, match="variant 'local' reads no graph"):
        zoo.attention(x, x, x, variant="local", edge_index=torch.zeros(2, 1, dtype=torch.long))


def test_graph_timing_rows_time_every_backend():
    """``python -m eval.bench.graph_timing``'s table on a tiny size: one row per family and
    pass, a positive time per backend."""
    lines = graph_timing.rows(sizes=(64,), batch=1, repeats=1)
    assert len(lines) == 2 * len(graph_timing.FAMILIES)
    for line in lines:
        cells = line.strip("| ").split(" | ")[-len(graph_timing.BACKENDS) :]
        assert all(float(cell) > 0 for cell in cells)


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_a_shared_graph_in_a_union_matches_the_reference(causal):
    """A graph shared by the batch, in a union with a band: blocked reads its runs once for
    every sequence and head (``Runs.shared``) and merges its softmax mass with the band's, so
    the backward takes the mass's gradient (``explicit_backward``); grouped-query heads, float64,
    equal to the reference forward and backward."""
    pattern = graph(global_nodes=(2,)) | Local(3)
    q, k, v = random_qkv(3, 4, N, N, v_dim=8, kv_heads=2, dtype=torch.float64)
    generator = torch.Generator().manual_seed(1)
    grad_out = torch.randn(3, 4, N, 8, dtype=torch.float64, generator=generator)
    edge_index = random_graph(N, 0)

    def run(backend):
        out = zoo.attention(
            q, k, v, variant=pattern, backend=backend, edge_index=edge_index, causal=causal
        )
        return [out, *torch.autograd.grad(out, (q, k, v), grad_out)]

    for got, want in zip(run(BlockedBackend(block_size=8)), run("reference"), strict=True):
        assert torch.allclose(got, want, atol=1e-12)


def test_global_nodes_as_one_int_through_the_registry():
    """``global_nodes=1`` through zoo.attention and the registry: tuple(1) raised a bare "'int'
    object is not iterable" before Graph could take the int; a string is refused by name."""
    q = torch.randn(1, 2, 6, 8)
    edges = torch.tensor([[0, 1, 2, 3, 4], [1, 2, 3, 4, 5]])
    one = zoo.attention(q, q, q, variant="graph", edge_index=edges, global_nodes=1)
    pair = zoo.attention(q, q, q, variant="graph", edge_index=edges, global_nodes=(1,))
    assert torch.equal(one, pair)
    with pytest.raises(TypeError, match="global_nodes must be a tuple of node indices, got '12'"):
        zoo.attention(q, q, q, variant="graph", edge_index=edges, global_nodes="12")
