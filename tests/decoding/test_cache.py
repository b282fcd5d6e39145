"""Generation with a KVCache: prefill + steps equal one causal forward, for every registry variant
and encoding, in the memory that the pattern needs (zoo.decoding.cache, zoo.decoding.decode,
zoo.patterns.retention).

Compared in float64, where the decoding path and the full forward agree to rounding (1e-10)."""

import itertools

import pytest
import torch
from helpers import FIXED_VARIANTS, cache_params

import zoo
from zoo.functional import resolve_pattern
from zoo.layout.block_layout import specialized
from zoo.patterns.random_blocks import draw_causal_blocks
from zoo.patterns.retention import last_needed

ENCODINGS = ["none", "sinusoidal", "learned", "rope", "alibi", "t5"]
CPU = torch.device("cpu")


def small(variant, length=64):
    return cache_params(variant, length)


def grid_variant(variant):
    return "grid" in zoo.get_spec(variant).parameters()


def module(variant, pos="none", backend="auto", kv_heads=1, **extra):
    torch.manual_seed(0)
    attn = zoo.create_attention(
        variant, dim=16, num_heads=2, num_kv_heads=kv_heads, causal=True, pos=pos,
        backend=backend, **{**small(variant), **extra},
    )  # fmt: skip
    return attn.double().eval()


def decode(attn, x, cuts, max_len=64):
    """Prefill x[:, :cuts[0]], then steps x[:, cuts[i]:cuts[i+1]], then one token at a time."""
    cache = attn.new_cache(x.shape[0], max_len)
    bounds = [0, *cuts, *range(cuts[-1] + 1, x.shape[1] + 1)]
    outs = [attn(x[:, a:b], cache=cache) for a, b in itertools.pairwise(bounds)]
    return torch.cat(outs, 1), cache


@pytest.mark.parametrize("pos", ENCODINGS)
@pytest.mark.parametrize("variant", [*FIXED_VARIANTS, "moba"])
def test_prefill_and_steps_equal_the_causal_forward(variant, pos):
    attn = module(variant, pos)
    # A 2-D pattern is decoded over its whole grid, 64 tokens; the others stop at any length.
    x = torch.randn(2, 64 if grid_variant(variant) else 43, 16, dtype=torch.float64)
    with torch.no_grad():
        got, cache = decode(attn, x, [11, 14])  # prefill 11, a step of 3, then 1 at a time
        assert torch.allclose(got, attn(x), atol=1e-10, rtol=0), (variant, pos)
    assert cache.lengths.tolist() == [x.shape[1]] * 2


@pytest.mark.parametrize("pos", ["rope", "sinusoidal", "learned"])
@pytest.mark.parametrize("backend", ["sdpa", "reference"])
@pytest.mark.parametrize("variant", ["sliding_window", "longformer", "bigbird", "strided"])
def test_rows_of_different_lengths_with_grouped_heads(variant, backend, pos):
    """Rows of different lengths: each row's positions its own (rotary angles; an absolute
    table's rows at each row's positions, zoo.decoding.generation.embed_at)."""
    torch.manual_seed(1)
    attn = zoo.create_attention(
        variant, dim=24, num_heads=6, num_kv_heads=2, causal=True, pos=pos, backend=backend,
        **small(variant),
    ).double().eval()  # fmt: skip
    x = torch.randn(3, 40, 24, dtype=torch.float64)
    lens = torch.tensor([12, 3, 0])
    with torch.no_grad():
        cache = attn.new_cache(3, 64)
        pre = attn(x[:, :12], cache=cache, valid_lens=lens)
        steps = [attn(x[:, 12 + i : 13 + i], cache=cache) for i in range(25)]
        for b in range(3):
            n = int(lens[b])
            whole = attn(torch.cat([x[b : b + 1, :n], x[b : b + 1, 12:37]], 1))
            got = torch.cat([pre[b : b + 1, :n], *(s[b : b + 1] for s in steps)], 1)
            assert torch.allclose(got, whole, atol=1e-10, rtol=0), b
            assert not pre[b, n:].any(), "padding columns give zeros"
    assert cache.lengths.tolist() == [37, 28, 25]


@pytest.mark.parametrize(
    ("variant", "pos"), [("sliding_window", "rope"), ("bigbird", "t5"), ("moba", "alibi")]
)
def test_gradients_through_the_cache_equal_those_of_the_forward(variant, pos):
    attn = module(variant, pos)
    x = torch.randn(2, 30, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(2, 30, 16, dtype=torch.float64)
    got, _ = decode(attn, x, [9, 12])
    grads = torch.autograd.grad((got * weight).sum(), [x, *attn.parameters()])
    want = torch.autograd.grad((attn(x) * weight).sum(), [x, *attn.parameters()])
    for g, w in zip(grads, want, strict=True):
        assert torch.allclose(g, w, atol=1e-10, rtol=0)


def test_ring_buffer_wraps_at_lengths_off_the_window():
    attn = module("sliding_window", "alibi", window_size=5)  # a ring of 6 slots
    x = torch.randn(1, 300, 16, dtype=torch.float64)
    with torch.no_grad():
        for cuts in ([263], [7, 10], [1, 300 - 1]):  # a prefill past CHUNK (256), and steps
            got, cache = decode(attn, x, cuts, max_len=400)
            assert torch.allclose(got, attn(x), atol=1e-10, rtol=0), cuts
            assert cache.keys.shape[2] == 6
            assert sorted(cache.slot_pos[0].tolist()) == list(range(294, 300))


@pytest.mark.parametrize(
    ("variant", "slots"),
    [
        ("sliding_window", lambda p: p["window_size"] + 1),
        ("block_local", lambda p: p["block_size"]),
        ("longformer", lambda p: p["window_size"] * p["dilation"] + 1 + p["global_tokens"]),
        ("dilated", lambda p: p["window_size"] * p["dilation"] + 1),
        ("global", lambda p: p["global_tokens"] * p["block_size"]),
    ],
)
def test_windowed_memory_does_not_grow_with_the_length(variant, slots):
    attn = module(variant)
    sizes = {n: attn.new_cache(2, n) for n in (64, 4096)}
    assert sizes[64].nbytes == sizes[4096].nbytes
    assert sizes[64].keys.shape[2] == slots(small(variant))
    full = module("causal")
    assert full.new_cache(2, 4096).nbytes > 60 * full.new_cache(2, 64).nbytes


@pytest.mark.parametrize("variant", FIXED_VARIANTS)
def test_the_cache_keeps_every_key_a_later_query_reads(variant):
    """The last reader found from block states is never before the true one (dense oracle), and
    is exact for the 1-D families. A 2-D pattern's block state over a span of grid rows in
    row-major order is conservative (PARTIAL where rows mix), so its cache keeps a few keys
    longer than needed, never fewer."""
    n = 96
    pattern = specialized(resolve_pattern(variant, True, small(variant, n)), n, n, CPU)
    dense = pattern.dense(n, n)
    rows = torch.arange(n)[:, None].expand(n, n)
    truth = torch.maximum(torch.where(dense, rows, -1).amax(0), torch.arange(n) - 1)
    found = last_needed(pattern, n)
    assert (found >= truth).all()
    if not grid_variant(variant):
        assert torch.equal(found, truth)


def test_causal_random_blocks_of_a_prefix_are_the_blocks_it_had_alone():
    assert torch.equal(draw_causal_blocks(40, 3, 7)[:9], draw_causal_blocks(9, 3, 7))
    table = draw_causal_blocks(40, 3, 7)
    assert (table <= torch.arange(40)[:, None]).all(), "only blocks at or before the query's"
    for variant in ("random", "bigbird"):
        params = small(variant)
        long = zoo.dense_mask(variant, 80, causal=True, **params)
        assert torch.equal(zoo.dense_mask(variant, 30, causal=True, **params), long[:30, :30])


def test_reset_reuses_the_cache():
    attn = module("longformer", "sinusoidal")
    x, y = (torch.randn(2, 20, 16, dtype=torch.float64) for _ in range(2))
    with torch.no_grad():
        _, cache = decode(attn, x, [5])
        before = cache.nbytes
        cache.reset()
        assert cache.lengths.tolist() == [0, 0] and cache.nbytes == before
        outs = [attn(y[:, :8], cache=cache)] + [
            attn(y[:, i : i + 1], cache=cache) for i in range(8, 20)
        ]
        assert torch.allclose(torch.cat(outs, 1), attn(y), atol=1e-10, rtol=0)


def test_functional_form_matches_the_full_call():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 30, 8, generator=g, dtype=torch.float64) for _ in range(3))
    k, v = k[:, :2], v[:, :2]
    kw = dict(variant="bigbird", causal=True, pos="alibi", **small("bigbird"))
    cache = zoo.new_cache("bigbird", batch_size=2, max_len=32, num_kv_heads=2, head_dim=8,
                          dtype=torch.float64, **small("bigbird"))  # fmt: skip
    outs = [zoo.attention(q[:, :, :10], k[:, :, :10], v[:, :, :10], cache=cache, **kw)]
    for i in range(10, 30):
        one = slice(i, i + 1)
        outs.append(zoo.attention(q[:, :, one], k[:, :, one], v[:, :, one], cache=cache, **kw))
    assert torch.allclose(torch.cat(outs, 2), zoo.attention(q, k, v, **kw), atol=1e-10, rtol=0)
    said = zoo.explain(q[:, :, :1], k[:, :, :1], v[:, :, :1], cache=cache, **kw)
    assert "on sdpa" in said and f"{cache.keys.shape[2]} slots" in said


@pytest.mark.parametrize("variant", ["causal", "sliding_window", "longformer"])
def test_a_step_the_host_knows_whole_writes_without_reading_its_slots(variant):
    """A one-token step of every row (no padding) into a cache that keeps every position: each
    token is written as it is, without reading what its slot held (an indexing op and a select
    that a GPU launches on every step), and the step equals the full call's last row; with
    padding, the padded row's slot keeps what it held (read and selected)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class SlotReads(TorchDispatchMode):
        def __init__(self, stores):
            super().__init__()
            self.stores, self.count = stores, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.index.Tensor and any(args[0] is s for s in self.stores):
                self.count += 1
            return func(*args, **(kwargs or {}))

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 21, 8, generator=g, dtype=torch.float64) for _ in range(3))
    kw = dict(variant=variant, causal=True, **small(variant))
    padding = torch.tensor([[False], [True]])
    for mask, reads in ((None, 0), (padding, 3)):  # keys, values and the slots' positions
        cache = zoo.new_cache(variant, batch_size=2, max_len=32, num_kv_heads=2, head_dim=8,
                              dtype=torch.float64, **small(variant))  # fmt: skip
        zoo.attention(q[:, :, :20], k[:, :, :20], v[:, :, :20], cache=cache, **kw)
        watch = SlotReads((cache.keys, cache.values, cache.slot_pos))
        with watch:
            out = zoo.attention(q[:, :, 20:], k[:, :, 20:], v[:, :, 20:], cache=cache,
                                key_padding_mask=mask, **kw)  # fmt: skip
        assert watch.count == reads
        want = zoo.attention(q, k, v, **kw)[:, :, 20:]
        assert torch.allclose(out[0], want[0], atol=1e-10, rtol=0)
        if mask is None:
            assert torch.allclose(out[1], want[1], atol=1e-10, rtol=0)


@pytest.mark.parametrize("pos", ["sinusoidal", "learned"])
def test_an_absolute_encoding_at_rows_of_different_lengths_builds_no_table_to_the_longest(pos):
    """Rows of different lengths (and every row of a static cache, whose host keeps no bound)
    take the encoding at their own positions (``table_at``), not a table of every position up
    to the longest row: a step's largest tensor stays far under max_len x dim, and its output
    equals the full forward's."""
    from helpers import LargestTensor

    torch.manual_seed(0)
    table = {"pos_params": {"max_len": 4096}} if pos == "learned" else {}
    attn = zoo.create_attention("sliding_window", dim=16, num_heads=2, causal=True, pos=pos,
                                window_size=4, **table).double().eval()  # fmt: skip
    x = torch.randn(2, 24, 16, dtype=torch.float64)
    want = attn(x)
    for static in (False, True):
        cache = attn.new_cache(2, 4000, static=static)
        with torch.no_grad():
            attn(x[:, :20], cache=cache, valid_lens=torch.tensor([20, 13]))
            watch = LargestTensor()
            with watch:
                out = attn(x[:, 20:21], cache=cache)
        assert watch.largest < 4000 * 16 // 10, (static, watch.largest)
        assert torch.allclose(out[0], want[0, 20:21], atol=1e-10, rtol=0)


def _state(cache):
    return [t.clone() for t in (cache.keys, cache.values, cache.slot_pos, cache.lengths)]


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda a, c, x: a(x[:, :10], cache=c), "step too long"),
        (lambda a, c, x: a(x[:, :1], cache=c, positions=torch.tensor([[5], [6]])), "out of order"),
        (lambda a, c, x: a(x[:1, :1], cache=c), "cache holds 2 sequences"),
        (lambda a, c, x: a.float()(x[:, :1].float(), cache=c), "float64"),
        (lambda a, c, x: module("sliding_window", window_size=4)(x[:, :1], cache=c), "window_size"),
        (lambda a, c, x: module("sliding_window", kv_heads=2)(x[:, :1], cache=c), "num_kv_heads"),
    ],
)
def test_refused_steps_name_the_problem_and_change_nothing(call, message):
    attn = module("sliding_window")
    x = torch.randn(2, 12, 16, dtype=torch.float64)
    with torch.no_grad():
        cache = attn.new_cache(2, 12)
        attn(x[:, :3], cache=cache)
        before = _state(cache)
        with pytest.raises(ValueError, match=message):
            call(attn, cache, x)
    assert all(torch.equal(a, b) for a, b in zip(before, _state(cache), strict=True))


def test_a_cache_needs_a_causal_module():
    with pytest.raises(ValueError, match="causal"):
        zoo.create_attention("sliding_window", dim=16, num_heads=2).new_cache(1, 8)


def test_a_mechanism_gets_no_cache_by_either_door():
    """Linear and low-rank mechanisms form no masked scores to cache: refused, by name."""
    module = zoo.create_attention("linear", dim=16, num_heads=2, causal=True)
    with pytest.raises(ValueError, match="'linear' is a mechanism"):
        module.new_cache(1, 8)
    q = torch.randn(1, 2, 4, 8)
    cache = zoo.new_cache("causal", batch_size=1, max_len=8, num_kv_heads=2, head_dim=8)
    with pytest.raises(ValueError, match="'linear' is a mechanism"):
        zoo.attention(q, q, q, variant="linear", causal=True, cache=cache)


@pytest.mark.parametrize("encoding", ["sinusoidal", "rope"])
def test_harness_model_generates_what_it_computes_teacher_forced(encoding):
    from eval.harness.model import SequenceModel

    torch.manual_seed(0)
    model = SequenceModel(
        vocab_size=12, num_classes=12, head="token", dim=16, depth=2, heads=2, mlp_dim=32,
        variant="longformer", encoding=encoding, causal=True,
        variant_params={"window_size": 4, "global_tokens": 1},
    )  # fmt: skip
    model = model.double().eval()
    tokens = torch.randint(0, 12, (3, 30))
    with torch.no_grad():
        assert torch.allclose(model.decode(tokens, 9), model(tokens), atol=1e-10, rtol=0)


def test_greedy_generation_feeds_back_the_argmax_of_full_forwards():
    """Greedy decoding through caches = the argmax loop over full causal forwards of the
    growing sequence: each step appends the argmax of the last position's logits."""
    from eval.harness.model import SequenceModel

    torch.manual_seed(0)
    model = SequenceModel(
        vocab_size=12, num_classes=12, head="token", dim=16, depth=2, heads=2, mlp_dim=32,
        variant="sliding_window", encoding="sinusoidal", causal=True,
        variant_params={"window_size": 4},
    ).eval()  # fmt: skip
    tokens = torch.randint(0, 12, (3, 24))
    prefill = 9
    with torch.no_grad():
        generated = model.decode(tokens, prefill, greedy=True).argmax(-1)
        grown = tokens[:, : prefill + 1]
        while grown.shape[1] < tokens.shape[1]:
            grown = torch.cat([grown, model(grown)[:, -1:].argmax(-1)], 1)
    assert torch.equal(generated[:, prefill:-1], grown[:, prefill + 1 :])
    assert not torch.equal(grown[:, prefill + 1 :], tokens[:, prefill + 1 :]), "it generated"


@pytest.mark.parametrize("variant", ["causal", "sliding_window", "longformer", "moba"])
def test_padding_holding_nan_reaches_no_real_token(variant):
    """Padding columns may hold anything (NaN here): the module's and the functional cached
    calls give the forward's output at every real token, zeros at padding, and keep no NaN.
    Before, a call of several tokens read its padded keys and values, and NaN spread to the
    row's real tokens (every cache with a ring, causal's too)."""
    attn = module(variant)
    x = torch.randn(2, 20, 16, dtype=torch.float64)
    lens = torch.tensor([20, 11])
    dirty = x.clone()
    dirty[1, 11:] = float("nan")
    with torch.no_grad():
        cache = attn.new_cache(2, 64)
        got = attn(dirty[:, :14], cache=cache, valid_lens=lens.clamp(max=14))
        assert torch.isfinite(cache.keys).all() and torch.isfinite(cache.values).all()
        step = attn(dirty[:, 14:17], cache=cache, valid_lens=torch.tensor([3, 0]))
        for row, n in enumerate(lens.clamp(max=14).tolist()):
            want = attn(x[row : row + 1, :n])
            assert torch.allclose(got[row : row + 1, :n], want, atol=1e-10, rtol=0), row
            assert (got[row, n:] == 0).all()
        assert torch.allclose(step[:1], attn(x[:1, :17])[:, 14:], atol=1e-10, rtol=0)
        assert (step[1] == 0).all()
    q, k, v = (torch.randn(2, 2, 6, 8, dtype=torch.float64) for _ in range(3))
    padding = torch.tensor([[False] * 6, [False] * 2 + [True] * 4])
    for t in (q, k, v):
        t[1, :, 2:] = float("nan")
    kw = dict(variant=variant, causal=True, **small(variant))
    cache = zoo.new_cache(variant, batch_size=2, max_len=64, num_kv_heads=2, head_dim=8,
                          dtype=torch.float64, **small(variant))  # fmt: skip
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = zoo.attention(q, k, v, cache=cache, key_padding_mask=padding, **kw)
    assert torch.isfinite(out).all() and (out[1, :, 2:] == 0).all()
    want = zoo.attention(q[1:, :, :2], k[1:, :, :2], v[1:, :, :2], **kw)
    assert torch.allclose(out[1:, :, :2], want, atol=1e-10, rtol=0)
    grads = torch.autograd.grad(out.sum(), (q, k, v))  # NaN queries reached no real key's
    assert all(torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("pos", ["none", "learned"])
def test_padding_holding_nan_reaches_no_parameter_gradient(pos):
    """A cached call that records gradients: NaN in padding columns reaches no parameter's
    gradient, which equals the gradient with finite padding. Before, the q, k and v projections'
    weight gradients were NaN (x summed over every column, padding included: 0 * NaN)."""
    x = torch.randn(2, 6, 16, dtype=torch.float64)
    dirty = x.clone()
    dirty[1, 3:] = float("nan")
    grads = []
    for inputs in (x, dirty):
        attn = module("causal", pos=pos).train()
        out = attn(inputs, cache=attn.new_cache(2, 16), valid_lens=torch.tensor([6, 3]))
        out.sum().backward()
        grads.append({name: p.grad for name, p in attn.named_parameters()})
    for name, grad in grads[1].items():
        assert torch.isfinite(grad).all(), name
        torch.testing.assert_close(grad, grads[0][name], rtol=0, atol=1e-12)


def test_a_learned_table_serves_rows_whose_padding_passes_its_end():
    """Only real tokens need a position: a finished row's padding, or a padded column, past a
    learned table's end is no error; a real token past it is (on a CPU, by the encoding)."""
    attn = module("causal", pos="learned", pos_params={"max_len": 16})
    x = torch.randn(2, 20, 16, dtype=torch.float64)
    with torch.no_grad():
        cache = attn.new_cache(2, 20)
        attn(x[:, :16], cache=cache, valid_lens=torch.tensor([16, 10]))
        out = attn(x[:, 16:17], cache=cache, valid_lens=torch.tensor([0, 1]))  # row 0 finished
        want = attn(torch.cat([x[1:, :10], x[1:, 16:17]], 1))[:, -1]
        assert torch.allclose(out[1], want, atol=1e-10, rtol=0) and (out[0] == 0).all()
        even = attn.new_cache(2, 20)
        attn(x[:, :15], cache=even)
        attn(x[:, 15:17], cache=even, valid_lens=torch.tensor([1, 1]))  # column 16: padding
        with pytest.raises(ValueError, match="max_len=16"):
            attn(x[:, 17:18], cache=even)


def test_a_step_that_cannot_record_gradients_is_refused_before_it_writes():
    """Flex has no backward on a CPU: a cached call that records gradients is refused by name
    before it writes (before, the kernel raised after the write: MoBA's block sums counted the
    key twice once the call was retried)."""
    from zoo.backends import FlexBackend

    attn = module("moba", backend=FlexBackend(block_size=16, compile=False)).float()
    x = torch.randn(2, 20, 16)
    with torch.no_grad():
        cache = attn.new_cache(2, 64)
        attn(x[:, :10], cache=cache)
        attn(x[:, 10:11], cache=cache)
    before = _state(cache) + [s.counts.clone() for s in cache._block_sums.values()]
    with pytest.raises(ValueError, match=r"no backward on cpu.*torch.no_grad.*can: .*sdpa"):
        attn(x[:, 11:12], cache=cache)
    after = _state(cache) + [s.counts.clone() for s in cache._block_sums.values()]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


def test_a_wrong_batch_is_refused_by_name_before_an_encoding_reads_it():
    attn = module("sliding_window", pos="sinusoidal")
    x = torch.randn(3, 12, 16, dtype=torch.float64)
    with torch.no_grad():
        cache = attn.new_cache(2, 12)
        attn(x[:2, :3], cache=cache, valid_lens=torch.tensor([3, 2]))
        with pytest.raises(ValueError, match="cache holds 2 sequences, x has 3"):
            attn(x[:, 3:4], cache=cache)


def test_explain_refuses_what_the_call_refuses():
    """``explain`` with a cache checks the call as ``attention`` does: causal, the cache's
    variant and parameters."""
    q = torch.randn(1, 2, 1, 8)
    cache = zoo.new_cache("sliding_window", batch_size=1, max_len=8, num_kv_heads=2, head_dim=8)
    assert "decoding with a cache" in zoo.explain(q, q, q, variant="sliding_window",
                                                  causal=True, cache=cache)  # fmt: skip
    q.requires_grad_(True)  # flex has no backward on a CPU: what the call would raise, said
    said = zoo.explain(q, q, q, variant="sliding_window", causal=True, cache=cache, backend="flex")
    assert "backend 'flex' cannot decode this call: it has no backward on cpu" in said
    for kw, message in (
        ({"variant": "causal", "causal": True}, "built for variant='sliding_window'"),
        ({"variant": "sliding_window", "causal": True, "window_size": 4}, "window_size"),
        ({"variant": "sliding_window"}, "must be causal"),
    ):
        with pytest.raises(ValueError, match=message):
            zoo.explain(q, q, q, cache=cache, **kw)


@pytest.mark.parametrize("variant", ["causal", "sliding_window", "moba"])
@pytest.mark.parametrize("static", [False, True])
def test_a_clone_forks_the_cache(variant, static):
    """``clone``: a prompt's cache forked for two continuations; each equals the forward over
    its own sequence, and neither sees the other's tokens (stores, lengths and MoBA's block sums
    of their own)."""
    attn = module(variant)
    x = torch.randn(2, 30, 16, dtype=torch.float64)
    a, b = (torch.randn(2, 6, 16, dtype=torch.float64) for _ in range(2))
    with torch.no_grad():
        cache = attn.new_cache(2, 64, static=static)
        attn(x, cache=cache, valid_lens=torch.tensor([30, 21]))
        attn(x[:, :1], cache=cache)  # a step: MoBA's block sums made
        fork = cache.clone()
        assert fork.keys.data_ptr() != cache.keys.data_ptr()
        outs = {}
        for name, c, y in (("a", cache, a), ("b", fork, b)):
            outs[name] = torch.cat([attn(y[:, j : j + 1], cache=c) for j in range(6)], 1)
        for name, y in (("a", a), ("b", b)):
            for row, n in enumerate((30, 21)):
                seq = torch.cat([x[row, :n], x[row, :1], y[row]])[None]
                want = attn(seq)[:, -6:]
                assert torch.allclose(outs[name][row : row + 1], want, atol=1e-10, rtol=0)


def test_a_cache_of_the_weights_dtype_under_autocast_names_the_dtype_to_build_it_in():
    """Under torch.autocast the module's projections give bfloat16 while ``module.new_cache``
    takes the weights' float32: the refusal said "build the cache with the model's dtype", which
    the caller had done."""
    attn = zoo.create_attention("causal", dim=32, num_heads=4, causal=True).eval()
    x = torch.randn(1, 6, 32)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(ValueError, match=r"new_cache\(\.\.\., dtype=torch.bfloat16\)"):
            attn(x, cache=attn.new_cache(1, 16))
        cache = attn.new_cache(1, 16, dtype=torch.bfloat16)
        assert attn(x, cache=cache).shape == (1, 6, 32)


def test_gradients_reach_cached_values_when_only_the_values_record_them():
    """A prefill whose v records gradients and k does not, then steps of plain tokens: the
    steps wrote the cache in place (only the call's k, v and the keys were asked), over the
    values the prefill's backward had saved, and the backward failed. Equal to the whole
    sequence's gradients."""
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, n, 6, 4, generator=generator, dtype=torch.float64) for n in (2, 1, 1))
    v.requires_grad_(True)
    cache = zoo.new_cache("causal", batch_size=1, max_len=16, num_kv_heads=1, head_dim=4,
                          dtype=torch.float64)  # fmt: skip
    parts = [zoo.attention(q[:, :, :4], k[:, :, :4], v[:, :, :4], variant="causal", causal=True,
                           cache=cache, backend="sdpa")]  # fmt: skip
    for j in (4, 5):
        parts.append(zoo.attention(q[:, :, j : j + 1], k[:, :, j : j + 1],
                                   v[:, :, j : j + 1].detach(), variant="causal", causal=True,
                                   cache=cache, backend="sdpa"))  # fmt: skip
    (got,) = torch.autograd.grad(torch.cat(parts, 2).sum(), v)
    whole = torch.cat([v[:, :, :4], v[:, :, 4:].detach()], 2)
    (want,) = torch.autograd.grad(
        zoo.attention(q, k, whole, variant="causal", causal=True).sum(), v
    )
    torch.testing.assert_close(got, want)


def test_cached_calls_refuse_what_they_cannot_use_by_name():
    """Found by review: a cache of another type, a mask of the wrong dtype, a graph (whose
    edges a cached call cannot take) and a module step without tokens, each refused saying
    what was given, where they failed deep inside or were taken."""
    q = torch.randn(2, 1, 3, 8)
    with pytest.raises(TypeError, match=r"cache must be a zoo KVCache .*got dict"):
        zoo.attention(q, q, q, variant="causal", causal=True, cache={"k": None})
    cache = zoo.new_cache("causal", batch_size=2, max_len=8, num_kv_heads=1, head_dim=8)
    with pytest.raises(ValueError, match=r"bool tensor .*got a \(2, 3\) int64 tensor"):
        zoo.attention(q, q, q, variant="causal", causal=True, cache=cache,
                      key_padding_mask=torch.zeros(2, 3, dtype=torch.long))  # fmt: skip
    with pytest.raises(ValueError, match=r"a cache cannot serve 'graph'.*edge_index"):
        zoo.new_cache("graph", batch_size=1, max_len=8, num_kv_heads=1, head_dim=8)
    for variant, params in (("causal", {}), ("moba", dict(block_size=4, top_k=2))):
        attn = zoo.create_attention(variant, dim=16, num_heads=2, causal=True, **params)
        cache = attn.new_cache(1, 10)
        attn(torch.randn(1, 3, 16), cache=cache)
        with pytest.raises(ValueError, match=r"x needs at least one position .*\(1, 0, 16\)"):
            attn(torch.randn(1, 0, 16), cache=cache)


def test_a_rollback_or_a_cache_type_that_cannot_work_is_named():
    """Found by review: a rollback past a row's tokens named ``cache.lengths`` (set to -2), not
    the n given; an integer cache was built and then refused by every call."""
    cache = zoo.new_cache("causal", batch_size=2, max_len=8, num_kv_heads=1, head_dim=4)
    q = torch.randn(2, 1, 3, 4)
    zoo.attention(q, q, q, variant="causal", causal=True, cache=cache,
                  key_padding_mask=torch.tensor([[False] * 3, [False, False, True]]))  # fmt: skip
    for n, shown in ((3, "n=3"), (torch.tensor([1, 3]), r"n=\[1, 3\]")):
        with pytest.raises(
            ValueError, match=rf"n must be at most .* row 1 holds 2 tokens, {shown}"
        ):
            cache.rollback(n)
    assert cache.lengths.tolist() == [3, 2]  # refused before anything changed
    with pytest.raises(ValueError, match=r"dtype must be a floating-point torch.dtype.*int64"):
        zoo.new_cache("causal", batch_size=1, max_len=8, num_kv_heads=1, head_dim=4,
                      dtype=torch.int64)  # fmt: skip
