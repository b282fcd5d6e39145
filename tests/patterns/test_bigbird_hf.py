"""BigBird against Hugging Face's block-sparse BigBird (``transformers.models.big_bird``): given
the same random tables, the zoo's ``bigbird`` (ITC: window of three blocks, the first and the last
block global, random blocks per head outside both) computes HF's output to float32 rounding,
every head in one call.

HF draws its random table inside ``bigbird_block_sparse_attention`` (``_bigbird_block_rand_mask
_with_head``, numpy, one table per head, and all zeros in eval mode); the tests replace that
function on the instance to hand it the zoo's per-head tables (or the shared one, repeated), or
take HF's own per-head draw and give the zoo all of it as one [H, blocks, r] ``RandomBlocks``.
HF's block-sparse path needs the length a multiple of the block, and the length must avoid
1024, 3072 and 4096, where HF takes an older generator."""

import numpy as np
import pytest
import torch

import zoo
from zoo.functional import resolve_pattern
from zoo.layout.block_layout import specialized, with_heads
from zoo.patterns import BlockLocal, Global, RandomBlocks

transformers = pytest.importorskip(
    "transformers", reason="compares with Hugging Face's BigBird: pip install transformers"
)
big_bird = pytest.importorskip("transformers.models.big_bird.modeling_big_bird")

B, H, D = 2, 3, 8
CPU = torch.device("cpu")
TOLERANCE = 5e-7 * 2  # float32: one or two units in the last place of outputs of size ~1


def hf_module(block: int, random_blocks: int):
    config = transformers.BigBirdConfig(
        hidden_size=H * D, num_attention_heads=H, block_size=block,
        num_random_blocks=random_blocks, attention_type="block_sparse",
        max_position_embeddings=4096,
    )  # fmt: skip
    return big_bird.BigBirdBlockSparseAttention(config).eval()


def hf_attention(module, q, k, v, tables):
    """HF's block-sparse attention over q, k, v (B, H, n, D), no padding, with ``tables[h]``
    ([blocks, r]: the random key blocks of each query block) as its random table."""
    block, r = module.block_size, module.num_random_blocks
    n = q.shape[2]
    blocks = n // block
    # HF's table has no rows for the two global query blocks, the first and the last.
    rows = [t[1:-1].cpu().numpy().astype(np.int32) for t in tables]
    module._bigbird_block_rand_mask_with_head = lambda **_: rows
    ones = torch.ones(B, n)
    blocked = ones.view(B, blocks, block)
    around = torch.cat([blocked[:, 1:-3], blocked[:, 2:-2], blocked[:, 3:-1]], dim=2)
    band = torch.einsum("blq,blk->blqk", blocked[:, 2:-2], around)[:, None]
    out, _ = module.bigbird_block_sparse_attention(
        q, k, v, band, ones.view(B, 1, n, 1), ones.view(B, 1, 1, n), blocked, blocked,
        H, r, D, block, block, B, n, n, seed=None, plan_from_length=None, plan_num_rand_blocks=None,
    )  # fmt: skip
    return out.transpose(1, 2)  # (B, H, n, D)


def zoo_table(n: int, heads: int | None = None, **params) -> torch.Tensor:
    """The random table of ``bigbird`` at length n: [blocks, r] (head 0's, or the shared one), or
    with ``heads`` the [heads, blocks, r] tables a call with that many query heads draws."""
    pattern = specialized(resolve_pattern("bigbird", False, params), n, n, CPU)
    if heads is not None:
        pattern = with_heads(pattern, heads)
    return next(c for c in pattern.children if isinstance(c, RandomBlocks)).table


def qkv(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, n, D, generator=g) for _ in range(3)]


@pytest.mark.parametrize("backend", ["reference", "sdpa", "blocked"])
@pytest.mark.parametrize(
    ("block", "random_blocks", "blocks", "seed"), [(16, 3, 10, 0), (16, 3, 13, 5), (8, 2, 9, 1)]
)
def test_bigbird_equals_hugging_face_given_the_same_random_table(
    backend, block, random_blocks, blocks, seed
):
    """The default draws per head: HF given the zoo's H tables computes the zoo's output, every
    head at once; ``random_per_head=False`` (one table) equals HF given that table for each head."""
    n = block * blocks
    params = dict(block_size=block, random_blocks=random_blocks, seed=seed)
    tables = zoo_table(n, H, **params)
    assert tables.shape[0] == H and (tables >= 0).all(), "random_blocks in every row, every head"
    assert len({tuple(t.flatten().tolist()) for t in tables}) == H, "each head its own table"
    q, k, v = qkv(n, seed)
    want = hf_attention(hf_module(block, random_blocks), q, k, v, list(tables))
    got = zoo.attention(q, k, v, variant="bigbird", backend=backend, **params)
    assert (got - want).abs().max().item() <= TOLERANCE
    shared = dict(params, random_per_head=False)
    want = hf_attention(hf_module(block, random_blocks), q, k, v, [zoo_table(n, **shared)] * H)
    got = zoo.attention(q, k, v, variant="bigbird", backend=backend, **shared)
    assert (got - want).abs().max().item() <= TOLERANCE


def test_the_old_forms_differ_from_hugging_face():
    """The test above can fail: blocks 0 and 1 global (``first``), random blocks drawn among all
    blocks (``all``, which lands on the window and the globals), or one table for every head
    (``random_per_head=False``, against HF's per-head draw) give other outputs."""
    n, params = 160, dict(block_size=16, random_blocks=3)
    q, k, v = qkv(n)
    want = hf_attention(hf_module(16, 3), q, k, v, list(zoo_table(n, H, **params)))
    olds = (dict(global_position="first"), dict(random_among="all"), dict(random_per_head=False))
    for old in olds:
        got = zoo.attention(q, k, v, variant="bigbird", backend="reference", **params, **old)
        assert (got - want).abs().max().item() > 1e-3, old


def test_hugging_face_own_per_head_draw_is_the_zoo_structure():
    """HF's own draw (training mode, one table per head), each head's table given to the zoo's
    BigBird union: every head's output equals HF's."""
    block, r, n = 16, 3, 16 * 12
    module = hf_module(block, r).train()
    np.random.seed(3)
    plan, counts = module._get_rand_attn_plan(n, block, r)
    drawn = module._bigbird_block_rand_mask_with_head(
        from_seq_length=n, to_seq_length=n, from_block_size=block, to_block_size=block,
        num_heads=H, plan_from_length=plan, plan_num_rand_blocks=counts,
    )  # fmt: skip
    # The global query rows (first, last) read every key: their table rows do not matter.
    tables = [torch.nn.functional.pad(torch.from_numpy(t).long(), (0, 0, 1, 1)) for t in drawn]
    q, k, v = qkv(n, 3)
    want = hf_attention(module.eval(), q, k, v, tables)
    window, globals_ = BlockLocal(block, neighbors=1), Global((0, n // block - 1), block)
    for h, table in enumerate(tables):
        pattern = window | globals_ | RandomBlocks(block, table)
        one = [t[:, h : h + 1] for t in (q, k, v)]
        got = zoo.attention(*one, variant=pattern, backend="reference")
        assert (got[:, 0] - want[:, h]).abs().max().item() <= TOLERANCE, h
    # All heads in one call: HF's per-head draw as the zoo's per-head table [H, blocks, r].
    per_head = window | globals_ | RandomBlocks(block, torch.stack(tables))
    assert per_head.per_head and not per_head.routed
    assert len({tuple(t.flatten().tolist()) for t in tables}) == H, "HF drew a table per head"
    for backend in ("reference", "sdpa", "blocked"):
        got = zoo.attention(q, k, v, variant=per_head, backend=backend)
        assert (got - want).abs().max().item() <= TOLERANCE, backend
    shared = window | globals_ | RandomBlocks(block, tables[0])  # head 0's for every head
    got = zoo.attention(q, k, v, variant=shared, backend="reference")
    assert (got[:, 1:] - want[:, 1:]).abs().max().item() > 1e-3, "one table is not HF's draw"
