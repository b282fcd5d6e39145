"""Plans of plain calls (``zoo.core.call_plans``): a later call of a signature runs the first
call's plan, without the checked path, and computes exactly what the checked path computes;
a call of another signature, a call that is not plain, and a call after a name changed its
meaning take the checked path."""

from __future__ import annotations

import gc
import weakref
from unittest import mock

import pytest
import torch
from helpers import FIXED_VARIANTS, outputs_and_grads, padding_mask, random_qkv, small_params
from xformers_emulation import EmulatedXformers

import zoo
import zoo.backends
from zoo.backends import FlexBackend, ReferenceBackend, clear_caches, get_backend
from zoo.core import call_plans
from zoo.functional import prepare_call

# Eager flex (its kernel in plain PyTorch) runs every path of the flex plan on a CPU, parts in
# their own orders included; the compiled kernel shares that plan (FlexBackend.forward runs it).
BACKENDS = {"flex_eager": FlexBackend(compile=False), "xformers-emulated": EmulatedXformers()}
ALL = ("auto", "reference", "sdpa", "blocked", "flex_eager", "xformers-emulated")
CHECKED_PATH = "zoo.functional.prepare_call"


@pytest.fixture(autouse=True)
def fresh_plans():
    clear_caches()
    with mock.patch.dict(zoo.backends._BACKENDS, BACKENDS):
        yield
    clear_caches()  # no plan of a backend name the test added outlives it


def _checked_path_refused():
    return mock.patch(CHECKED_PATH, side_effect=AssertionError("the checked path ran"))


def _able(variant: str, causal: bool, params: dict, tensors, mask) -> list[tuple[str, bool]]:
    """(backend, with gradients) for each CPU backend that runs the call: with gradients where
    it has a backward pass on a CPU (eager flex declares none), else without."""
    able = []
    for grads in (True, False):
        inputs = tensors if grads else [t.detach() for t in tensors]
        call = prepare_call(
            *inputs, variant=variant, causal=causal, key_padding_mask=mask, **params
        )
        for name in ALL:
            known = any(n == name for n, _ in able)
            if not known and (name == "auto" or get_backend(name).reason_against(call) is None):
                able.append((name, grads))
    return able


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("variant", FIXED_VARIANTS)
def test_a_planned_call_computes_what_the_checked_path_computes(variant, causal, padded):
    """Every fixed variant on every CPU backend that runs it, at lengths no block divides, with
    grouped heads, with and without key padding (another mask on the second call, and NaN in
    its padded keys): the second call of a signature runs its plan (the checked path refuses to
    run) and its output and gradients equal, bit for bit, those of the checked path on the same
    inputs."""
    params = small_params(variant)
    masks = [None, None]
    if padded:
        masks = [padding_mask(2, 70), torch.zeros(2, 70, dtype=torch.bool)]
        masks[1][0, 50:] = True
    first = random_qkv(2, 4, 70, 70, head_dim=16, v_dim=8, kv_heads=2, seed=0)
    second = random_qkv(2, 4, 70, 70, head_dim=16, v_dim=8, kv_heads=2, seed=1)
    grad_out = torch.randn(2, 4, 70, 8, generator=torch.Generator().manual_seed(2))
    backends = _able(variant, causal, params, first, masks[0])
    assert {"auto", "reference", "flex_eager"} <= {name for name, _ in backends}
    for backend, grads in backends:

        def results(tensors, mask, backend=backend, grads=grads):
            def run(q, k, v):
                if mask is not None:  # padded keys may hold anything
                    k = torch.where(mask[:, None, :, None], float("nan"), k)
                return zoo.attention(
                    q, k, v, variant=variant, backend=backend, causal=causal,
                    key_padding_mask=mask, **params,
                )  # fmt: skip

            if grads:
                return outputs_and_grads(run, tensors, grad_out)
            return [run(*(t.detach() for t in tensors))]

        results(first, masks[0])  # the checked path, which keeps the plan
        with _checked_path_refused():
            planned = results(second, masks[1])
        clear_caches()
        checked = results(second, masks[1])
        for name, got, want in zip(("out", "dq", "dk", "dv"), planned, checked, strict=False):
            assert torch.equal(got, want), f"{backend}: {name} of the plan differs"


def test_another_signature_takes_the_checked_path_and_gets_its_own_plan():
    """A change of any part of the signature (a parameter, causal, the scale, the dtype, the
    length, whether gradients are recorded, the backend) is a new plan: each result equals the
    checked path's, and the first signature's plan still serves its calls."""
    q, k, v = (t.detach() for t in random_qkv(1, 2, 50, 50, seed=3))
    base = dict(variant="local", window_size=7)
    changes = [
        {}, {"window_size": 3}, {"causal": True}, {"scale": 0.5}, {"backend": "sdpa"},
        {"dtype": torch.float64}, {"length": 40}, {"grad": True},
    ]  # fmt: skip

    def call(change):
        options = {n: x for n, x in change.items() if n not in ("dtype", "length", "grad")}
        kwargs = {**base, **options}
        n = change.get("length", 50)
        tensors = [t[:, :, :n].to(change.get("dtype", torch.float32)) for t in (q, k, v)]
        if change.get("grad"):
            tensors = [t.requires_grad_() for t in tensors]
        return zoo.attention(*tensors, **kwargs).detach()

    planned = {}
    for change in changes:
        call(change)  # the checked path
        with _checked_path_refused():
            planned[repr(change)] = call(change)
    assert len(call_plans._PLANS) == len(changes)
    clear_caches()
    results = [call(change) for change in changes]
    for change, checked in zip(changes, results, strict=True):
        assert torch.equal(planned[repr(change)], checked), change
    assert not torch.equal(results[0], results[1])  # the changes change the result


@pytest.mark.parametrize(
    "options",
    [
        {"pos": zoo.build_encoding("t5", dim=32, num_heads=2)},  # learned: in no plan
        {"dropout_p": 0.1},
        {"return_weights": True, "backend": "reference"},
        {"variant": "moba", "block_size": 8, "top_k": 2},  # chosen by content: bound to the data
        {"backend": ReferenceBackend()},  # an instance may change: only names are planned
    ],
    ids=["learned_encoding", "dropout", "weights", "routed", "backend_instance"],
)
def test_a_call_that_is_not_plain_is_checked_every_time(options):
    q, k, v = torch.randn(3, 1, 2, 40, 16).unbind(0)
    kwargs = options if "variant" in options else {"variant": "local", "window_size": 5, **options}
    zoo.attention(q, k, v, **kwargs)
    assert not call_plans._PLANS
    with _checked_path_refused(), pytest.raises(AssertionError, match="the checked path ran"):
        zoo.attention(q, k, v, **kwargs)


@pytest.mark.parametrize("encoding", ["rope", "alibi", "rope_instance"])
@pytest.mark.parametrize("backend", ["auto", "sdpa", "blocked", "flex_eager"])
def test_a_planned_call_with_a_positional_encoding_computes_what_the_checked_path_does(
    encoding, backend
):
    """A rotary encoding turns q and k in the plan, a bias is in the backend's plan: output
    and gradients equal the checked path's, bit for bit, at queries aligned to the keys' end."""
    pos = (
        zoo.build_encoding("rope", dim=64, num_heads=4) if encoding == "rope_instance" else encoding
    )
    grads = backend != "flex_eager"
    first, second = (
        [t if grads else t.detach() for t in random_qkv(2, 4, 30, 45, head_dim=16, seed=s)]
        for s in (0, 1)
    )
    grad_out = torch.randn(2, 4, 30, 16, generator=torch.Generator().manual_seed(2))

    def results(tensors):
        def run(q, k, v):
            return zoo.attention(
                q, k, v, variant="local", window_size=6, causal=True, backend=backend, pos=pos
            )

        return outputs_and_grads(run, tensors, grad_out) if grads else [run(*tensors)]

    results(first)
    with _checked_path_refused():
        planned = results(second)
    clear_caches()
    for got, want in zip(planned, results(second), strict=True):
        assert torch.equal(got, want)


def test_fake_tensors_are_checked_every_time():
    """They build on their device under the caller's mode (``zoo.core.device_build``)."""
    from zoo.testing.fake_cuda import fake_cuda

    with fake_cuda():
        q = torch.randn(1, 2, 40, 16, device="cuda")
        zoo.attention(q, q, q, variant="local", window_size=5, backend="sdpa")
    assert not call_plans._PLANS


@pytest.mark.parametrize("backend", ["sdpa", "flex", "blocked"])
def test_a_plan_runs_on_fake_cuda_tensors_with_rotation_and_padding(backend):
    """What a plan does beyond its backend (turn q and k at positions it holds, check the
    padding mask and move it to q's device, zero padded keys) on CUDA tensors, faked on a
    machine without a GPU: no device mix, the output on q's device. The padding mask is a CPU
    tensor, as a data loader gives it."""
    from zoo.core.prepare import attention_encoding, plan_of
    from zoo.testing.fake_cuda import fake_cuda

    mask = torch.zeros(2, 45, dtype=torch.bool)
    mask[1, 30:] = True
    with fake_cuda():
        q = torch.randn(2, 4, 30, 16, device="cuda")
        k, v = torch.randn(2, 2, 45, 16, device="cuda"), torch.randn(2, 2, 45, 8, device="cuda")
        kwargs = dict(variant="local", window_size=6, causal=True, pos="rope")
        call = prepare_call(q, k, v, key_padding_mask=mask, **kwargs)
        encoding = attention_encoding("rope", q, k, True)
        plan = plan_of(call, get_backend(backend), encoding)
        out = plan(q, k, v, mask)
    assert type(plan).__name__ == "_Rotated" and out.device.type == "cuda"
    assert tuple(out.shape) == (2, 4, 30, 8)


def test_a_name_given_a_new_meaning_drops_the_plans():
    """Registering a backend under a taken name (``replace=True``) or clearing the caches
    forgets the plans: the next call runs the new backend."""

    class Plus(ReferenceBackend):
        name = "plan_probe"
        shift = 1.0

        def forward(self, call):
            out, weights = super().forward(call)
            return out + self.shift, weights

    class PlusTwo(Plus):
        shift = 2.0

    q = torch.randn(1, 1, 30, 8)
    zoo.register_backend(Plus())
    once = zoo.attention(q, q, q, variant="full", backend="plan_probe")
    assert torch.equal(zoo.attention(q, q, q, variant="full", backend="plan_probe"), once)
    assert len(call_plans._PLANS) == 1
    zoo.register_backend(PlusTwo(), replace=True)
    assert not call_plans._PLANS
    again = zoo.attention(q, q, q, variant="full", backend="plan_probe")
    torch.testing.assert_close(again, once + 1)


def test_a_variant_registered_again_with_replace_drops_the_plans():
    def band(width: int = 2):
        return zoo.patterns.Local(window_size=width)

    def wider_band(width: int = 5):
        return zoo.patterns.Local(window_size=width)

    try:
        zoo.register_pattern("plan_probe_band", description="a band")(band)
        q = torch.randn(1, 1, 30, 8)
        narrow = zoo.attention(q, q, q, variant="plan_probe_band")
        assert call_plans._PLANS
        zoo.register_pattern("plan_probe_band", description="a band", replace=True)(wider_band)
        assert not call_plans._PLANS
        wide = zoo.attention(q, q, q, variant="plan_probe_band")
        torch.testing.assert_close(wide, zoo.attention(q, q, q, variant="local", window_size=5))
        assert not torch.equal(wide, narrow)
    finally:
        from zoo import registry as zoo_registry
        from zoo.patterns import families

        zoo_registry.registry().variants.pop("plan_probe_band", None)
        families._FAMILIES.pop("plan_probe_band", None)
        families._CODE_VARIANTS.pop("plan_probe_band", None)


def test_plans_are_few_and_hold_no_tensor_of_the_call_that_made_them():
    with mock.patch.object(call_plans, "MAX_PLANS", 8):
        for n in range(10, 30):
            q = torch.randn(1, 1, n, 8)
            zoo.attention(q, q, q, variant="local", window_size=3, backend="flex_eager")
        assert len(call_plans._PLANS) == 8
    for backend, grads in (("sdpa", True), ("blocked", True), ("flex_eager", False)):
        q = torch.randn(1, 1, 33, 8, requires_grad=grads)
        out = zoo.attention(q, q, q, variant="local", window_size=3, backend=backend)
        if grads:
            out.sum().backward()
        del out
        gone = weakref.ref(q)
        del q
        gc.collect()
        assert gone() is None, backend


@pytest.mark.parametrize(
    "refused",
    [
        {"causal": 1},
        {"window_size": True},
        {"window_size": 1.0},
        {"scale": True},
        {"dropout_p": False},
    ],
    ids=["causal_1", "window_true", "window_float", "scale_true", "dropout_false"],
)
def test_a_value_the_checks_refuse_is_refused_after_an_equal_one_of_another_type_ran(refused):
    """1, 1.0 and True are equal keys: no cache (plans, patterns, the registry's builds) may
    answer for a value whose check raises, from the call of an equal value that passed."""
    q = torch.randn(1, 1, 30, 8)
    kwargs = {"variant": "local", "window_size": 1, "causal": True, "scale": 1, "dropout_p": 0}
    for _ in range(2):
        zoo.attention(q, q, q, **kwargs)
    with pytest.raises((TypeError, ValueError), match=f"{next(iter(refused))} must be"):
        zoo.attention(q, q, q, **{**kwargs, **refused})


def test_a_first_call_that_raises_or_sees_a_clear_keeps_no_plan():
    """A plan is kept once its first call has run, and only if nothing cleared the plans while
    it ran (a name registered anew meanwhile: that call resolved the old meaning)."""
    q = torch.randn(1, 1, 30, 8)
    with (
        mock.patch.object(
            ReferenceBackend, "call_plan", return_value=mock.Mock(side_effect=MemoryError)
        ),
        pytest.raises(MemoryError),
    ):
        zoo.attention(q, q, q, variant="full", backend="reference")
    assert not call_plans._PLANS
    made = zoo.core.prepare.plan_of

    def cleared_meanwhile(*args):
        plan = made(*args)
        clear_caches()  # as register_backend(..., replace=True) from another thread would
        return plan

    with mock.patch("zoo.functional.plan_of", cleared_meanwhile):
        zoo.attention(q, q, q, variant="full", backend="reference")
    assert not call_plans._PLANS
    zoo.attention(q, q, q, variant="full", backend="reference")
    assert len(call_plans._PLANS) == 1


@pytest.mark.parametrize("backend", ["auto", "blocked", "sdpa", "reference"])
@pytest.mark.parametrize("variant", ["causal", "local", "bigbird", "moba"])
def test_activation_checkpointing_recomputes_a_first_call_of_its_signature(variant, backend):
    """Non-reentrant activation checkpointing (transformers' gradient checkpointing) runs the
    forward, then recomputes it at backward, when the call's plan is made: the first call
    zeroed the padded keys and turned q and k twice with gradients recorded (its checked path,
    then its plan), its recomputation once, and the backward failed ("a different number of
    tensors was saved") at every new length of a padded batch (found by review). With rope and
    padding, the gradients equal those without checkpointing; moba, chosen by content, has no
    plan and its every call is prepared alike."""
    from torch.utils.checkpoint import checkpoint

    params = small_params(variant)
    q, k, v = random_qkv(2, 4, 37, 37, kv_heads=2, seed=3)
    padding = padding_mask(2, 37)
    grad_out = torch.randn(2, 4, 37, 16, generator=torch.Generator().manual_seed(1))

    def call(q, k, v):
        return zoo.attention(q, k, v, variant=variant, causal=True, backend=backend, pos="rope",
                             key_padding_mask=padding, **params)  # fmt: skip

    want = outputs_and_grads(call, [q, k, v], grad_out)
    clear_caches()  # the checkpointed call is the first of its signature
    got = outputs_and_grads(
        lambda *x: checkpoint(call, *x, use_reentrant=False), [q, k, v], grad_out
    )
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)
