"""``torch.export.export`` of models built from zoo calls and modules: the exported program equals
eager, later eager calls are untouched (the per-shape caches hold no tensors of the export's fake
mode), and a dynamic sequence length is refused with a sentence that says why."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor

import zoo

BACKENDS = ["sdpa", "flex", "auto", "reference", "blocked"]


class Functional(torch.nn.Module):
    def __init__(self, backend: str, variant: str = "local", **params: object) -> None:
        super().__init__()
        self.backend, self.variant, self.params = backend, variant, params

    def forward(self, q, k, v, padding=None):
        return zoo.attention(
            q, k, v, variant=self.variant, backend=self.backend, key_padding_mask=padding,
            **self.params,
        )  # fmt: skip


def qkv(length: int = 36) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(length)
    return tuple(torch.randn(2, 2, length, 8, generator=generator) for _ in range(3))


@pytest.fixture(autouse=True)
def fresh_caches():
    """Export at a shape no eager call has built first: where the bug lived."""
    zoo.backends.clear_caches()
    yield


@pytest.mark.parametrize("backend", BACKENDS)
def test_export_then_eager(backend):
    model = Functional(backend, window_size=4)
    inputs = qkv()
    program = torch.export.export(model, inputs)
    out = model(*inputs)
    assert not isinstance(out, FakeTensor)
    torch.testing.assert_close(program.module()(*inputs), out)
    torch.testing.assert_close(out, Functional("reference", window_size=4)(*inputs))


@pytest.mark.parametrize("backend", ["sdpa", "auto", "reference"])
def test_export_with_key_padding(backend):
    model = Functional(backend, variant="full")
    padding = torch.zeros(2, 36, dtype=torch.bool)
    padding[1, 20:] = True
    inputs = (*qkv(), padding)
    program = torch.export.export(model, inputs)
    out = model(*inputs)
    assert not isinstance(out, FakeTensor)
    torch.testing.assert_close(program.module()(*inputs), out)


@pytest.mark.parametrize("backend", ["sdpa", "auto"])
def test_export_a_module(backend):
    torch.manual_seed(0)
    model = zoo.MultiHeadAttention(16, 2, variant="bigbird", block_size=8, backend=backend).eval()
    x = torch.randn(2, 37, 16)
    program = torch.export.export(model, (x,))
    out = model(x)
    assert not isinstance(out, FakeTensor)
    torch.testing.assert_close(program.module()(x), out)


def test_a_dynamic_length_is_refused_with_the_reason():
    length = torch.export.Dim("length", min=8, max=512)
    shapes = ({2: length}, {2: length}, {2: length})
    with pytest.raises(ValueError, match="export once per length"):
        torch.export.export(Functional("sdpa", window_size=4), qkv(), dynamic_shapes=shapes)
    out = Functional("sdpa", window_size=4)(*qkv())
    assert not isinstance(out, FakeTensor)


@pytest.mark.parametrize(
    "kwargs", [dict(variant="causal", backend="sdpa"), dict(variant="local", window_size=4,
                                                           backend="blocked")],
)  # fmt: skip
def test_export_of_a_cuda_model_on_a_machine_without_a_gpu(kwargs):
    """torch.export on fake CUDA tensors (a CUDA model exported on a CPU build machine): the
    per-shape builds there are never cached entries, and naming one for the graph recursed
    without end (RecursionError)."""
    from zoo.testing.fake_cuda import FakeCudaUnavailable, fake_cuda

    class Model(torch.nn.Module):
        def forward(self, q):
            return zoo.attention(q, q, q, **kwargs)

    try:
        context = fake_cuda()
    except FakeCudaUnavailable as error:
        pytest.skip(str(error))
    with context:
        q = torch.randn(1, 2, 32, 16, device="cuda")
    program = torch.export.export(Model(), (q,))
    output = next(n for n in program.graph.nodes if n.op == "output")
    out = output.args[0][0].meta["val"]
    assert out.shape == (1, 2, 32, 16) and out.device.type == "cuda"
