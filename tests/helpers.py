"""Shared test helpers: the tolerance convention, the oracle, and small-size parameters.

Tolerance, after flash-attention's tests: a backend's error against a float64 oracle may be at
most twice the error of PyTorch's own attention in the same dtype (the test's), plus a
floor of a few float32 ulps of the largest reference value (1e-6 x max(1, |ref|)), so that an
unusually lucky baseline does not fail an equally good backend. The floor scales with the
magnitude because some gradients (a T5 table's) are sums over thousands of pairs.
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import zoo
from zoo.functional import prepare_call

FLOOR = 1e-6

# Small values for the registry's parameters, chosen by parameter name so that tests generated from
# the registry see sparse patterns at lengths of ~100 (the defaults are sized for thousands).
SMALL = {"window_size": 7, "block_size": 16, "stride": 9, "dilation": 3}
GRID_SMALL = {"kernel_size": 3, "dilation": 1, "window_size": 3}

# Variants with a fixed mask; those chosen by content (moba) have none and are tested against their
# definition in test_moba.py.
FIXED_VARIANTS = [name for name in zoo.list_variants() if not zoo.get_spec(name).build().routed]

# Variants whose pairs come with each call's data (graph: edge_index). The registry-wide tests call
# without such data and leave them out; tests/patterns/test_graph.py holds them to the reference.
GRAPH_VARIANTS = [
    name for name in zoo.list_variants() if zoo.patterns.reads_graph(zoo.get_spec(name).build())
]
SELF_CONTAINED_VARIANTS = [name for name in zoo.list_variants() if name not in GRAPH_VARIANTS]

HAS_CUDA = torch.cuda.is_available()


def _cxx_missing() -> bool:
    """Whether Inductor finds no C++ compiler here (torch.compile on a CPU needs one; a machine
    with only Python and pip, such as a slim container, has none)."""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        get_cpp_compiler()
    except Exception:
        return True
    return False


CXX_MISSING = _cxx_missing()
# A test whose compile failure a benchmark or the harness records as a cell (no exception to
# see: conftest skips those that raise Inductor's InvalidCxxCompiler by themselves).
CXX_REASON = "needs a C++ compiler (torch.compile on a CPU; install g++ or set CXX)"
needs_cxx = pytest.mark.skipif(CXX_MISSING, reason=CXX_REASON)
_NO_GPU = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU; this machine has none")


def pairwise(cases: list[tuple], kept: list[tuple]) -> list:
    """``cases`` for ``pytest.mark.parametrize``, those not in ``kept`` marked
    ``slow`` (the whole matrix; CI runs ``kept``, ZOO_SLOW=1 all): for a test whose cases each
    compile for seconds on a CPU, ``kept`` holds each value of every option at least once."""
    assert all(case in cases for case in kept), kept
    return [case if case in kept else pytest.param(*case, marks=pytest.mark.slow) for case in cases]


def subprocess_timeout(seconds: float) -> float:
    """A time-out for a test's subprocess that holds under load: ``seconds``, what the command may
    take on an idle 2-core machine, times ZOO_TEST_TIMEOUT_SCALE if set (e.g. 4 on a slow or busy
    machine), else times 2 x the CPU load (the 1-minute load average per core, at least 1). The
    time-out only stops a hung process; a command that is merely slow must not fail for it
    (compiled flex at every length, 480 s idle, timed out on a loaded 2-core machine)."""
    scale = os.environ.get("ZOO_TEST_TIMEOUT_SCALE")
    if scale:
        return seconds * float(scale)
    try:
        load = os.getloadavg()[0] / (os.cpu_count() or 1)
    except OSError:  # no load average on this platform
        load = 1.0
    return seconds * 2 * max(1.0, load)


def skip_without_fake_cuda() -> None:
    """Skip the test, with the reason, where fake CUDA tensors cannot be made (a CPU-only build
    of torch without a C++ compiler)."""
    from zoo.testing.fake_cuda import FakeCudaUnavailable, fake_cuda

    try:
        with fake_cuda():
            pass
    except FakeCudaUnavailable as error:
        pytest.skip(str(error))


def gpu(test):
    """Marks a test as a GPU test (``pytest -m gpu`` runs them all) and skips it without one."""
    return pytest.mark.gpu(_NO_GPU(test))


def small_params(variant: str) -> dict[str, object]:
    params = zoo.get_spec(variant).parameters()
    small = {k: v for k, v in SMALL.items() if k in params}
    if "dilation" in small and "window_size" in small:
        small["window_size"] = 4  # a dilated window of 4 keys, 3 apart, spans 12 on each side
    if "grid" in params:
        # 2-D patterns: grid=None takes the most nearly square grid of each test's length (70:
        # 7 x 10), which a kernel of 3 fits; a prime length (1 x 37) fits no 2-D kernel.
        small.update({k: v for k, v in GRID_SMALL.items() if k in params})
    return small


# Small parameters for the decoding tests (a cache of a few dozen slots).
CACHE_SMALL = {"window_size": 5, "block_size": 8, "stride": 6, "dilation": 3, "global_tokens": 1}


def cache_params(variant: str, length: int = 64, **more: object) -> dict[str, object]:
    """Small parameters for decoding (``more`` added where the variant takes them); a 2-D
    pattern gets a grid of ``length`` tokens, 8 per row: its pattern depends on the whole grid,
    so a cache for it decodes that grid (max_len = H·W)."""
    params = zoo.get_spec(variant).parameters()
    out = {k: v for k, v in {**CACHE_SMALL, **more}.items() if k in params}
    if variant == "dilated":
        out["window_size"] = 2
    if "grid" in params:
        grid = {"grid": (length // 8, 8), "kernel_size": 3, "dilation": 2, "window_size": 4}
        out.update({k: v for k, v in grid.items() if k in params})
    return out


def random_qkv(
    batch,
    heads,
    q_len,
    kv_len,
    head_dim=16,
    v_dim=None,
    dtype=torch.float32,
    device="cpu",
    seed=0,
    kv_heads=None,
):
    """q, k and v from a float64 normal draw; k and v with ``kv_heads`` heads (grouped-query
    attention) if given."""
    generator = torch.Generator().manual_seed(seed)
    kv_heads = heads if kv_heads is None else kv_heads
    shapes = [
        (batch, heads, q_len, head_dim),
        (batch, kv_heads, kv_len, head_dim),
        (batch, kv_heads, kv_len, v_dim or head_dim),
    ]
    return [
        torch.randn(s, generator=generator, dtype=torch.float64).to(device, dtype).requires_grad_()
        for s in shapes
    ]


def padding_mask(batch, kv_len, device="cpu"):
    """Sequence 0 unpadded, sequence 1 with its second half padding, others a third padded."""
    mask = torch.zeros(batch, kv_len, dtype=torch.bool, device=device)
    if batch > 1:
        mask[1, kv_len // 2 :] = True
    for b in range(2, batch):
        mask[b, -(kv_len // 3) :] = True
    return mask


def naive_attention(q, k, v, allowed, scale=None, pos=None):
    """Plain PyTorch attention computed in the inputs' dtype: the baseline of the convention.
    ``pos`` is a rotate or bias encoding, applied at the zoo's aligned positions. Grouped k and v
    are repeated to q's heads."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    q_pos = torch.arange(q.shape[2], device=q.device) + k.shape[2] - q.shape[2]
    k_pos = torch.arange(k.shape[2], device=q.device)
    if pos is not None and pos.kind == "rotate":
        q, k = pos.rotate(q, k, q_pos, k_pos)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = (q @ k.transpose(-1, -2)) * scale
    if pos is not None and pos.kind == "bias":
        heads = torch.arange(q.shape[1], device=q.device)[:, None, None]
        scores = scores + pos.bias(heads, q_pos[None, :, None], k_pos[None, None, :]).to(
            scores.dtype
        )
    scores = scores.masked_fill(~allowed, float("-inf"))
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return weights @ v


def outputs_and_grads(fn, tensors, grad_out):
    out = fn(*tensors)
    grads = torch.autograd.grad(out, tensors, grad_out, allow_unused=True)
    return [
        out.detach(),
        *(g if g is not None else torch.zeros_like(t) for g, t in zip(grads, tensors, strict=True)),
    ]


def assert_within_convention(results, baseline, oracle, names=("out", "dq", "dk", "dv")):
    """Each of results[i] is within 2x the baseline's error of oracle[i] (plus FLOOR)."""
    for name, got, base, ref in zip(names, results, baseline, oracle, strict=False):
        ref = ref.to(torch.float64)
        error = (got.to(torch.float64) - ref).abs().max().item()
        floor = FLOOR * max(1.0, ref.abs().max().item())
        allowed = 2 * (base.to(torch.float64) - ref).abs().max().item() + floor
        assert error <= allowed, (
            f"{name}: error {error:.3g} exceeds 2 x same-dtype PyTorch error + floor "
            f"= {allowed:.3g}"
        )


def allowed_mask(
    variant, causal, q_len, kv_len, key_padding, params, device="cpu", qk=None, pos=None
):
    """(B or 1, 1 or H, Lq, Lk) pairs that may attend: the pattern's dense view and the padding.
    A variant chosen by content has no fixed mask: its blocks are chosen from ``qk`` = (q, k)
    (turned by ``pos`` first, as attention does); one drawn per head (``Pattern.per_head``) is
    drawn for q's heads, as attention draws it."""
    is_pattern = isinstance(variant, zoo.Pattern)
    pattern = variant if is_pattern else zoo.get_spec(variant).build(**params)
    if pattern.routed or pattern.per_head:
        q, k = qk
        call = prepare_call(
            q, k, k, variant=variant, causal=causal, key_padding_mask=key_padding, pos=pos,
            **params,
        )  # fmt: skip
        mask = call.pattern.dense(q_len, kv_len).to(device)
    else:
        mask = zoo.dense_mask(variant, q_len, kv_len, causal=causal, **params)[None, None]
    mask = mask.to(device)
    return mask if key_padding is None else mask & ~key_padding[:, None, None, :]


def check_against_reference(
    variant,
    backend,
    *,
    q_len,
    kv_len,
    causal=False,
    padded=False,
    params=None,
    grads=True,
    dtype=torch.float32,
    device="cpu",
    head_dim=16,
    pos=None,
    v_dim=8,
    heads=2,
    kv_heads=None,
):
    """Output (and, with ``grads``, dq, dk, dv and the encoding's parameters' gradients) of
    ``backend`` against the float64 reference, by the tolerance convention, on 3 random sequences
    of ``heads`` heads (k and v with ``kv_heads``, grouped-query attention, if given); sequences 1
    and 2 padded if asked. ``pos``: an encoding instance for ``heads`` heads; ``v_dim``: the
    values' head size."""
    params = small_params(variant) if params is None else params
    q, k, v = random_qkv(
        3, heads, q_len, kv_len, head_dim=head_dim, v_dim=v_dim, dtype=dtype, device=device,
        kv_heads=kv_heads,
    )  # fmt: skip
    key_padding = padding_mask(3, kv_len, device=device) if padded else None
    generator = torch.Generator().manual_seed(1)
    grad_out = torch.randn(3, heads, q_len, v_dim, generator=generator).to(device, dtype)

    weights = [] if pos is None else list(pos.parameters())

    def run(choice):
        def fn(q, k, v, *_weights):
            return zoo.attention(
                q, k, v, variant=variant, backend=choice, causal=causal,
                key_padding_mask=key_padding, pos=pos, **params,
            )  # fmt: skip

        return fn

    def naive(q, k, v, *_weights):
        return naive_attention(q, k, v, mask, pos=pos)

    mask = allowed_mask(variant, causal, q_len, kv_len, key_padding, params, device, (q, k), pos)
    oracle_inputs = [t.detach().double().requires_grad_() for t in (q, k, v)]
    oracle = outputs_and_grads(run("reference"), [*oracle_inputs, *weights], grad_out.double())
    baseline = outputs_and_grads(naive, [q, k, v, *weights], grad_out)
    if grads:
        got = outputs_and_grads(run(backend), [q, k, v, *weights], grad_out)
    else:
        with torch.no_grad():
            got = [run(backend)(q.detach(), k.detach(), v.detach())]
    names = ["out", "dq", "dk", "dv"]
    names += [f"d{name}" for name, _ in ([] if pos is None else pos.named_parameters())]
    assert_within_convention(got, baseline, oracle, names)


class LargestTensor(TorchDispatchMode):
    """Records the most elements of any tensor an operation returns while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self.largest = max(self.largest, leaf.numel())
        return out


# A harness sweep of seconds a cell (tests/eval): MQAR at 32 tokens, a tiny model.
TINY_SWEEP = [
    "tasks=[mqar]",
    "task_params={mqar: {vocab_size: 32, num_kv_pairs: 4}}",
    "train_lengths=[32]",
    "test_lengths=[32, 64]",
    "encodings=[rope]",
    "model={dim: 32, depth: 2, heads: 2, mlp_dim: 0}",
    "train={steps: 20, batch_size: 8, eval_samples: 16, eval_batch_size: 8}",
]


@contextlib.contextmanager
def scalar_cpu_isa():
    """Within: Inductor writes scalar C++ for the CPU (the ``scalar_cpu_code`` fixture's body).

    The usable vector ISAs are pinned to none, not recomputed under ``cpp.vec_isa_ok=False``:
    torch caches each x86 ISA's truth for the process whatever that setting says. Recomputed
    (this body cleared the list and let torch recompute it, before), a worker that had compiled
    vectorized code kept vectorizing within, and vector code landed in Inductor's graph cache under
    the scalar setting's key; a worker whose first compile came within picked AVX2 for good, and a
    graph cached by a worker that picked AVX-512 (the same key) then ran compiled for AVX2 and gave
    garbage. The setting stays patched: it keys the graph cache apart from vectorized graphs."""
    import torch._inductor.config as inductor_config
    from torch._inductor import cpu_vec_isa

    with inductor_config.patch({"cpp.vec_isa_ok": False}), pytest.MonkeyPatch.context() as patch:
        patch.setattr(cpu_vec_isa, "valid_vec_isa_list", lambda: [])
        yield
