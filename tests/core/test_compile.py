"""``torch.compile(fullgraph=True)`` of models built from zoo modules: no graph break for any
variant but graph (its layout comes from the call's edges), compiled equals eager, and one
graph per sequence length (``zoo.core.shape_cache``).

Graph breaks are a dynamo matter, so most tests compile with a counting backend that skips
Inductor (``CompileCounter``, or "aot_eager" where the backward graph is traced too); Inductor
compiles only the few models whose compiled numbers are compared with eager ones.
"""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest
import torch
from helpers import SELF_CONTAINED_VARIANTS, small_params, subprocess_timeout
from torch._dynamo.testing import CompileCounter, CompileCounterWithBackend

import zoo
from zoo.backends import FlexBackend

DIM, HEADS, LENGTH = 32, 2, 64
# Where auto takes blocked on CPU: from 1024 keys (zoo.backends.auto).
LONG = 1024


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def eager_side(backend: str) -> str | FlexBackend:
    """The backend a model is built with where its compiled form is compared with it: flex's
    eager path for flex (inside a compiled model flex is traced either way, and the eager side's
    own compiled kernel would cost an Inductor compile per shape: 5-10 s on a CPU, cold). Such a
    model under Inductor once failed on a CPU at a length that is not a whole number of blocks
    (``FlexBackend.whole_blocks``)."""
    return FlexBackend(compile=False) if backend == "flex" else backend


def layer(variant: str, backend: str | FlexBackend, **options: object) -> zoo.MultiHeadAttention:
    torch.manual_seed(0)
    return zoo.MultiHeadAttention(
        DIM, HEADS, variant=variant, backend=backend, **small_params(variant), **options
    )


def graphs_of(model: torch.nn.Module, *inputs: torch.Tensor, train: bool) -> int:
    """How many graphs dynamo makes of one call, under fullgraph=True (a graph break raises)."""
    counter = CompileCounter()
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    with torch.set_grad_enabled(train):
        compiled(*inputs)
    return counter.frame_count


def inputs(length: int = LENGTH, train: bool = False) -> torch.Tensor:
    return torch.randn(2, length, DIM, requires_grad=train)


# The flex kernel has no backward on CPU, so flex runs inference here (the GPU campaign trains).
# auto resolves to one of the others, so it runs on a few variants only (the suite's budget).
PASSES = [("sdpa", True), ("flex", False), ("blocked", True)]
AUTO_VARIANTS = ["local", "bigbird", "strided", "neighborhood_2d"]


@pytest.mark.parametrize("variant", SELF_CONTAINED_VARIANTS)
def test_no_graph_break_on_flex(variant):
    """Flex in inference; sdpa, blocked and auto are traced for training, forward and backward, in
    one graph by test_compiled_gradients_equal_eager and _on, which count their graphs."""
    assert graphs_of(layer(variant, "flex"), inputs(), train=False) == 1


@pytest.mark.parametrize("variant", ["local", "sliding_window", "strided"])
def test_no_graph_break_where_auto_takes_blocked(variant):
    q = torch.randn(2, HEADS, LONG, DIM // HEADS, requires_grad=True)
    assert zoo.explain(q, q, q, variant=variant, **small_params(variant)).startswith(
        "auto -> blocked"
    )
    assert graphs_of(layer(variant, "auto"), inputs(LONG, train=True), train=True) == 1


@pytest.mark.parametrize("backend", ["sdpa", "flex", "blocked"])
def test_no_graph_break_with_padding_and_positions(backend):
    model = layer("bigbird", backend, pos="alibi")
    padding = torch.zeros(2, LENGTH, dtype=torch.bool)
    padding[1, -20:] = True
    assert graphs_of(model, inputs(), None, padding, train=False) == 1


def test_no_graph_break_with_valid_lens_or_an_encoding_by_name():
    """valid_lens skips its data-dependent range check inside a graph; an encoding named in the
    functional call is built outside it, like the per-shape structures."""
    valid_lens = torch.tensor([LENGTH, LENGTH - 20])
    assert graphs_of(layer("local", "sdpa"), inputs(), None, None, valid_lens, train=True) == 1

    class Functional(torch.nn.Module):
        def forward(self, q):
            return zoo.attention(
                q, q, q, variant="local", backend="sdpa", pos="alibi", window_size=4
            )

    q = torch.randn(1, HEADS, LENGTH, DIM // HEADS)
    assert graphs_of(Functional(), q, train=False) == 1


def eager_and_compiled(model, x, compiled, *, train: bool):
    results = []
    for run in (model, compiled):
        model.zero_grad()
        x.grad = None
        with torch.set_grad_enabled(train):
            out = run(x)
            if train:
                out.square().sum().backward()
        grads = [x.grad] + [p.grad for p in model.parameters()] if train else []
        results.append([out.detach(), *grads])
    return results


@pytest.mark.parametrize("variant", SELF_CONTAINED_VARIANTS)
def test_compiled_gradients_equal_eager(variant):
    """Every variant on blocked (auto's sparse choice on CPU), through AOTAutograd's joint graph,
    in one graph (no graph break): the structures built outside the graph are the ones eager
    uses."""
    check_joint_graph(layer(variant, "blocked"))


def check_joint_graph(model: torch.nn.Module) -> None:
    """A training step of ``model`` compiled whole (fullgraph=True: a graph break raises) into one
    graph with its backward by AOTAutograd: outputs and gradients equal eager's."""
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    eager, traced = eager_and_compiled(model, inputs(train=True), compiled, train=True)
    for a, b in zip(eager, traced, strict=True):
        torch.testing.assert_close(b, a)
    assert counter.frame_count == 1


def test_no_recompilation_across_training_steps():
    model = layer("bigbird", "auto")
    counter = CompileCounter()
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        optimizer.zero_grad()
        compiled(inputs(train=True)).square().mean().backward()
        optimizer.step()
    assert counter.frame_count == 1


@pytest.mark.parametrize("dynamic", [None, True])
@pytest.mark.parametrize(("variant", "backend"), [("full", "auto"), ("bigbird", "auto"),
                                                  ("local", "blocked")])  # fmt: skip
def test_one_graph_per_length(variant, backend, dynamic):
    """The policy (zoo.attention): lengths are static, one graph per length seen, whether or not
    dynamo was asked for dynamic shapes; a length seen before reuses its graph. Blocked failed
    under dynamic=True: dynamo read its float ``waste`` as a symbolic float, which no per-shape
    builder can take."""
    model = layer(variant, backend)
    counter = CompileCounter()
    compiled = torch.compile(model, backend=counter, fullgraph=True, dynamic=dynamic)
    for length in (64, 80, 64, 96, 80):
        compiled(inputs(length))
    assert counter.frame_count == 3


@pytest.mark.parametrize("dynamic", [None, True])
def test_a_scale_argument_takes_new_values_in_one_graph_each(dynamic):
    """A float scale given to the compiled function: from its second value (dynamic=None) or its
    first (True) dynamo makes it symbolic, and the check of the scale broke the graph
    (math.isfinite); now one graph per value under fullgraph, equal to eager."""

    def attend(q, scale):
        return zoo.attention(q, q, q, variant="local", window_size=4, scale=scale)

    counter = CompileCounter()
    compiled = torch.compile(attend, backend=counter, fullgraph=True, dynamic=dynamic)
    q = torch.randn(1, 2, 32, 8)
    for scale in (0.3, 0.5):
        torch.testing.assert_close(compiled(q, scale), attend(q, scale), rtol=0, atol=0)
    assert counter.frame_count <= 2


def test_graph_says_why_fullgraph_cannot_hold_it_and_compiles_with_breaks():
    """variant='graph' builds its layout from the call's edge_index (data): under fullgraph it
    failed on a data-dependent guard deep in its edge checks; now a sentence says why, and
    compiled with graph breaks it equals eager."""
    q = torch.randn(1, 2, 10, 8)
    edges = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 1], [0, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9]])

    def attend(q, edges):
        return zoo.attention(q, q, q, variant="graph", edge_index=edges)

    with pytest.raises(Exception, match="variant 'graph' builds its layout from the call's edge"):
        torch.compile(attend, backend="eager", fullgraph=True)(q, edges)
    torch.testing.assert_close(torch.compile(attend, backend="eager")(q, edges), attend(q, edges))


def test_inductor_survives_a_length_change():
    """A compiled training run on blocked (Inductor once failed here: `vr must not be None`) and
    flex under dynamic=True (once `Source of ... is None`)."""
    blocked = torch.compile(layer("local", "blocked"))
    flex = torch.compile(layer("local", "flex"), dynamic=True)
    for length in (64, 48):
        blocked(inputs(length, train=True)).sum().backward()
        with torch.no_grad():
            out = flex(inputs(length))
        assert out.shape == (2, length, DIM) and torch.isfinite(out).all()


# Each (variant, backend) compiled by Inductor costs 5-20 s on a CPU with a cold cache: CI compiles
# a sample that covers every backend, blocked's regrouped order (dilated) and flex's 2-D tiled
# order (neighborhood_2d; tests/patterns/test_grid.py compiles it too), ZOO_SLOW=1 the whole
# matrix. Every variant on blocked goes through AOTAutograd in test_compiled_gradients_equal_eager,
# but Inductor compiles blocked's per-head layouts (bigbird) only in the whole matrix.
INDUCTOR_BACKENDS = [("sdpa", True), ("blocked", True), ("auto", True), ("flex", False)]
INDUCTOR_SAMPLE = {
    ("dilated", "blocked"), ("strided", "sdpa"), ("local", "flex"),
    ("longformer", "sdpa"), ("strided", "auto"),
    ("neighborhood_2d", "flex"),
}  # fmt: skip
# Inductor's CPU flex template cannot take a mask_mod whose captured tensors the graph computes
# (moba's chosen blocks): NotImplementedError('Pointwise') in CppFlexAttentionTemplate, then
# NoValidChoicesError (torch 2.13). Eager, aot_eager and the flex backend's own compiled kernel
# run it; the GPU campaign compiles it on CUDA.
INDUCTOR_KNOWN = {("moba", "flex"): "Inductor's CPU flex template rejects moba's mask_mod buffers"}
INDUCTOR_MATRIX = [
    pytest.param(
        variant,
        backend,
        train,
        marks=[
            *(() if (variant, backend) in INDUCTOR_SAMPLE else (pytest.mark.slow,)),
            *(
                (pytest.mark.xfail(strict=True, reason=INDUCTOR_KNOWN[variant, backend]),)
                if (variant, backend) in INDUCTOR_KNOWN
                else ()
            ),
        ],
    )
    for variant in SELF_CONTAINED_VARIANTS
    for backend, train in INDUCTOR_BACKENDS
]


@pytest.mark.parametrize(("variant", "backend", "train"), INDUCTOR_MATRIX)
def test_inductor_equals_eager_for_every_variant(variant, backend, train):
    model = layer(variant, eager_side(backend))
    compiled = torch.compile(model, fullgraph=True)
    eager, fused = eager_and_compiled(model, inputs(train=train), compiled, train=train)
    for a, b in zip(eager, fused, strict=True):
        torch.testing.assert_close(b, a, atol=2e-5, rtol=1e-4)


# auto takes sdpa for every variant at LENGTH on a CPU, so auto's own cases are a sample.
@pytest.mark.parametrize(
    ("variant", "backend"),
    [*((v, "sdpa") for v in SELF_CONTAINED_VARIANTS), *((v, "auto") for v in AUTO_VARIANTS)],
)
def test_compiled_gradients_equal_eager_on(variant, backend):
    """As test_compiled_gradients_equal_eager, on sdpa and auto."""
    check_joint_graph(layer(variant, backend))


@pytest.mark.parametrize(("backend", "train"), [*PASSES, ("auto", True)])
def test_a_parameter_that_changes_recompiles(backend, train):
    """window_size 4, then 8, then 4 again: one graph per value (patterns are built per value),
    each equal to eager; it once failed on the second value."""

    def local(q, k, v, window):
        return zoo.attention(q, k, v, variant="local", window_size=window, backend=chosen)

    chosen = eager_side(backend)
    counter = CompileCounter()
    compiled = torch.compile(local, backend=counter, fullgraph=True)
    q, k, v = (torch.randn(2, HEADS, LENGTH, 16, requires_grad=train) for _ in range(3))
    with torch.set_grad_enabled(train):
        for window in (4, 8, 4):
            torch.testing.assert_close(compiled(q, k, v, window), local(q, k, v, window))
    assert counter.frame_count == 2


SHAPES = [(180, 299, 4, 4, 16), (143, 268, 4, 2, 16), (143, 268, 4, 2, 8)]  # Lq, Lk, H, Hkv, D


def padded_gqa_calls(backend, compiler, shapes=SHAPES):
    def call(q, k, v, padding):
        return zoo.attention(
            q, k, v, variant="local", window_size=8, backend=chosen, key_padding_mask=padding
        )

    chosen = eager_side(backend)

    compiled = torch.compile(call, backend=compiler, fullgraph=True)
    for q_len, kv_len, heads, kv_heads, dim in shapes:
        q = torch.randn(2, heads, q_len, dim)
        k, v = torch.randn(2, kv_heads, kv_len, dim), torch.randn(2, kv_heads, kv_len, dim)
        padding = torch.zeros(2, kv_len, dtype=torch.bool)
        padding[1, -30:] = True
        yield compiled(q, k, v, padding), call(q, k, v, padding)


@pytest.mark.parametrize("backend", ["sdpa", "blocked", "auto"])
def test_a_shape_change_with_padding_and_gqa(backend):
    """The lengths, the key/value heads and the head size change between calls (dynamo then
    makes them symbolic): each compiled call equals eager; it once failed with a SymBool
    handed to SDPA's enable_gqa."""
    for got, expected in padded_gqa_calls(backend, "aot_eager"):
        torch.testing.assert_close(got, expected)


def test_a_shape_change_with_padding_and_gqa_on_flex_under_inductor():
    """The first shape, then the last: lengths, key/value heads and head size change at once (an
    Inductor compile of flex costs 15-20 s on a 2-core CPU with a cold cache)."""
    for got, expected in padded_gqa_calls("flex", "inductor", [SHAPES[0], SHAPES[-1]]):
        torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)


def test_the_first_zoo_call_may_be_inside_a_compiled_function():
    """A fresh process whose first zoo call is traced: reading the registry's files happens
    outside the graph (dynamo cannot trace ``open``)."""
    code = (
        "import torch, zoo\n"
        "f = torch.compile(lambda q: zoo.attention(q, q, q, variant='local', window_size=3),\n"
        "                  backend='eager', fullgraph=True)\n"
        "print(float(f(torch.ones(1, 1, 8, 4)).sum()))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True,
        timeout=subprocess_timeout(120),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert float(result.stdout.strip()) == 32.0


def test_a_refused_backend_names_itself_inside_a_full_graph():
    """A backend that cannot run the call, named inside ``torch.compile(fullgraph=True)``: the
    error carries the zoo's sentence (why, and which backends can). Dynamo could not trace the
    sentence's making (a sort of (name, backend) pairs, xformers' import) and raised its own
    "sort with non-constant keys" instead."""
    q = torch.randn(1, 2, 40, 16, requires_grad=True)

    def call(q):
        return zoo.attention(q, q, q, variant="local", window_size=4, backend="flex")

    compiled = torch.compile(call, backend="eager", fullgraph=True)
    with pytest.raises(Exception) as raised, warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        compiled(q)
    # dynamo calls an lru_cache's inner function uncached, and says so (xformers' probe)
    assert not [w for w in seen if "lru_cache" in str(w.message)]
    chain, error = [], raised.value
    while error is not None:
        chain.append(str(error))
        error = error.__cause__
    assert any("backend 'flex' cannot run this call" in s and "that can: " in s for s in chain)
