"""The one log-sum-exp merge (zoo/backends/lse_merge.py): partial attentions over disjoint key
sets merge to the softmax over their concatenated keys, in each form (two in place, a list in
place, a list under autograd, row ranges), with zeros and lse -inf, never nan, for a row that has
no key in some parts or in all; the gradients through the differentiable form (the blocked
backend's ``merge``) and the backward's pieces (``explicit_backward`` given the merged output and
``lse_for_backward``) equal autograd's through the concatenated softmax. Float64 throughout."""

from __future__ import annotations

import math

import pytest
import torch

from zoo.backends import lse_merge
from zoo.backends.blocked import Partial, merge
from zoo.backends.reference import exp_and_mass, safe_softmax

B, H, L, N, D, DV, PARTS = 2, 3, 9, 14, 4, 5, 3


def inputs(seed: int = 0, requires_grad: bool = False):
    """q, k, v; allowed pairs (B, H, L, N); the part each key belongs to (N,). Row 0 has no key
    at all, row 1 none in part 0, and each part holds keys."""
    generator = torch.Generator().manual_seed(seed)
    q, k, v = (
        torch.randn(B, H, n, d, generator=generator, dtype=torch.float64)
        for n, d in ((L, D), (N, D), (N, DV))
    )
    allowed = torch.rand(B, H, L, N, generator=generator) < 0.5
    part_of = torch.arange(N) % PARTS
    allowed[:, :, 0] = False
    allowed[:, :, 1] &= part_of != 0
    if requires_grad:
        q, k, v = (t.requires_grad_() for t in (q, k, v))
    return q, k, v, allowed, part_of


def masked_scores(q, k, allowed):
    return (q @ k.mT / math.sqrt(D)).masked_fill(~allowed, -math.inf)


def reference(q, k, v, allowed):
    """(out, lse) of the softmax over the allowed keys, all of them at once."""
    scores = masked_scores(q, k, allowed)
    return safe_softmax(scores) @ v, scores.detach().logsumexp(dim=-1)


def partial(q, k, v, allowed) -> Partial:
    """One part's attention as the blocked backend's explicit path keeps it."""
    exp, denominator, peak = exp_and_mass(masked_scores(q, k, allowed))
    output = (exp @ v) / torch.where(denominator > 0, denominator, 1)[..., None]
    return Partial(output, denominator, peak)


def parts(q, k, v, allowed, part_of) -> list[Partial]:
    return [partial(q, k, v, allowed & (part_of == i)) for i in range(PARTS)]


def check(out, lse, expected_out, expected_lse):
    assert not out.isnan().any() and not lse.isnan().any()
    torch.testing.assert_close(out, expected_out)
    torch.testing.assert_close(lse, expected_lse)


def test_a_partials_lse_is_the_log_sum_exp_of_its_scores():
    q, k, v, allowed, part_of = inputs()
    for i, p in enumerate(parts(q, k, v, allowed, part_of)):
        scores = masked_scores(q, k, allowed & (part_of == i))
        torch.testing.assert_close(p.lse(), scores.logsumexp(dim=-1))
    assert (parts(q, k, v, allowed, part_of)[0].lse()[:, :, :2] == -math.inf).all()


def test_combine_two_and_combine_equal_the_softmax_over_all_keys():
    q, k, v, allowed, part_of = inputs()
    expected_out, expected_lse = reference(q, k, v, allowed)
    ps = parts(q, k, v, allowed, part_of)
    outs, lses = [p.output.clone() for p in ps], [p.lse() for p in ps]
    first = outs[0]
    out, lse = lse_merge.combine(outs, lses)
    assert out is first  # in place
    check(out, lse, expected_out, expected_lse)
    assert (out[:, :, 0] == 0).all() and (lse[:, :, 0] == -math.inf).all()

    two = allowed & (part_of < 2)
    out, lse = lse_merge.combine_two(ps[0].output.clone(), lses[0], ps[1].output, lses[1])
    check(out, lse, *reference(q, k, v, two))


def test_merge_equals_the_softmax_over_all_keys():
    q, k, v, allowed, part_of = inputs()
    ps = parts(q, k, v, allowed, part_of)
    out, lse = lse_merge.merge([p.output for p in ps], [p.lse() for p in ps])
    check(out, lse, *reference(q, k, v, allowed))
    assert (out[:, :, 0] == 0).all() and (lse[:, :, 0] == -math.inf).all()
    # one part without any key: the others' merge, unchanged
    none = partial(q, k, v, torch.zeros_like(allowed))
    out_none, lse_none = lse_merge.merge(
        [p.output for p in (*ps, none)], [*map(Partial.lse, ps), none.lse()]
    )
    check(out_none, lse_none, out, lse)


def test_merge_rows_merges_row_ranges_and_leaves_uncovered_rows_empty():
    """Parts over disjoint keys, each for a range of the rows (overlapping); row L - 1 is in no
    range. The output is xFormers' layout (B, Lq, H, Dv), the lse (B, H, Lq)."""
    q, k, v, allowed, part_of = inputs(1)
    rows = [(0, 6), (3, L - 1), (2, 7)]
    covered = torch.zeros(L, N, dtype=torch.bool)
    partials = []
    for i, (start, stop) in enumerate(rows):
        p = partial(q, k, v, allowed & (part_of == i))
        partials.append((p.output[:, :, start:stop].transpose(1, 2), p.lse()[..., start:stop]))
        covered[start:stop] |= part_of == i
    out, lse = lse_merge.merge_rows(rows, partials, L)
    expected_out, expected_lse = reference(q, k, v, allowed & covered)
    check(out, lse, expected_out.transpose(1, 2), expected_lse)
    assert (out[:, L - 1] == 0).all() and (lse[..., L - 1] == -math.inf).all()


def test_merge_rows_weights_pieces_by_their_softmax_mass():
    """Two pieces over the same query, in float32 (what the xformers backend merges): the merged
    output is the softmax over both key sets."""
    generator = torch.Generator().manual_seed(0)
    scores = torch.randn(1, 1, 1, 6, generator=generator)
    values = torch.randn(1, 6, 1, 3, generator=generator)
    partials = []
    for keys in (slice(0, 2), slice(2, 6)):
        lse = torch.logsumexp(scores[..., keys], -1)
        weights = torch.softmax(scores[..., keys], -1)
        partials.append((torch.einsum("bhmn,bnhk->bmhk", weights, values[:, keys]), lse))
    out, lse = lse_merge.merge_rows([(0, 1), (0, 1)], partials, 1)
    expected = torch.einsum("bhmn,bnhk->bmhk", torch.softmax(scores, -1), values)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1))


@pytest.mark.parametrize("seed", [0, 1])
def test_gradients_through_the_blocked_merge_equal_the_concatenated_softmax(seed):
    q, k, v, allowed, part_of = inputs(seed, requires_grad=True)
    weights = torch.randn(B, H, L, DV, generator=torch.Generator().manual_seed(9), dtype=q.dtype)
    out = merge(parts(q, k, v, allowed, part_of))
    grads = torch.autograd.grad((out * weights).sum(), (q, k, v))
    expected = torch.autograd.grad((reference(q, k, v, allowed)[0] * weights).sum(), (q, k, v))
    for got, want in zip(grads, expected, strict=True):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want)


def test_merge_along_a_stacked_axis_equals_merge_with_its_gradient():
    """The stacked form (a query's chosen key blocks, ``flex_chosen``): the list form's output
    and log-sum-exp, a part without a key and a row without any included, and a gradcheck."""
    q, k, v, allowed, part_of = inputs()
    ps = parts(q, k, v, allowed, part_of)
    outs, lses = [p.output for p in ps], [p.lse() for p in ps]
    out, lse = lse_merge.merge_along(torch.stack(outs, dim=-2), torch.stack(lses, dim=-1))
    want_out, want_lse = lse_merge.merge(outs, lses)
    check(out, lse, want_out, want_lse)
    assert (out[:, :, 0] == 0).all() and (lse[:, :, 0] == -math.inf).all()
    generator = torch.Generator().manual_seed(4)
    stacked = torch.randn(2, 4, 3, 5, generator=generator, dtype=torch.float64)
    weights = torch.randn(2, 4, 3, generator=generator, dtype=torch.float64)
    weights[0, 0, 1] = -math.inf  # a part without a key
    inputs_ = (stacked.requires_grad_(), weights.requires_grad_())
    assert torch.autograd.gradcheck(lambda o, w: lse_merge.merge_along(o, w)[0], inputs_)


def test_merge_passes_gradcheck():
    generator = torch.Generator().manual_seed(3)
    outs = [torch.randn(2, 4, 3, generator=generator, dtype=torch.float64) for _ in range(3)]
    lses = [torch.randn(2, 4, generator=generator, dtype=torch.float64) for _ in range(3)]
    for t in (*outs, *lses):
        t.requires_grad_()

    def merged(*tensors):
        return lse_merge.merge(tensors[:3], tensors[3:])

    assert torch.autograd.gradcheck(merged, (*outs, *lses))


def test_explicit_backward_of_each_part_adds_up_to_the_gradient():
    """Each part's backward given the merged output and lse (+inf where a row has no key): the
    parts' dq add up, and each key's dk and dv come from its part, to autograd's gradients."""
    q, k, v, allowed, part_of = inputs(2, requires_grad=True)
    g = torch.randn(B, H, L, DV, generator=torch.Generator().manual_seed(5), dtype=q.dtype)
    expected_out, _ = reference(q, k, v, allowed)
    expected = torch.autograd.grad((expected_out * g).sum(), (q, k, v))
    q, k, v = q.detach(), k.detach(), v.detach()
    ps = parts(q, k, v, allowed, part_of)
    out, lse = lse_merge.merge([p.output for p in ps], [p.lse() for p in ps])
    lse = lse_merge.lse_for_backward(lse)
    assert (lse[:, :, 0] == math.inf).all()
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for i in range(PARTS):
        keys = part_of == i
        mask = torch.zeros(allowed.shape, dtype=q.dtype).masked_fill(~allowed, -math.inf)
        grads = lse_merge.explicit_backward(
            g, q, k[:, :, keys], v[:, :, keys], out, lse, mask[..., keys], 1 / math.sqrt(D)
        )
        dq += grads[0]
        dk[:, :, keys], dv[:, :, keys] = grads[1], grads[2]
    for got, want in zip((dq, dk, dv), expected, strict=True):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("causal", [False, True], ids=["masked", "causal"])
@pytest.mark.parametrize("head_dim,v_dim", [(16, 16), (16, 8), (8, 12)])
def test_kernel_partial_equals_the_dense_partial_with_the_gradient_of_its_lse(
    head_dim, v_dim, causal
):
    """``kernel_partial`` (the CPU kernel, its backward given lse's gradient through one more
    column) against ``partial`` on the same masked scores: out, lse and the gradients of q, k
    and v under a loss that reads both out and lse, in float64; a row with no key gives zeros,
    lse -inf and zero gradients."""
    g = torch.Generator().manual_seed(3)
    length = 23
    q, k = (torch.randn(2, 3, length, head_dim, generator=g, dtype=torch.float64) for _ in "qk")
    v = torch.randn(2, 3, length, v_dim, generator=g, dtype=torch.float64)
    allowed = torch.rand(1, 3, length, length, generator=g) > 0.4
    allowed[0, 0, 5] = False  # a row without a key
    if causal:
        allowed = torch.ones(1, 1, length, length, dtype=torch.bool).tril()
    mask = torch.zeros(allowed.shape, dtype=torch.float64).masked_fill(~allowed, -math.inf)
    grad_out = torch.randn(2, 3, length, v_dim, generator=g, dtype=torch.float64)
    grad_lse = torch.randn(2, 3, length, generator=g, dtype=torch.float64)

    def run(kernel: bool) -> list[torch.Tensor]:
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        if kernel:
            out, lse = lse_merge.kernel_partial(*inputs, None if causal else mask, 0.3, causal)
        else:
            scores = inputs[0] @ inputs[1].transpose(-1, -2) * 0.3 + mask
            out, lse = lse_merge.partial(scores, inputs[2])
        finite = torch.isfinite(lse)
        loss = (out * grad_out).sum() + (torch.where(finite, lse, 0) * grad_lse).sum()
        loss.backward()
        return [out, torch.where(finite, lse, -1.0), *(t.grad for t in inputs)]

    got, want = run(kernel=True), run(kernel=False)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=name)
    if not causal:
        assert torch.equal(got[1][:, 0, 5], torch.full((2,), -1.0))  # lse -inf: no key
        assert not got[0][:, 0, 5].any() and not got[2][:, 0, 5].any()
