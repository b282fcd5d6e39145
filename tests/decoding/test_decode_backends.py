"""Decoding with a cache on each backend, and for a pattern chosen by content: MoBA's prefill +
steps equal its causal forward (float64), and flex decoding (eager flex on CPU) matches the
reference decoding path (zoo.decoding.decode, zoo.backends.flex_decode)."""

import itertools

import pytest
import torch

import zoo
from zoo.backends import FlexBackend
from zoo.decoding.block_sums import block_sums

PARAMS = {
    "sliding_window": {"window_size": 5},
    "bigbird": {"block_size": 8, "global_blocks": 1, "random_blocks": 1},
    "moba": {"block_size": 4, "top_k": 2},
}

EAGER_FLEX = FlexBackend(block_size=16, compile=False)  # flex's eager path: CPU, tests only


def _decoded_rows(attn, x, lens, prefill=12, chunk=3, max_len=64):
    """Rows of different lengths: a prefill with valid_lens, a step of ``chunk`` tokens, then
    one at a time. Returns the cache and each row's outputs at its real tokens."""
    lens = torch.tensor(lens)
    with torch.no_grad():
        cache = attn.new_cache(len(lens), max_len)
        pre = attn(x[:, :prefill], cache=cache, valid_lens=lens)
        bounds = [prefill, prefill + chunk, *range(prefill + chunk + 1, x.shape[1] + 1)]
        steps = [attn(x[:, a:b], cache=cache) for a, b in itertools.pairwise(bounds)]
    for b, n in enumerate(lens.tolist()):
        assert not pre[b, n:].any(), "padding columns give zeros"
    rows = [torch.cat([pre[b, :n], *(s[b] for s in steps)]) for b, n in enumerate(lens.tolist())]
    return cache, rows


def _forward_rows(attn, x, lens, prefill=12):
    """Each row's forward over its own tokens: its first lens[b], then those from prefill on."""
    with torch.no_grad():
        return [attn(torch.cat([x[b, :n], x[b, prefill:]])[None])[0] for b, n in enumerate(lens)]


@pytest.mark.parametrize("backend", ["sdpa", "reference"])
def test_moba_decodes_as_its_causal_forward(backend):
    """MoBA keeps every key and chooses its blocks from the cache's block means at each call:
    the same choice as one causal forward, with rows of different lengths and grouped heads."""
    torch.manual_seed(3)
    attn = zoo.create_attention(
        "moba", dim=24, num_heads=6, num_kv_heads=2, causal=True, pos="rope", backend=backend,
        block_size=4, top_k=2,
    ).double().eval()  # fmt: skip
    x, lens = torch.randn(3, 40, 24, dtype=torch.float64), [12, 3, 0]
    cache, rows = _decoded_rows(attn, x, lens)
    for got, want in zip(rows, _forward_rows(attn, x, lens), strict=True):
        assert torch.allclose(got, want, atol=1e-10, rtol=0)
    assert cache.keys.shape[2] == 64, "every key is kept"
    assert cache.lengths.tolist() == [40, 31, 28]
    torch.manual_seed(3)
    dense = zoo.create_attention("causal", dim=24, num_heads=6, num_kv_heads=2, causal=True,
                                 pos="rope").double()  # fmt: skip
    with torch.no_grad():  # not causal attention in disguise: blocks were left out
        assert not torch.allclose(attn(x[:1]), dense(x[:1]), atol=1e-3)


def test_moba_steps_read_only_the_chosen_keys(monkeypatch):
    """A MoBA step on sdpa gathers each query head's chosen slots (a per-head choice, grouped
    heads, an ALiBi bias at the gathered keys' positions): the kernel sees (B, H, K, D) with K
    the most slots a head may choose (top_k blocks, known on the host), not the slots in use;
    while those copies would be more than the slots in use (a short cache), it reads the used
    slots in place, (B, H_kv, S, D). The output equals the reference decoding path."""
    seen = []
    kernel = torch.nn.functional.scaled_dot_product_attention

    def recorded(q, k, v, **kwargs):
        seen.append((q.shape[2], tuple(k.shape)))
        return kernel(q, k, v, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recorded)
    torch.manual_seed(5)
    attn = zoo.create_attention(
        "moba", dim=24, num_heads=6, num_kv_heads=2, causal=True, pos="alibi", backend="sdpa",
        block_size=4, top_k=2,
    ).double().eval()  # fmt: skip
    x, lens = torch.randn(2, 80, 24, dtype=torch.float64), [12, 5]
    got = _decoded_rows(attn, x, lens, max_len=128)[1]
    steps = [shape for t, shape in seen if t == 1]
    gathered = [shape for shape in steps if shape[:2] == (2, 6)]
    in_place = [shape for shape in steps if shape[:2] == (2, 2)]
    assert gathered and len(gathered) + len(in_place) == len(steps), steps
    assert all(shape[2] == 2 * 4 for shape in gathered), gathered
    assert all(shape[2] * 2 <= 2 * (2 * 4) * 6 for shape in in_place), in_place
    attn.backend = "reference"
    for g, w in zip(got, _decoded_rows(attn, x, lens, max_len=128)[1], strict=True):
        assert torch.allclose(g, w, atol=1e-10, rtol=0)


@pytest.mark.parametrize("variant", ["bigbird", "moba", "sliding_window"])
def test_masked_steps_run_grouped_heads_as_query_rows(monkeypatch, variant):
    """On CUDA (fake tensors here) a masked step's grouped query heads reach SDPA as extra query
    rows of their key/value head (no enable_gqa, which on CUDA sends a masked call to the math
    fallback, a copy of every key per query head); on a CPU only a mask that differs per head
    (a view), a shared one keeps enable_gqa (folding would copy it per head). Unmasked steps keep
    enable_gqa. CPU outputs equal the reference decoding path."""
    from zoo.testing.fake_cuda import FakeCudaUnavailable, fake_cuda

    seen = []
    original = torch.nn.functional.scaled_dot_product_attention

    def recording(q, k, v, attn_mask=None, **kwargs):
        per_head = attn_mask is not None and attn_mask.shape[1] > 1
        seen.append((q.is_cuda, q.shape[1], k.shape[1], attn_mask is not None, per_head,
                     kwargs.get("enable_gqa")))  # fmt: skip
        return original(q, k, v, attn_mask=attn_mask, **kwargs)

    def module():
        return zoo.create_attention(variant, dim=24, num_heads=6, num_kv_heads=2, causal=True,
                                    backend="sdpa", **PARAMS[variant]).eval()  # fmt: skip

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    torch.manual_seed(0)
    attn = module().double()
    x = torch.randn(2, 30, 24, dtype=torch.float64)
    got = _decoded_rows(attn, x, [12, 5])[1]
    try:
        with fake_cuda(), torch.no_grad():
            with torch.device("cuda"):
                on_cuda, y = module(), torch.randn(2, 20, 24)
                cache = on_cuda.new_cache(2, 32)
            # run outside torch.device("cuda"), as users do, so that a CPU tensor shows
            on_cuda(y[:, :12], cache=cache)
            for i in range(12, 20):
                on_cuda(y[:, i : i + 1], cache=cache)
    except FakeCudaUnavailable as error:
        pytest.skip(str(error))
    for cuda, q_heads, k_heads, masked, per_head, gqa in seen:
        folded = masked and (cuda or per_head)
        assert (q_heads, bool(gqa)) == ((k_heads, False) if folded else (3 * k_heads, True))
    assert any(cuda and masked for cuda, _, _, masked, _, _ in seen)  # CUDA's masked steps ran
    attn.backend = "reference"
    for g, w in zip(got, _decoded_rows(attn, x, [12, 5])[1], strict=True):
        assert torch.allclose(g, w, atol=1e-10, rtol=0)


def test_cache_keeps_block_sums_of_its_keys():
    """The cache's running block sums (``KVCache.key_block_sums``) equal the sums of its kept
    keys computed at once, after a padded prefill and steps, and start over after ``reset``."""
    attn = zoo.create_attention("moba", dim=24, num_heads=6, num_kv_heads=2, causal=True,
                                block_size=4, top_k=2).double().eval()  # fmt: skip
    x = torch.randn(2, 20, 24, dtype=torch.float64)
    cache, _ = _decoded_rows(attn, x, [12, 3], prefill=12, chunk=3)
    sums, counts = cache.key_block_sums(4)
    want_sums, want_counts = block_sums(cache.keys, cache.slot_pos >= 0, 4)
    assert torch.allclose(sums, want_sums, atol=1e-5) and torch.equal(counts, want_counts)
    assert counts.sum(1).tolist() == [20, 11]
    cache.reset()
    assert cache.key_block_sums(4)[1].sum() == 0


@pytest.mark.parametrize("chunk_blocks", [1, 2, 100], ids=["block", "two_blocks", "whole"])
def test_block_sums_a_few_blocks_at_a_time_equal_the_definition(monkeypatch, chunk_blocks):
    """``block_sums`` copies a few blocks of keys at a time (the whole float32 copy and its
    product with ``keep`` were each as large as k): the sums of the kept keys per block and
    their counts, a short last block and padding included, whatever the chunk."""
    import zoo.decoding.block_sums as sums_module

    B, H, L, D, block = 2, 3, 23, 5, 4
    monkeypatch.setattr(sums_module, "SUM_CHUNK", chunk_blocks * B * H * block * D)
    k = torch.randn(B, H, L, D, dtype=torch.bfloat16)
    keep = torch.rand(B, L) > 0.3
    sums, counts = block_sums(k, keep, block)
    assert sums.dtype == torch.float32 and sums.shape == (B, H, 6, D)
    for j in range(6):
        keys = slice(j * block, min((j + 1) * block, L))
        want = (k[:, :, keys].double() * keep[:, None, keys, None]).sum(2)
        assert torch.allclose(sums[:, :, j].double(), want, atol=1e-5, rtol=0), j
        assert torch.equal(counts[:, j], keep[:, keys].sum(1)), j


@pytest.mark.parametrize(
    ("variant", "pos", "lens"),
    [("sliding_window", "alibi", [12, 5, 0]), ("bigbird", "t5", [7, 12]),
     ("moba", "rope", [12, 3])],
)  # fmt: skip
def test_flex_decoding_matches_the_reference_path(variant, pos, lens):
    """backend=flex with a cache (eager flex on CPU, float32): its block mask reads the slots'
    absolute positions, so a wrapped ring, pinned keys, blocks chosen by content and rows of
    different lengths come out right. Against the reference decoding path in float64, within
    twice the error of sdpa decoding in float32 (the tolerance convention, after flash-attention's
    tests: at most twice the error of PyTorch's own attention in the same dtype)."""
    extra = PARAMS[variant]
    torch.manual_seed(4)
    attn = zoo.create_attention(
        variant, dim=24, num_heads=6, num_kv_heads=2, causal=True, pos=pos, backend=EAGER_FLEX,
        **extra,
    ).eval()  # fmt: skip
    x = torch.randn(len(lens), 18, 24, dtype=torch.float64)  # eager flex: 0.1 s a call
    # A prefill, then one token at a time: each new shape costs eager flex a trace (0.7 s).
    flex = _decoded_rows(attn, x.float(), lens, chunk=1)[1]
    attn.backend = "sdpa"
    sdpa = _decoded_rows(attn, x.float(), lens, chunk=1)[1]
    attn.backend = "reference"
    want = _decoded_rows(attn.double(), x, lens, chunk=1)[1]
    for f, s, w in zip(flex, sdpa, want, strict=True):
        assert (f - w).abs().max() <= 2 * (s - w).abs().max() + 1e-6
    cache = zoo.new_cache("sliding_window", batch_size=1, max_len=8, num_kv_heads=2, head_dim=8,
                          window_size=5)  # fmt: skip
    q = torch.zeros(1, 2, 1, 8)
    said = zoo.explain(q, q, q, variant="sliding_window", causal=True, window_size=5,
                       backend="flex", cache=cache)  # fmt: skip
    assert "decoding with a cache on flex" in said and "absolute positions" in said


def test_flex_decoding_refuses_dropout_and_float64():
    attn = zoo.create_attention("sliding_window", dim=16, num_heads=2, causal=True,
                                backend=EAGER_FLEX, dropout=0.1, window_size=4)  # fmt: skip
    with pytest.raises(
        ValueError,
        match=r"backend 'flex' cannot decode this call: it decodes without dropout, got "
        r"dropout_p=0.1; backends that can: reference, sdpa",
    ):
        attn(torch.randn(1, 3, 16), cache=attn.new_cache(1, 8))
    attn = attn.double().eval()
    cache = attn.new_cache(1, 8)
    with pytest.raises(
        ValueError,
        match=r"backend 'flex' cannot decode this call: it decodes float32, .*not float64",
    ):
        attn(torch.randn(1, 3, 16, dtype=torch.float64), cache=cache)
    assert cache.lengths.tolist() == [0] and (cache.slot_pos < 0).all(), "nothing changed"


def test_decoding_is_a_capability_of_a_backend():
    """A registered backend that declares decoding runs the steps of a cached call named for it
    (``Backend.decode_step``), not a path chosen by its name; one that declares none leaves them
    to sdpa, and ``explain`` says so."""
    from zoo.backends import ReferenceBackend

    class CountingReference(ReferenceBackend):
        name = "counting_reference"
        steps = 0

        def decode_step(self, step):
            type(self).steps += 1
            return super().decode_step(step)

    zoo.register_backend(CountingReference())
    try:
        outs = []
        for backend in ("counting_reference", "reference"):
            cache = zoo.new_cache("sliding_window", batch_size=1, max_len=8, num_kv_heads=2,
                                  head_dim=8, window_size=3)  # fmt: skip
            q = torch.randn(1, 2, 1, 8, generator=torch.Generator().manual_seed(0))
            outs.append(zoo.attention(q, q, q, variant="sliding_window", causal=True,
                                      window_size=3, cache=cache, backend=backend))  # fmt: skip
        assert CountingReference.steps == 1 and torch.equal(*outs)
    finally:
        del zoo.backends._BACKENDS["counting_reference"]
    cache = zoo.new_cache("sliding_window", batch_size=1, max_len=8, num_kv_heads=2, head_dim=8,
                          window_size=3)  # fmt: skip
    q = torch.zeros(1, 2, 1, 8)
    said = zoo.explain(q, q, q, variant="sliding_window", causal=True, window_size=3,
                       backend="blocked", cache=cache)  # fmt: skip
    assert "backend 'blocked' has no decoding path; a cached call runs on sdpa" in said


@pytest.mark.parametrize("batch", [1, 2])
def test_moba_decodes_on_compiled_flex_on_the_cpu(batch):
    """Compiled flex (not its eager path) decodes MoBA: its mask_mod reads the step's choice and
    each row's query offset, which Inductor's CPU lowering refused while the offsets were a
    column view of the positions (of one row too: a (1,) view keeps its stride through
    .contiguous()). Steps of rows of different lengths equal the reference path."""
    outs = {}
    for name, backend in (("flex", FlexBackend(block_size=16)), ("reference", "reference")):
        torch.manual_seed(4)
        attn = zoo.create_attention(
            "moba", dim=64, num_heads=4, num_kv_heads=2, causal=True, pos="rope",
            backend=backend, block_size=8, top_k=2,
        ).eval()  # fmt: skip
        x = torch.randn(batch, 20, 64)
        with torch.no_grad():
            cache = attn.new_cache(batch, 64)
            lens = torch.tensor([12, 5][:batch])
            got = [attn(x[:, :12], cache=cache, valid_lens=lens)[:, 11:12]]
            got += [attn(x[:, i : i + 1], cache=cache) for i in range(12, 20)]
        outs[name] = torch.cat(got, 1)
    assert torch.allclose(outs["flex"], outs["reference"], atol=2e-5, rtol=1e-4)
